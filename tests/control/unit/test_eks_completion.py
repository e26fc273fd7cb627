"""A launch with hot spares reaches success when its training nodes finish (eks/completion.py, the
Job's successPolicy in manifests.py, and how status.py reads both): where the apiserver keeps the
Job's successPolicy the Job controller completes it; where it does not (a server before 1.33, or
one that dropped the field) the backend suspends the Job once every training node's ``final``
says success and the final step is committed. And a pod the Job recreates after its launch ended
(exit 69, launch_ended) is neither a failure of the launch nor counted against backoffLimit."""

from __future__ import annotations

import asyncio
import json

from fsdp_resilience.control.backends.base import JobStatus
from fsdp_resilience.control.backends.eks.completion import (
    cached_version,
    launch_trained,
    needs_own_rule,
    parse_version,
    settle,
    status_as_read,
)
from fsdp_resilience.control.backends.eks.constants import CONTAINER, SUCCEEDED_ANNOTATION
from fsdp_resilience.control.backends.eks.manifests import success_policy, training_job
from fsdp_resilience.control.backends.eks.status import job_finished, job_status
from fsdp_resilience.training.contract import Event, EventLog, ExitCode, RunDir

from control.fakes.saved_checkpoints import save_checkpoint
from control.support.eks_pods import make_cfg, make_settings

INDEX = "batch.kubernetes.io/job-completion-index"


def stored_job(tmp_path, *, nodes=2, spares=1, steps=20, keep_policy=True, conditions=()):
    """The launch's Job as the apiserver returns it: with its UID, resumed, and (unless the
    server dropped it) its successPolicy."""
    mount = tmp_path / "fsx"
    cfg = make_cfg(
        nodes=nodes, spare_nodes=spares, steps=steps, run_dir=str(mount / "runs" / "r"), dataset_dir=str(mount / "d")
    )
    job = training_job(cfg, "0", make_settings(fsx_mount_path=str(mount)), suspend=False)
    job["metadata"]["uid"] = "job-uid"
    if not keep_policy:
        job["spec"].pop("successPolicy", None)
    job["status"] = {
        "startTime": "2026-12-01T06:00:00Z",
        "conditions": [{"type": t, "status": "True", "reason": "x", "message": "m"} for t in conditions],
    }
    return cfg, job


def pod(index: int, phase: str = "Running", exit_code: int | None = None) -> dict:
    state = {"terminated": {"exitCode": exit_code, "reason": "Error"}} if exit_code is not None else {}
    return {
        "metadata": {
            "name": f"r-0-{index}-x",
            "labels": {INDEX: str(index)},
            "creationTimestamp": "2026-12-01T06:00:01Z",
        },
        "spec": {"nodeName": f"gpu-{index}"},
        "status": {"phase": phase, "conditions": [], "containerStatuses": [{"name": CONTAINER, "state": state}]},
    }


def finals(cfg, uid: str, *nodes_and_classes: tuple[int, str]) -> None:
    log = EventLog(RunDir(cfg.run_dir).events, run_id=cfg.run_id, launch_id="0", role="launcher")
    for node_rank, failure in nodes_and_classes:
        log.emit(Event.FINAL, node_rank=node_rank, failure_class=failure, exit_code=0, launch_uid=uid)


# --------------------------------------------------------------------------------------------
# The Job's own successPolicy


def test_with_spares_the_job_succeeds_once_nodes_indexes_did():
    """Any ``nodes`` indexes, not 0..nodes-1: after a spare took a lost node's place, the lost
    index's new pod parks as the spare and the spare's index trains."""
    job = training_job(make_cfg(nodes=4, spare_nodes=2), "0", make_settings())
    assert job["spec"]["successPolicy"] == {"rules": [{"succeededCount": 4}]}
    assert job["spec"]["completionMode"] == "Indexed"  # the API allows successPolicy only there
    assert job["spec"]["successPolicy"]["rules"][0]["succeededCount"] <= job["spec"]["completions"]
    # Without spares the Job completes when every index did: no successPolicy.
    assert "successPolicy" not in training_job(make_cfg(spare_nodes=0), "0", make_settings())["spec"]
    assert success_policy(make_cfg(spare_nodes=0)) is None


