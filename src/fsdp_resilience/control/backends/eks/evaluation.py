"""The EKS backend's evaluation: run a one-pod evaluation Job (manifests.evaluation_job) to its
end and read its result (``<run_dir>/eval.json``) from the FSx mount. What
EksBackend.run_evaluation does once it has the Job.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from fsdp_resilience.control.backends.base import BackendError
from fsdp_resilience.control.backends.eks.client import KubeClient
from fsdp_resilience.control.backends.eks.constants import LABEL_JOB
from fsdp_resilience.control.backends.eks.status import conditions_of


def wait_for_evaluation_job(
    kube: KubeClient, job: dict[str, Any], *, timeout_s: float, poll_s: float, namespace: str
) -> None:
    """Create the evaluation Job unless it exists (a retried task waits for the same Job), then
    wait until it completes; BackendError when it fails (with its log's tail) or times out."""
    name = job["metadata"]["name"]
    deadline = time.time() + timeout_s
    if kube.get_job(name) is None:
        kube.create_job(job)
    while True:
        current = kube.get_job(name) or {}
        conds = {t for t, c in conditions_of(current).items() if c.get("status") == "True"}
        if conds & {"Complete", "SuccessCriteriaMet"}:
            break
        if conds & {"Failed", "FailureTarget"}:
            pods = kube.list_pods(f"{LABEL_JOB}={name}")  # our label: on every pod of the Job
            tail = kube.pod_log(pods[-1]["metadata"]["name"], 50) if pods else "(no pod)"
            raise BackendError(f"evaluation job {name} failed; its log ends:\n{tail}")
        if time.time() > deadline:
            raise BackendError(
                f"evaluation job {name} did not finish within {timeout_s:.0f}s; "
                f"see `kubectl -n {namespace} describe job {name}`"
            )
        time.sleep(poll_s)


def read_evaluation_result(run_dir: str, job_name: str) -> dict[str, Any]:
    """The finished evaluation's ``<run_dir>/eval.json``; BackendError when this worker cannot read it."""
    result = Path(run_dir, "eval.json")
    try:
        return json.loads(result.read_text())
    except (OSError, ValueError) as e:
        raise BackendError(
            f"evaluation job {job_name} succeeded but {result} is unreadable here ({e}); is FSx "
            "mounted in the Airflow workers at the same path as in the pods?"
        ) from e
