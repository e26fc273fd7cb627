"""Reading an EKS launch (eks/status.py): a Job's and its pods' JSON, as the API returns it, become
the backend interface's JobStatus and NodeStatus. No cluster: the objects are built here in the
shape the apiserver and the Job controller give them (completion index label, container statuses,
DisruptionTarget and PodScheduled conditions, Job conditions, the cancel annotation)."""

from __future__ import annotations

import json

import pytest

from fsdp_resilience.control.backends.base import LOST
from fsdp_resilience.control.backends.eks.constants import CANCEL_ANNOTATION, CONFIG_ENV, CONTAINER
from fsdp_resilience.control.backends.eks.status import (
    cancel_verdict,
    job_finished,
    job_status,
    lost_before,
    newest_pods,
    node_from_pod,
    pod_index,
    recreated_indexes,
    run_config_of,
    timestamp,
)
from fsdp_resilience.training.contract import ExitCode, FailureClass, RunConfig

INDEX = "batch.kubernetes.io/job-completion-index"


def make_job(
    name: str = "job-a",
    *,
    completions: int = 2,
    cfg: RunConfig | None = None,
    conditions=(),
    suspend: bool = False,
    failed: int = 0,
    annotations: dict | None = None,
    start: str = "2026-12-01T06:00:00Z",
) -> dict:
    env = [{"name": CONFIG_ENV, "value": cfg.to_json()}] if cfg else []
    status: dict = {
        "startTime": start,
        "conditions": [{"type": t, "status": "True", "reason": r, "message": m} for t, r, m in conditions],
    }
    if failed:
        status["failed"] = failed
    return {
        "metadata": {"name": name, "annotations": dict(annotations or {})},
        "spec": {
            "completions": completions,
            "suspend": suspend,
            "backoffLimit": 5,
            "template": {"spec": {"containers": [{"name": CONTAINER, "env": env}]}},
        },
        "status": status,
    }


def make_pod(
    index: int,
    phase: str = "Running",
    *,
    node: str | None = "gpu-0",
    name: str | None = None,
    exit_code: int | None = None,
    reason: str | None = None,
    disrupted: bool = False,
    deleting: bool = False,
    created: str = "2026-12-01T06:00:01Z",
    unschedulable: str | None = None,
) -> dict:
    conditions = []
    if disrupted:
        conditions.append(
            {
                "type": "DisruptionTarget",
                "status": "True",
                "reason": "DeletionByTaintManager",
                "message": "Taint manager: deleting due to NoExecute taint",
            }
        )
    if unschedulable:
        conditions.append(
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": unschedulable}
        )
    container: dict = {"name": CONTAINER, "state": {}}
    if exit_code is not None or reason:
        container["state"]["terminated"] = {"exitCode": exit_code, "reason": reason or "Error"}
    meta: dict = {
        "name": name or f"job-a-{index}-x{index}",
        "labels": {INDEX: str(index)},
        "creationTimestamp": created,
    }
    if deleting:
        meta["deletionTimestamp"] = "2026-12-01T07:00:00Z"
    return {
        "metadata": meta,
        "spec": {"nodeName": node},
        "status": {"phase": phase, "conditions": conditions, "containerStatuses": [container]},
    }


def cfg(nodes: int = 2, spares: int = 0) -> RunConfig:
    return RunConfig(run_id="r", run_dir="/fsx/runs/r", dataset_dir="/fsx/data", nodes=nodes, spare_nodes=spares)


# --------------------------------------------------------------------------------------------
# One pod -> one node
# --------------------------------------------------------------------------------------------


def test_pod_index_comes_from_the_completion_index_label_or_annotation():
    assert pod_index(make_pod(3)) == 3
    assert pod_index({"metadata": {"annotations": {INDEX: "1"}}}) == 1
    assert pod_index({"metadata": {"labels": {INDEX: "x"}}}) is None
    assert pod_index({"metadata": {}}) is None


def test_a_running_a_succeeded_and_a_pending_pod():
    assert node_from_pod(0, make_pod(0), None).state == "running"
    done = node_from_pod(0, make_pod(0, "Succeeded", exit_code=0), None)
    assert (done.state, done.failure_class, done.exit_code) == ("succeeded", FailureClass.SUCCESS.value, 0)
    waiting = node_from_pod(1, make_pod(1, "Pending", node=None, unschedulable="0/3 nodes are available"), None)
    assert waiting.state == "pending" and "0/3 nodes are available" in waiting.message