def test_the_pods_know_their_uid_and_their_launchs_incarnation_from_the_downward_api():
    env = {
        e["name"]: e
        for e in training_job(make_cfg(), "0", make_settings())["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["TRAINING_POD_UID"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.uid"}}
    assert env["TRAINING_LAUNCH_UID"]["valueFrom"] == {
        "fieldRef": {"fieldPath": "metadata.labels['batch.kubernetes.io/controller-uid']"}
    }
    assert env["TRAINING_NODE_ID"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}


def test_a_job_whose_success_criteria_are_met_reads_succeeded_though_a_spare_index_never_did(tmp_path):
    _, job = stored_job(tmp_path, conditions=("SuccessCriteriaMet",))
    status = job_status(job, [pod(0, "Succeeded", 0), pod(1, "Succeeded", 0), pod(2, "Running")])
    assert status.state == "succeeded" and status.failure_class == "success"
    assert "2 training node(s)" in status.message


def test_a_pod_recreated_after_its_launch_ended_is_no_failure(tmp_path):
    """Exit 69 (launch_ended): the podFailurePolicy ignores it; the status does not fail the
    launch for it, nor count the node as failed."""
    _, job = stored_job(tmp_path)
    status = job_status(job, [pod(0, "Succeeded", 0), pod(1, "Succeeded", 0), pod(2, "Failed", 69)])
    assert status.state != "failed"
    spare = status.nodes[2]
    assert spare.state == "pending" and spare.failure_class is None and "launch_ended" in spare.message
    assert int(ExitCode.LAUNCH_ENDED) == 69


# --------------------------------------------------------------------------------------------
# The backend's own rule


def test_the_server_version_prefers_the_emulated_one_and_is_read_once(monkeypatch):
    assert parse_version({"major": "1", "minor": "33+", "gitVersion": "v1.33.4-eks-1"}) == (1, 33)
    assert parse_version({"major": "1", "minor": "37", "emulationMajor": "1", "emulationMinor": "35"}) == (1, 35)
    assert parse_version({"gitVersion": "v1.32.9"}) == (1, 32)
    assert parse_version({}) is None
    reads = []
    read = lambda: reads.append(1) or {"major": "1", "minor": "32"}  # noqa: E731
    assert cached_version("test-cluster", read) == (1, 32)
    assert cached_version("test-cluster", read) == (1, 32) and len(reads) == 1

    def broken():
        raise OSError("unreachable")

    assert cached_version("test-unreachable", broken) is None  # unknown: the own rule applies


def test_the_own_rule_applies_only_to_a_launch_with_spares_without_a_working_success_policy(tmp_path):
    _, job = stored_job(tmp_path)
    assert needs_own_rule(job, (1, 32))  # before GA
    assert needs_own_rule(job, None)  # unknown version
    assert not needs_own_rule(job, (1, 33)) and not needs_own_rule(job, (1, 37))
    _, dropped = stored_job(tmp_path, keep_policy=False)  # the apiserver dropped the field
    assert needs_own_rule(dropped, (1, 35))
    _, no_spares = stored_job(tmp_path, spares=0)
    assert not needs_own_rule(no_spares, (1, 30))


def test_the_launch_trained_when_every_training_nodes_final_says_success_and_the_final_step_is_committed(
    tmp_path,
):
    cfg, job = stored_job(tmp_path, steps=20)
    RunDir(cfg.run_dir).create()
    finals(cfg, "job-uid", (0, "success"))
    assert launch_trained(job) is None  # node 1 has not ended
    finals(cfg, "job-uid", (1, "success"))
    assert launch_trained(job) is None  # the final step is not committed
    save_checkpoint(cfg.run_dir, 10)
    assert launch_trained(job) is None
    save_checkpoint(cfg.run_dir, 20)
    assert "training node(s) [0, 1]" in launch_trained(job)
    # Another incarnation's finals (the launch id reused) are not this Job's.
    job["metadata"]["uid"] = "another-job-uid"
    assert launch_trained(job) is None


