"""Whether the spare pool is whole again after a lost node (eks/spares.py, what EksBackend.add_spare
returns), on a job as read: its Job and pods' JSON, its status, and the nodes its lost pods ran
on. End to end on the fake cluster: test_eks_backend.py and test_eks_dag.py."""

from __future__ import annotations

import pytest

from fsdp_resilience.control.backends.base import LOST, BackendError, InsufficientCapacityError
from fsdp_resilience.control.backends.eks.constants import CONTAINER, QUARANTINE_TAINT
from fsdp_resilience.control.backends.eks.spares import spare_status
from fsdp_resilience.control.backends.eks.status import job_status
from fsdp_resilience.training.contract import RunConfig

INDEX = "batch.kubernetes.io/job-completion-index"
CFG = RunConfig(run_id="r", run_dir="/fsx/runs/r", dataset_dir="/fsx/data", nodes=2, spare_nodes=1)
POOL = {"fsdp-resilience/pool": "gpu"}


def make_job(failed: int = 0) -> dict:
    status = {"startTime": "2026-12-01T06:00:00Z", "conditions": []}
    if failed:
        status["failed"] = failed
    return {
        "metadata": {"name": "job-a", "annotations": {}},
        "spec": {
            "completions": 3,
            "backoffLimit": 5,
            "template": {
                "spec": {
                    "containers": [
                        {"name": CONTAINER, "env": [{"name": "TRAINING_RUN_CONFIG", "value": CFG.to_json()}]}
                    ]
                }
            },
        },
        "status": status,
    }


def make_pod(
    index: int,
    phase: str = "Running",
    node: str | None = None,
    *,
    name: str | None = None,
    created: str = "2026-12-01T06:00:01Z",
    lost: bool = False,
    unschedulable: bool = False,
) -> dict:
    conditions = []
    if lost:
        conditions.append({"type": "DisruptionTarget", "status": "True", "reason": "DeletionByTaintManager"})
    if unschedulable:
        conditions.append(
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/2 nodes are available"}
        )
    return {
        "metadata": {
            "name": name or f"job-a-{index}",
            "labels": {INDEX: str(index)},
            "creationTimestamp": created,
            **({"deletionTimestamp": "2026-12-01T07:00:00Z"} if lost else {}),
        },
        "spec": {"nodeName": node if node is not None else f"gpu-{index}"},
        "status": {"phase": phase, "conditions": conditions, "containerStatuses": [{"name": CONTAINER}]},
    }


def spare(job: dict, pods: list[dict], kube_nodes: dict | None = None, replacement: str = "asg"):
    status = job_status(job, pods)
    return spare_status(
        "job-a",
        job,
        pods,
        status,
        kube_nodes or {},
        "spare pool refill",
        replacement=replacement,
        namespace="fsdp-training",
        pool_selector=POOL,
    )


def quarantined(name: str) -> dict:
    return {"metadata": {"name": name}, "spec": {"unschedulable": True, "taints": [{"key": QUARANTINE_TAINT}]}}


LOST_1 = [make_pod(0), make_pod(1, lost=True), make_pod(2)]  # node 1 lost, still Terminating


def test_a_job_that_is_not_running_or_lost_no_node_gets_no_spare():
    with pytest.raises(BackendError, match="lost no node.*nothing to add"):
        spare(make_job(), [make_pod(i) for i in range(3)])
    with pytest.raises(BackendError, match="cannot add a spare to job job-a: it is pending"):
        spare(make_job(), [])


def test_a_lost_pod_on_a_node_still_in_service_waits_for_replace_nodes():
    assert job_status(make_job(), LOST_1).nodes[1].state == LOST
    with pytest.raises(BackendError, match="gpu-1 is still in service: take it out with replace_nodes first"):
        spare(make_job(), LOST_1, {"gpu-1": {"metadata": {"name": "gpu-1"}, "spec": {}}})


def test_under_cordon_a_human_deletes_the_node():
    with pytest.raises(BackendError, match="kubectl delete node gpu-1"):
        spare(make_job(), LOST_1, {"gpu-1": quarantined("gpu-1")}, replacement="cordon")


def test_a_quarantined_or_vanished_node_means_the_spare_is_on_its_way():
    coming = spare(make_job(), LOST_1, {"gpu-1": quarantined("gpu-1")})
    assert (coming.index, coming.state) == (1, "pending")
    assert coming.message.startswith("spare pool refill: gpu-1 is out of service and its instance is being replaced")
    gone = spare(make_job(), LOST_1, {"gpu-1": None})
    assert gone.state == "pending" and "its node object is gone" in gone.message


def test_the_recreated_pod_is_the_new_spare_or_has_no_node_to_run_on():
    old = make_pod(1, "Failed", name="old", lost=False, created="2026-12-01T06:00:01Z")
    old["status"]["reason"] = "Evicted"
    running = make_pod(1, name="new", node="gpu-3", created="2026-12-01T06:30:00Z")
    new_spare = spare(make_job(failed=1), [make_pod(0), old, running, make_pod(2)])
    assert (new_spare.index, new_spare.state, new_spare.node_id) == (1, "running", "gpu-3")
    assert new_spare.message.startswith("spare pool refill: ")
    stuck = make_pod(1, "Pending", node="", name="new", created="2026-12-01T06:30:00Z", unschedulable=True)
    with pytest.raises(InsufficientCapacityError, match="replacement pod new of job job-a's lost node 1 has no node"):
        spare(make_job(failed=1), [make_pod(0), old, stuck, make_pod(2)])