@pytest.mark.parametrize("code", [int(ExitCode.USER_ERROR), int(ExitCode.RESTARTS_EXHAUSTED), 1])
def test_a_pod_that_exited_fails_with_the_contracts_class_for_its_code(code):
    from fsdp_resilience.training.contract import failure_class_for_exit

    node = node_from_pod(0, make_pod(0, "Failed", exit_code=code), None)
    assert node.state == "failed" and node.exit_code == code
    assert node.failure_class == failure_class_for_exit(code).value and f"exited {code}" in node.message


@pytest.mark.parametrize(
    "pod",
    [
        make_pod(0, "Failed", exit_code=137, reason="OOMKilled"),
        make_pod(0, "Failed", exit_code=int(ExitCode.USER_ERROR), disrupted=True),  # killed from outside
        make_pod(0, "Failed", reason="Evicted"),
    ],
)
def test_a_pod_taken_away_is_a_lost_node_whose_restarts_ran_out(pod):
    node = node_from_pod(0, pod, None)
    assert node.state == LOST and node.failure_class == FailureClass.RESTARTS_EXHAUSTED.value
    assert "lost" in node.message


def test_a_disrupted_pod_still_terminating_is_lost_and_a_stopped_ones_failed():
    terminating = node_from_pod(0, make_pod(0, disrupted=True, deleting=True), None)
    assert terminating.state == LOST and "terminating" in terminating.message
    stopped = node_from_pod(0, make_pod(0, deleting=True), "cancelled")
    assert stopped.state == "failed" and stopped.failure_class == FailureClass.UNKNOWN.value


def test_no_pod_is_pending_until_the_job_stops():
    assert node_from_pod(1, None, None).state == "pending"
    gone = node_from_pod(1, None, "job failed")
    assert gone.state == "failed" and "stopped before it reported" in gone.message


def test_the_newest_pod_of_an_index_wins_and_a_live_one_beats_an_ending_one_of_the_same_second():
    old = make_pod(0, "Failed", reason="Evicted", name="old", created="2026-12-01T06:00:01Z")
    new = make_pod(0, "Pending", name="new", created="2026-12-01T06:00:01Z")
    later = make_pod(1, name="later", created="2026-12-01T06:05:00Z")
    earlier = make_pod(1, "Failed", exit_code=1, name="earlier", created="2026-12-01T06:00:01Z")
    newest = newest_pods([new, old, earlier, later, {"metadata": {"name": "no-index"}}])
    assert {i: p["metadata"]["name"] for i, p in newest.items()} == {0: "new", 1: "later"}
    assert lost_before([old, new, earlier, later], newest)[0].state == LOST
    assert 1 not in lost_before([old, new, earlier, later], newest)  # exited, not lost


def test_recreated_indexes_are_pods_created_after_the_job_started_once_a_pod_failed():
    pods = {0: make_pod(0, created="2026-12-01T06:00:01Z"), 1: make_pod(1, created="2026-12-01T06:30:00Z")}
    assert recreated_indexes(make_job(), pods) == []  # nothing failed
    assert recreated_indexes(make_job(failed=1, start="2026-12-01T06:00:05Z"), pods) == [1]


# --------------------------------------------------------------------------------------------
# The job
# --------------------------------------------------------------------------------------------


def test_every_node_running_is_a_running_job_and_a_complete_job_succeeded():
    status = job_status(make_job(cfg=cfg()), [make_pod(0, node="gpu-0"), make_pod(1, node="gpu-1")])
    assert status.state == "running" and [n.node_id for n in status.nodes] == ["gpu-0", "gpu-1"]
    done = job_status(
        make_job(conditions=[("Complete", "", "")]), [make_pod(i, "Succeeded", exit_code=0) for i in range(2)]
    )
    assert done.state == "succeeded" and done.exit_codes == {0: 0, 1: 0}


def test_a_final_exit_code_fails_the_job_before_its_condition_is_written():
    status = job_status(make_job(cfg=cfg()), [make_pod(0), make_pod(1, "Failed", exit_code=int(ExitCode.USER_ERROR))])
    assert status.state == "failed" and status.failure_class == FailureClass.USER_ERROR.value
    assert status.exit_codes == {1: int(ExitCode.USER_ERROR)}


def test_a_job_whose_disruptions_used_up_its_backoff_limit_ran_out_of_restarts():
    job = make_job(conditions=[("Failed", "BackoffLimitExceeded", "Job has reached the specified backoff limit")])
    status = job_status(job, [])
    assert status.state == "failed" and status.failure_class == FailureClass.RESTARTS_EXHAUSTED.value
    assert "backoffLimit=5" in status.message and "BackoffLimitExceeded" in status.message


