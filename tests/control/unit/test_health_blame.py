"""The health-aware blame every backend shares (backends/evidence.py): a node that says it is
unhealthy is blamed whatever the failure class; a user, data or storage fault on nodes healthy by
every signal blames nobody; NVRx's failed health checks in the events are signals against their
node; the report lists the signals per blamed node. Pure logic (on the real control plane:
tests/control/integration/test_eks_health_blame.py)."""

from __future__ import annotations

import pytest

from fsdp_resilience.control.backends.base import Diagnosis, JobHandle, JobStatus, NodeStatus
from fsdp_resilience.control.backends.eks.diagnosis import diagnose_job
from fsdp_resilience.control.backends.evidence import (
    events_blame,
    health_aware_diagnosis,
    health_check_signals,
    merge_signals,
)
from fsdp_resilience.control.report.records import blame_evidence
from fsdp_resilience.training.contract import Event, EventLog

GPU_DOWN = ["AcceleratedHardwareReady=False (NvidiaXID79: GPU has fallen off the bus)"]


def never() -> Diagnosis:
    raise AssertionError("a failure no relaunch helps is never blamed by the replaceable path")


@pytest.mark.parametrize("failure", ["user_error", "unknown", "non_finite", "storage_error"])
def test_a_node_that_says_it_is_unhealthy_is_blamed_whatever_the_code_reported(failure):
    d = health_aware_diagnosis(failure, {"gpu-1": GPU_DOWN, "gpu-0": []}, ["status: x"], never)
    assert d.bad_node_ids == ["gpu-1"] and d.replaceable and d.failure_class == failure
    assert d.signals == {"gpu-1": GPU_DOWN}
    assert any("they are blamed, not the code" in e for e in d.evidence)
    assert d.evidence[-1].startswith("node gpu-1: AcceleratedHardwareReady=False")


@pytest.mark.parametrize("failure", ["user_error", "non_finite", "storage_error", "unknown"])
def test_nodes_healthy_by_every_signal_are_never_blamed_for_a_user_data_or_storage_fault(failure):
    d = health_aware_diagnosis(failure, {"gpu-0": [], "gpu-1": []}, ["status: x"], never)
    assert d == Diagnosis(failure, [], False, d.evidence) and d.signals == {}
    assert "healthy by every signal" in d.evidence[1]


def test_a_launcher_that_did_nothing_is_not_explained_by_its_node():
    d = health_aware_diagnosis("already_running", {"gpu-1": GPU_DOWN}, [], never)
    assert not d.replaceable and d.bad_node_ids == []


def test_a_replaceable_failure_is_the_backends_to_blame():
    mine = Diagnosis("restarts_exhausted", ["gpu-2"], True, ["lost"])
    assert health_aware_diagnosis("restarts_exhausted", {"gpu-1": GPU_DOWN}, [], lambda: mine) is mine


def test_merge_signals_keeps_order_drops_repeats_and_healthy_nodes():
    merged = merge_signals({"a": ["x"], "b": []}, {"a": ["x", "y"], "c": ["z"]})
    assert merged == {"a": ["x", "y"], "c": ["z"]}


def _launch(run_dir, *records: dict) -> None:
    log = EventLog(run_dir / "events.jsonl", run_id="r")
    log.emit(Event.LAUNCH_BEGIN, launch_id="0", node_rank=0, node_id="gpu-0")
    for record in records:
        log.emit(record.pop("event"), **record)


def test_an_nvrx_health_check_record_is_a_signal_against_its_node_and_comes_first(tmp_path):
    _launch(
        tmp_path,
        {"event": Event.FAULT_INJECTED, "node_id": "gpu-0", "kind": "exception", "step": 3},
        {
            "event": Event.HEALTH_CHECK_FAILED,
            "node_id": "gpu-1",
            "check": "nic",
            "source": "inprocess_wrapper",
            "message": "NIC health check failed - link down detected",
            "nvrx_version": "0.7.0",
        },
    )
    signals = health_check_signals(tmp_path, "0", ["gpu-0", "gpu-1"])
    assert list(signals) == ["gpu-1"] and "NVRx nic health check failed (inprocess_wrapper" in signals["gpu-1"][0]
    assert health_check_signals(tmp_path, "1", ["gpu-0", "gpu-1"]) == {}  # another launch's window
    status = JobStatus("failed", "restarts_exhausted", {}, "", [NodeStatus(0, "gpu-0", "failed", "restarts_exhausted")])
    bad, why, by_node = events_blame(tmp_path, "0", status, ["gpu-0", "gpu-1"])
    assert bad == ["gpu-1"] and "health checks failed" in why[0] and "link down" in by_node["gpu-1"][0]


def test_a_drill_is_listed_per_node_with_its_step(tmp_path):
    _launch(tmp_path, {"event": Event.FAULT_INJECTED, "node_id": "gpu-0", "kind": "exception", "step": 3, "rank": 1})
    status = JobStatus("failed", "restarts_exhausted", {}, "", [])
    bad, _, by_node = events_blame(tmp_path, "0", status, ["gpu-0", "gpu-1"])
    assert bad == ["gpu-0"] and by_node == {"gpu-0": ["drill exception at step 3 (rank 1, attempt None)"]}


