"""The EKS backend's spare pool: after a hot spare took a lost node's place, whether the pool is
whole again (``spare_status``, what EksBackend.add_spare returns). Nothing is created here: the
Job controller recreates a lost pod for its completion index and the new pod's launcher parks in
the rendezvous as the new spare. Pure functions over what add_spare read from the cluster.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fsdp_resilience.control.backends.base import LOST, BackendError, InsufficientCapacityError, JobStatus, NodeStatus
from fsdp_resilience.control.backends.eks.nodes import quarantined_by_us
from fsdp_resilience.control.backends.eks.status import age_key, lost_before, newest_pods, recreated_indexes


def spare_status(
    job_name: str,
    job: dict[str, Any],
    pods: list[dict[str, Any]],
    status: JobStatus,
    kube_nodes: dict[str, dict[str, Any] | None],
    reason: str,
    *,
    replacement: str,
    namespace: str,
    pool_selector: dict[str, str],
) -> NodeStatus:
    """The new spare's status for job ``job_name`` as read (its Job, pods, status, and the nodes
    its lost pods ran on: None where the node object is gone), or the error that says what to do
    (see EksBackend.add_spare)."""
    if status.state != "running":
        raise BackendError(f"cannot add a spare to job {job_name}: it is {status.state} ({status.message})")
    newest = newest_pods(pods)
    replaced = set(lost_before(pods, newest)) | set(recreated_indexes(job, newest))
    waiting = [n for n in status.nodes if n.state == LOST and n.index not in replaced]
    if waiting:
        return _spare_to_come(
            kube_nodes, job_name, job, waiting[0], reason, replacement=replacement, namespace=namespace
        )
    if not replaced:
        raise BackendError(
            f"job {job_name} lost no node: its {len(status.nodes)} pod(s) are the ones it "
            "launched, so the spare pool is whole; nothing to add"
        )
    index = max(replaced, key=lambda i: (age_key(newest[i]), i))
    node, pod = status.nodes[index], newest[index]
    if node.state == LOST:  # the replacement cannot be scheduled (job_status says why)
        raise InsufficientCapacityError(
            f"the replacement pod {pod['metadata']['name']} of job {job_name}'s lost node {index} has no "
            f"node to run on: {node.message}. Wait for replace_nodes' new node to join (capacity()), or scale the "
            f"node group {pool_selector} up; the Job starts it there as the new spare"
        )
    if node.state not in ("pending", "running"):
        raise BackendError(
            f"the replacement pod {pod['metadata']['name']} of job {job_name}'s lost node "
            f"{index} is {node.state}: {node.message}"
        )
    return dataclasses.replace(node, message=f"{reason}: {node.message}")


def _spare_to_come(
    kube_nodes: dict[str, dict[str, Any] | None],
    job_name: str,
    job: dict[str, Any],
    lost: NodeStatus,
    reason: str,
    *,
    replacement: str,
    namespace: str,
) -> NodeStatus:
    """spare_status for an index whose lost pod the Job has not replaced yet (see EksBackend.add_spare)."""
    node = kube_nodes.get(lost.node_id) if lost.node_id else None
    where = f"job {job_name} lost node {lost.index} ({lost.message})"
    if lost.node_id and node is not None and not quarantined_by_us(node):
        raise BackendError(
            f"{where}, and its node {lost.node_id} is still in service: take it out with "
            "replace_nodes first (its pod is replaced once the node object is deleted)"
        )
    if replacement == "cordon" and node is not None:
        raise BackendError(
            f"{where}. Under replacement=cordon nothing deletes node {lost.node_id}, so the Job "
            f"controller keeps waiting for the pod to end: once the machine is dealt with, run "
            f"`kubectl delete node {lost.node_id}` (PodGC then fails the pod and the Job recreates "
            "it as the new spare)"
        )
    if node is None and lost.node_id is None:
        budget = (job.get("spec") or {}).get("backoffLimit")
        raise BackendError(
            f"{where}, and the Job controller has not recreated its pod: see `kubectl -n "
            f"{namespace} describe job {job_name}` (its backoffLimit={budget} counts "
            "PodTemplateSettings.backoff_limit + max_pod_disruptions)"
        )
    how = (
        "its node object is gone, so PodGC fails the pod"
        if node is None
        else f"{lost.node_id} is out of service and its instance is being replaced ({replacement}); once "
        "the node object is deleted, PodGC fails the pod"
    )
    return NodeStatus(
        lost.index,
        None,
        "pending",
        None,
        None,
        f"{reason}: {how} and the Job controller recreates node {lost.index}'s pod on a healthy "
        "node, where its launcher parks as the new spare",
    )
