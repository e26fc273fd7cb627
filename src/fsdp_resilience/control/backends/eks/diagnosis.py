"""The EKS backend's diagnosis of a failed launch (what EksBackend.diagnose returns): which nodes
to blame, and why. Node evidence from the cluster comes first (nodes.suspect_nodes); without it,
the run's events on the FSx mount, else the nodes whose pods reported the failure, else every
node the job ran on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fsdp_resilience.control.backends.base import Diagnosis, JobHandle, JobStatus
from fsdp_resilience.control.backends.eks.client import KubeClient
from fsdp_resilience.control.backends.eks.constants import LABEL_JOB
from fsdp_resilience.control.backends.eks.nodes import suspect_nodes
from fsdp_resilience.control.backends.eks.status import job_status, run_config_of
from fsdp_resilience.control.backends.evidence import blame_from_events
from fsdp_resilience.training.contract import REPLACEABLE_FAILURES, what_to_do


def diagnose_job(kube: KubeClient, handle: JobHandle, job: dict[str, Any], *, provisions_on_demand: bool) -> Diagnosis:
    """Diagnose ``handle``'s Job (read by the caller through ``kube``)."""
    pods = kube.list_pods(f"{LABEL_JOB}={handle.job_name}")
    status = job_status(job, pods, provisions_on_demand=provisions_on_demand)
    failure = status.failure_class
    if status.state != "failed":
        return Diagnosis(failure, [], False, [f"job {handle.job_name} is {status.state}: nothing to diagnose"])
    evidence = [f"status: {status.message}"]
    if failure not in REPLACEABLE_FAILURES:  # a user, storage or data fault; unknown: don't guess
        return Diagnosis(failure, [], False, evidence + [f"{failure}: {what_to_do(failure)}"])
    job_nodes = sorted(
        {n.node_id for n in status.nodes if n.node_id} | {(p.get("spec") or {}).get("nodeName") for p in pods} - {None}
    )
    bad, why = suspect_nodes(kube, job_nodes, status, pods)
    evidence += why
    if bad:
        return Diagnosis(failure, sorted(bad), True, evidence)
    return blame_without_node_evidence(handle, job, status, job_nodes, evidence)


def blame_without_node_evidence(
    handle: JobHandle, job: dict[str, Any], status: JobStatus, job_nodes: list[str], evidence: list[str]
) -> Diagnosis:
    """No node says it is unhealthy: blame from the run's events (FSx mounted in this worker),
    else the nodes whose pod reported the failure, else every node of the job."""
    failure = status.failure_class
    cfg = run_config_of(job)
    run_dir = cfg.run_dir if cfg else handle.extra.get("run_dir")
    if run_dir and Path(run_dir).is_dir():  # FSx mounted in this worker
        blamed, why = blame_from_events(run_dir, handle.launch_id, status, job_nodes)
        return Diagnosis(failure, blamed, bool(blamed), evidence + why)
    reporting = sorted({n.node_id for n in status.nodes if n.failure_class == failure and n.node_id})
    if reporting:
        return Diagnosis(
            failure,
            reporting,
            True,
            evidence
            + [
                f"run dir {run_dir} is not mounted here (no events to read); blaming the node(s) whose pod "
                "reported "
                f"{failure}: {reporting}"
            ],
        )
    return Diagnosis(
        failure,
        job_nodes,
        bool(job_nodes),
        evidence
        + [
            f"run dir {run_dir} is not mounted here and no pod names a node; every node of the job is suspect: "
            f"{job_nodes}"
        ],
    )