class StandInKube:
    def __init__(self, pods, nodes):
        self.pods, self.nodes = pods, nodes

    def list_pods(self, selector):
        return self.pods

    def get_node(self, name):
        return self.nodes.get(name)

    def get_nodes(self, names):
        return {name: self.nodes.get(name) for name in names}


def _node(name: str, gpu: str = "True") -> dict:
    conditions = [
        {"type": "Ready", "status": "True"},
        {"type": "AcceleratedHardwareReady", "status": gpu, "reason": "NvidiaXID79", "message": "fell off the bus"},
    ]
    return {"metadata": {"name": name}, "status": {"conditions": conditions}}


def _user_bug_job_on(*nodes: str) -> tuple[dict, list[dict]]:
    """A Job that failed with a user error (pod 0 exited 78), its pods on ``nodes``."""
    job = {
        "metadata": {"name": "r-run-0", "uid": "u"},
        "spec": {"completions": len(nodes), "completionMode": "Indexed"},
        "status": {"failed": 1, "conditions": [{"type": "Failed", "status": "True", "reason": "PodFailurePolicy"}]},
    }
    pods = [
        {
            "metadata": {"name": f"r-run-0-{i}", "annotations": {"batch.kubernetes.io/job-completion-index": str(i)}},
            "spec": {"nodeName": node},
            "status": {
                "phase": "Failed" if i == 0 else "Running",
                "containerStatuses": [
                    {"name": "trainer", "state": {"terminated": {"exitCode": 78}} if i == 0 else {"running": {}}}
                ],
            },
        }
        for i, node in enumerate(nodes)
    ]
    return job, pods


def test_eks_diagnosis_blames_the_gpu_under_a_user_bug_only_when_its_condition_is_false():
    handle = JobHandle("eks", "run", "0", "r-run-0", {"run_dir": "/not/mounted/here"})
    job, pods = _user_bug_job_on("gpu-0", "gpu-1")
    healthy = StandInKube(pods, {"gpu-0": _node("gpu-0"), "gpu-1": _node("gpu-1")})
    d = diagnose_job(healthy, handle, job, provisions_on_demand=False)
    assert d.failure_class == "user_error" and not d.replaceable and d.bad_node_ids == [], d.evidence
    sick = StandInKube(pods, {"gpu-0": _node("gpu-0"), "gpu-1": _node("gpu-1", gpu="False")})
    d = diagnose_job(sick, handle, job, provisions_on_demand=False)
    assert d.replaceable and d.bad_node_ids == ["gpu-1"], d.evidence
    assert "AcceleratedHardwareReady=False (NvidiaXID79: fell off the bus)" in d.signals["gpu-1"][0]


def test_the_report_lists_the_signals_per_blamed_node_and_falls_back_to_the_reason():
    record = {"signals": {"gpu-1": ["AcceleratedHardwareReady=False (x)", "NVRx gpu health check failed"]}}
    assert blame_evidence(record) == "gpu-1: AcceleratedHardwareReady=False (x); NVRx gpu health check failed"
    assert blame_evidence({"reason": "node lost"}) == "node lost"


def test_the_local_backend_applies_the_same_rule_to_its_slots(tmp_path):
    """A user bug on slot 0 (its launcher's final says user_error, exit 78): blamed on nobody
    while the slots are healthy; on slot 1 once NVRx's health check failed there."""
    from fsdp_resilience.control.backends.local import LocalProcessBackend

    from control.support.local_jobs import GONE, make_record, node

    store, record = make_record(tmp_path, [node(0, **GONE, exit_code=78), node(1, **GONE, exit_code=1)])
    log = EventLog(tmp_path / "run" / "events.jsonl", run_id="r")
    log.emit(Event.LAUNCH_BEGIN, launch_id="1", node_rank=0, node_id="slot-0")
    for rank, failure, code in ((0, "user_error", 78), (1, "unknown", 1)):
        log.emit(
            Event.FINAL, launch_id="1", node_rank=rank, node_id=f"slot-{rank}", failure_class=failure, exit_code=code
        )
    backend = LocalProcessBackend(state_dir=tmp_path / "state", slots=2)
    handle = JobHandle("local", "r", "1", "job", {})
    d = backend.diagnose(handle)
    assert d.failure_class == "user_error" and not d.replaceable and d.bad_node_ids == [], d.evidence
    log.emit(
        Event.HEALTH_CHECK_FAILED,
        node_id="slot-1",
        check="gpu",
        source="ft_launcher",
        message="Node slot-1 has an unhealthy GPU.",
        nvrx_version="0.4.1",
    )
    d = backend.diagnose(handle)
    assert d.replaceable and d.bad_node_ids == ["slot-1"] and "unhealthy GPU" in d.signals["slot-1"][0]
