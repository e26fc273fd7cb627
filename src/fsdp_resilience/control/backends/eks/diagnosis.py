"""The EKS backend's diagnosis of a failed launch (what EksBackend.diagnose returns): which nodes
to blame, and why, by the rule every backend shares (``evidence.health_aware_diagnosis``).

What a node says of its own health comes first: kubelet's Ready and the EKS node monitoring
agent's conditions (``nodes.node_health``), and NVRx's failed health checks in the run's events
(when the FSx run dir is mounted in this worker). A node unhealthy by any of them is blamed
whatever the launch's failure class, a user bug included; on nodes healthy by every signal a
user, data or storage fault blames nobody. For a failure a relaunch can help, the nodes that lost
a pod join them; without either, the run's events, else the nodes whose pods reported the
failure, else every node the job ran on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fsdp_resilience.control.backends.base import Diagnosis, JobHandle, JobStatus
from fsdp_resilience.control.backends.eks.client import KubeClient
from fsdp_resilience.control.backends.eks.constants import LABEL_JOB
from fsdp_resilience.control.backends.eks.nodes import lost_pod_signals, node_health
from fsdp_resilience.control.backends.eks.status import job_status, run_config_of
from fsdp_resilience.control.backends.evidence import (
    blamed,
    events_blame,
    health_aware_diagnosis,
    health_check_signals,
    merge_signals,
    reporting_nodes,
)


def diagnose_job(kube: KubeClient, handle: JobHandle, job: dict[str, Any], *, provisions_on_demand: bool) -> Diagnosis:
    """Diagnose ``handle``'s Job (read by the caller through ``kube``)."""
    pods = kube.list_pods(f"{LABEL_JOB}={handle.job_name}")
    status = job_status(job, pods, provisions_on_demand=provisions_on_demand)
    failure = status.failure_class
    if status.state != "failed":
        return Diagnosis(failure, [], False, [f"job {handle.job_name} is {status.state}: nothing to diagnose"])
    evidence = [f"status: {status.message}"]
    job_nodes = sorted(
        {n.node_id for n in status.nodes if n.node_id} | {(p.get("spec") or {}).get("nodeName") for p in pods} - {None}
    )
    configured = run_dir_of(handle, job)
    run_dir = configured if configured and Path(configured).is_dir() else None  # FSx mounted here
    health = merge_signals(
        node_health(kube, job_nodes),
        health_check_signals(run_dir, handle.launch_id, job_nodes) if run_dir else {},
    )

    def blame_replaceable() -> Diagnosis:
        suspects = merge_signals(health, lost_pod_signals(status, pods))
        if suspects:
            return blamed(failure, suspects, evidence)
        return blame_without_node_evidence(handle, job, status, job_nodes, evidence)

    return health_aware_diagnosis(failure, health, evidence, blame_replaceable)


def run_dir_of(handle: JobHandle, job: dict[str, Any]) -> str | None:
    cfg = run_config_of(job)
    return cfg.run_dir if cfg else handle.extra.get("run_dir")


def blame_without_node_evidence(
    handle: JobHandle, job: dict[str, Any], status: JobStatus, job_nodes: list[str], evidence: list[str]
) -> Diagnosis:
    """No node says it is unhealthy and none lost a pod: blame from the run's events (FSx mounted
    in this worker), else the nodes whose pod reported the failure, else every node of the job."""
    where = run_dir_of(handle, job)
    run_dir = where if where and Path(where).is_dir() else None
    failure = status.failure_class
    if run_dir:
        bad, why, signals = events_blame(run_dir, handle.launch_id, status, job_nodes)
        return Diagnosis(failure, bad, bool(bad), evidence + why, signals)
    reporting = reporting_nodes(status)
    if reporting:
        bad = sorted(reporting)
        note = (
            f"run dir {where} is not mounted here (no events to read); blaming the node(s) whose pod reported {failure}"
        )
        return Diagnosis(failure, bad, True, evidence + [f"{note}: {bad}"], reporting)
    note = f"run dir {where} is not mounted here and no pod names a node; every node of the job is suspect"
    every = {n: ["every node of the job is suspect (no event, no pod names one)"] for n in job_nodes}
    return Diagnosis(failure, job_nodes, bool(job_nodes), evidence + [f"{note}: {job_nodes}"], every)