def test_a_suspended_job_is_pending_until_submit_resumes_it():
    status = job_status(make_job(suspend=True), [])
    assert status.state == "pending" and "suspended" in status.message


def test_a_lost_node_with_a_spare_behind_it_keeps_the_job_running():
    pods = [make_pod(0, node="gpu-0"), make_pod(1, "Failed", reason="Evicted", node="gpu-1"), make_pod(2, node="gpu-2")]
    status = job_status(make_job(completions=3, cfg=cfg(nodes=2, spares=1)), pods)
    assert status.state == "running" and status.nodes[1].state == LOST
    assert "a spare covers it" in status.nodes[1].message


def test_losing_node_0_fails_the_job_even_with_a_spare():
    pods = [make_pod(0, "Failed", reason="Evicted"), make_pod(1, node="gpu-1"), make_pod(2, node="gpu-2")]
    status = job_status(make_job(completions=3, cfg=cfg(nodes=2, spares=1)), pods)
    assert status.state == "failed" and status.failure_class == FailureClass.RESTARTS_EXHAUSTED.value
    assert "node 0 was lost" in status.message


def test_a_lost_nodes_replacement_that_cannot_be_scheduled_is_still_lost_unless_karpenter_brings_a_node():
    pods = [
        make_pod(0, node="gpu-0"),
        make_pod(1, "Failed", reason="Evicted", node="gpu-1", name="old", created="2026-12-01T06:00:01Z"),
        make_pod(
            1, "Pending", node=None, name="new", created="2026-12-01T06:30:00Z", unschedulable="0/2 nodes are available"
        ),
        make_pod(2, node="gpu-2"),
    ]
    job = make_job(completions=3, cfg=cfg(nodes=2, spares=1), failed=1)
    lost = job_status(job, pods).nodes[1]
    assert lost.state == LOST and lost.node_id == "gpu-1" and "cannot be scheduled" in lost.message
    waiting = job_status(job, pods, provisions_on_demand=True).nodes[1]
    assert waiting.state == "pending" and "the Job recreated it" in waiting.message


def test_a_cancelled_job_failed_with_its_verdict_and_keeps_the_nodes_it_ran_on():
    verdict = {
        "failure_class": FailureClass.NO_PROGRESS.value,
        "message": "no checkpoint for 600s",
        "nodes": {"0": "gpu-0", "1": "gpu-1"},
    }
    job = make_job(annotations={CANCEL_ANNOTATION: json.dumps(verdict)}, suspend=True)
    status = job_status(job, [])
    assert status.state == "failed" and status.failure_class == FailureClass.NO_PROGRESS.value
    assert status.message.startswith(f"{FailureClass.NO_PROGRESS.value}: no checkpoint for 600s")
    assert [n.node_id for n in status.nodes] == ["gpu-0", "gpu-1"]

    # One pod is still there (a failed one, kept as evidence), the other went with the suspend:
    # each index keeps a node, so diagnose can read the health of the node whose pod is gone.
    kept = [make_pod(0, "Failed", node="gpu-0", exit_code=ExitCode.RESTARTS_EXHAUSTED)]
    assert [n.node_id for n in job_status(job, kept).nodes] == ["gpu-0", "gpu-1"]


def test_cancel_verdict_job_finished_and_run_config_of():
    assert cancel_verdict(make_job()) is None
    garbled = cancel_verdict(make_job(annotations={CANCEL_ANNOTATION: "not json"}))
    assert garbled["failure_class"] == FailureClass.UNKNOWN.value and "not json" in garbled["message"]
    assert cancel_verdict(make_job(annotations={CANCEL_ANNOTATION: "[1]"})) is None
    assert not job_finished(make_job())
    assert job_finished(make_job(conditions=[("FailureTarget", "", "")]))
    assert job_finished(make_job(annotations={CANCEL_ANNOTATION: "{}"}))
    assert run_config_of(make_job(cfg=cfg(nodes=3))).nodes == 3
    assert run_config_of(make_job()) is None


def test_timestamp_reads_the_apiservers_times():
    assert timestamp(None) == 0.0 and timestamp("") == 0.0
    assert timestamp("1970-01-01T00:01:00Z") == 60.0
    assert timestamp("2026-12-01T06:00:00.123456Z") == timestamp("2026-12-01T06:00:00Z")