def test_the_training_nodes_are_the_membership_records_after_a_spare_was_promoted(tmp_path):
    cfg, job = stored_job(tmp_path, steps=20)
    layout = RunDir(cfg.run_dir)
    layout.create()
    layout.membership.write_text(json.dumps({"launch_id": "0", "attempt": 1, "members": [[0, "gpu-0"], [2, "gpu-2"]]}))
    save_checkpoint(cfg.run_dir, 20)
    finals(cfg, "job-uid", (0, "success"), (1, "unknown"))
    assert launch_trained(job) is None
    finals(cfg, "job-uid", (2, "success"))
    assert "[0, 2]" in launch_trained(job)


class RecordingKube:
    def __init__(self):
        self.patches = []

    def patch_job(self, name, body):
        self.patches.append((name, body))
        return body  # enough of the Job for these tests


def test_settle_suspends_and_marks_a_job_whose_training_nodes_succeeded_and_reads_as_succeeded(tmp_path):
    cfg, job = stored_job(tmp_path, steps=20, keep_policy=False)
    RunDir(cfg.run_dir).create()
    save_checkpoint(cfg.run_dir, 20)
    kube, versions = RecordingKube(), []
    assert settle(kube, job, lambda: versions.append(1) or (1, 32)) is job and not kube.patches  # not trained yet
    finals(cfg, "job-uid", (0, "success"), (1, "success"))
    patch = settle(kube, job, lambda: (1, 32))
    ((name, body),) = kube.patches
    assert name == job["metadata"]["name"] and body["spec"] == {"suspend": True}
    job["metadata"].setdefault("annotations", {}).update(body["metadata"]["annotations"])
    job["spec"]["suspend"] = True
    assert patch is body and job_finished(job)
    status = job_status(job, [pod(0, "Succeeded", 0), pod(1, "Succeeded", 0), pod(2, "Failed", 143)])
    assert status.state == "succeeded" and "suspended by the backend" in status.message
    assert json.loads(job["metadata"]["annotations"][SUCCEEDED_ANNOTATION])["failure_class"] == "success"
    settle(kube, job, lambda: (1, 32))  # finished: nothing more
    assert len(kube.patches) == 1


def test_settle_leaves_a_job_alone_where_the_success_policy_works_or_without_spares(tmp_path):
    cfg, job = stored_job(tmp_path, steps=20)
    RunDir(cfg.run_dir).create()
    save_checkpoint(cfg.run_dir, 20)
    finals(cfg, "job-uid", (0, "success"), (1, "success"))
    kube = RecordingKube()
    assert settle(kube, job, lambda: (1, 35)) is job and not kube.patches
    _, no_spares = stored_job(tmp_path / "other", spares=0)
    asked = []
    assert settle(kube, no_spares, lambda: asked.append(1)) is no_spares and not asked  # no version read


def test_the_triggerer_reports_the_success_it_cannot_patch(tmp_path):
    cfg, job = stored_job(tmp_path, steps=20, keep_policy=False)
    RunDir(cfg.run_dir).create()
    save_checkpoint(cfg.run_dir, 20)
    running = JobStatus("running", None, {}, "3 node(s) running", [])
    assert asyncio.run(status_as_read(job, running, (1, 33))).state == "running"
    finals(cfg, "job-uid", (0, "success"), (1, "success"))
    status = asyncio.run(status_as_read(job, running, (1, 33)))
    assert status.state == "succeeded" and status.failure_class == "success"
    assert "suspended at the next status" in status.message
