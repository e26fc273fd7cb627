"""What the control plane does with each failure class a launch can end with: which ones climb the
escalation ladder (node replacement, relaunch), and what the user is told about those that never
do — user errors, a full or read-only run dir, training state that keeps turning NaN/inf, a run
another launcher already trains — and which faults in a run's events blame a node at all. Pure
functions over the run contract: no jobs needed (the fake apiserver and DAG tests drive the same
rules end to end)."""

from __future__ import annotations

import time

import pytest

from fsdp_resilience.control import ladder
from fsdp_resilience.control.backends import Diagnosis, JobHandle, JobStatus, NodeStatus
from fsdp_resilience.control.backends.evidence import blame_from_events, blamed
from fsdp_resilience.control.task_data import Outcome, Run
from fsdp_resilience.training.contract import (
    FINAL_FAILURES,
    REPLACEABLE_FAILURES,
    Event,
    EventLog,
    ExitCode,
    FailureClass,
    RunConfig,
    declare_stop,
    failure_class_for_exit,
    most_telling_failure,
    read_stop,
    what_to_do,
)

NEVER_RETRIED = (
    FailureClass.USER_ERROR,
    FailureClass.STORAGE_ERROR,
    FailureClass.NON_FINITE,
    FailureClass.ALREADY_RUNNING,
    FailureClass.UNKNOWN,
)


def outcome(failure: FailureClass, message: str = "node 0 (slot-0) failed") -> Outcome:
    return Outcome(
        outcome="failed",
        failure_class=failure.value,
        message=message,
        step=0,
        checkpoint_id=None,
        launch_id="0",
        handle={},
        job_state="failed",
        last_progress_at=0.0,
    )


@pytest.mark.parametrize("failure", NEVER_RETRIED)
def test_classes_that_are_not_node_faults_never_climb_the_ladder(failure):
    for rung in (1, 2, 3):
        climb, why = ladder.should_escalate(outcome(failure), rung, max_replacements=3)
        assert not climb and what_to_do(failure.value) in why
    assert failure.value not in REPLACEABLE_FAILURES


@pytest.mark.parametrize("failure", [FailureClass.RESTARTS_EXHAUSTED, FailureClass.NO_PROGRESS])
def test_restarts_exhausted_and_no_progress_climb_while_rungs_are_left(failure):
    assert ladder.should_escalate(outcome(failure), 1, max_replacements=1)[0]
    assert not ladder.should_escalate(outcome(failure), 2, max_replacements=1)[0]


def test_the_failure_message_says_what_to_do():
    run = Run(config={}, backend={}, max_node_replacements=1)
    storage = ladder.failure_message(run, outcome(FailureClass.STORAGE_ERROR, "node 0 exited 74"))
    assert storage.startswith("training failed: storage_error: node 0 exited 74")
    assert "free space" in storage and "fix its mount" in storage and "trigger the run again" in storage
    non_finite = ladder.failure_message(run, outcome(FailureClass.NON_FINITE))
    assert "Lower lr" in non_finite and "check the data" in non_finite
    already = ladder.failure_message(run, outcome(FailureClass.ALREADY_RUNNING))
    assert "another fsdp_resilience.training.launch of this run" in already and "status is unchanged" in already
    for failure in (FailureClass.STORAGE_ERROR, FailureClass.NON_FINITE, FailureClass.USER_ERROR):
        assert "no node was touched" in what_to_do(failure.value)
    # A class the ladder retries needs no advice: the rungs ran out.
    assert "What to do" not in ladder.failure_message(run, outcome(FailureClass.RESTARTS_EXHAUSTED))


def test_every_final_exit_code_is_a_final_failure_class():
    # The launcher's own verdicts (not killed, not lost): each fails its whole job at once.
    # Not launch_ended: that launcher came after its launch ended and decides nothing (ignored).
    finals = {
        failure_class_for_exit(c).value
        for c in ExitCode
        if c not in (ExitCode.SUCCESS, ExitCode.UNKNOWN, ExitCode.LAUNCH_ENDED)
    }
    assert finals == set(FINAL_FAILURES)
    assert "launch_ended" not in FINAL_FAILURES
    assert {"storage_error", "non_finite", "already_running"} <= finals


def test_the_most_telling_class_of_a_job_never_hides_a_class_that_must_not_be_retried():
    # Whatever else the other nodes report follows from it: another launcher owns the run, the
    # storage failed, the state diverged, the code is wrong.
    assert most_telling_failure(["restarts_exhausted", "already_running", "unknown"]) == "already_running"
    assert most_telling_failure(["unknown", "storage_error", "restarts_exhausted"]) == "storage_error"
    assert most_telling_failure(["no_progress", "non_finite"]) == "non_finite"
    assert most_telling_failure(["user_error", "storage_error"]) == "storage_error"
    assert most_telling_failure(["restarts_exhausted", "unknown"]) == "restarts_exhausted"
    assert most_telling_failure(["success", None]) is None


def test_faults_that_point_at_a_file_or_the_data_blame_no_node(tmp_path):
    """A restore that failed on a checkpoint's content, a full disk, a NaN: another machine reads
    the same files and fails the same way. Only faults of the machine blame its node."""
    status = JobStatus(
        "failed",
        "restarts_exhausted",
        {0: 75, 1: 75},
        "restarts exhausted",
        [NodeStatus(0, "slot-0", "failed", "restarts_exhausted", 75), NodeStatus(1, "slot-1", "failed", "unknown")],
    )

    def blame(*faults: dict) -> tuple[list[str], list[str]]:
        run_dir = tmp_path / f"run-{len(list(tmp_path.iterdir()))}"
        log = EventLog(run_dir / "events.jsonl", run_id="r")
        log.emit(Event.LAUNCH_BEGIN, launch_id="0", node_rank=0, node_id="slot-0")
        for fault in faults:
            log.emit(fault.pop("event", Event.FAULT_DETECTED), **fault)
        return blame_from_events(run_dir, "0", status, ["slot-0", "slot-1"])

    bad, why = blame(
        {
            "node_id": "slot-1",
            "kind": "restore",
            "failure_class": "checkpoint",
            "step": 10,
            "error": "step_00000010/__1_0.distcp fails its crc32c check",
        },
        {
            "node_id": "slot-1",
            "kind": "OSError",
            "failure_class": "storage_error",
            "step": 10,
            "error": "[Errno 28] No space left on device",
        },
    )
    assert bad == [] and "checkpoint, storage_error, not at a machine" in why[0]
    bad, _ = blame(
        {"node_id": "slot-1", "kind": "restore", "failure_class": "checkpoint", "error": "missing"},
        {
            "node_id": "slot-0",
            "kind": "RuntimeError",
            "failure_class": "restarts_exhausted",
            "error": "CUDA error: an illegal memory access",
        },
    )
    assert bad == ["slot-0"]
    # A drill that fakes diverging data blames no machine (the launcher that reported is all that
    # is left to go on); one that kills a rank blames its node.
    bad, why = blame({"event": Event.FAULT_INJECTED, "node_id": "slot-1", "kind": "nan", "step": 5})
    assert bad == ["slot-0"] and "launcher(s) on ['slot-0'] reported" in why[0]
    assert blame({"event": Event.FAULT_INJECTED, "node_id": "slot-1", "kind": "sigkill", "step": 5})[0] == ["slot-1"]


GPU_CHECK = "NVRx gpu health check failed (inprocess_wrapper, NVRx 0.7.0): GPU 3 failed its health check"


def health_diagnosis(failure: FailureClass, signals: dict[str, list[str]] | None = None) -> Diagnosis:
    """What a backend's ``diagnose`` says of a launch whose node slot-0 is unhealthy by its own
    signals (``evidence.health_aware_diagnosis``)."""
    signals = {"slot-0": [GPU_CHECK]} if signals is None else signals
    return blamed(failure.value, signals, ["status: node 0 failed"])


@pytest.mark.parametrize(
    "failure", [FailureClass.USER_ERROR, FailureClass.STORAGE_ERROR, FailureClass.NON_FINITE, FailureClass.UNKNOWN]
)
def test_a_fault_on_a_node_unhealthy_by_its_own_signals_climbs_naming_the_node_and_the_signal(failure):
    climb, why = ladder.should_escalate(outcome(failure), 1, max_replacements=1, diagnosis=health_diagnosis(failure))
    assert climb and "slot-0" in why and GPU_CHECK in why and failure.value in why
    # bounded by max_node_replacements like any rung
    climb, why = ladder.should_escalate(outcome(failure), 2, max_replacements=1, diagnosis=health_diagnosis(failure))
    assert not climb and "max_node_replacements=1 spent" in why


@pytest.mark.parametrize("failure", [FailureClass.USER_ERROR, FailureClass.NON_FINITE, FailureClass.UNKNOWN])
def test_the_same_fault_on_healthy_nodes_stops_with_todays_message(failure):
    healthy = Diagnosis(failure.value, [], False, ["every node of the job is healthy by every signal it reports"])
    expected = ladder.should_escalate(outcome(failure), 1, max_replacements=3)
    assert not expected[0] and what_to_do(failure.value) in expected[1]
    for diagnosis in (
        None,
        healthy,
        health_diagnosis(failure, {"slot-0": []}),  # blamed with no signal on record: not by its health
        health_diagnosis(FailureClass.RESTARTS_EXHAUSTED),  # a diagnosis of another failure
    ):
        assert ladder.should_escalate(outcome(failure), 1, max_replacements=3, diagnosis=diagnosis) == expected


@pytest.mark.parametrize("failure", [FailureClass.ALREADY_RUNNING, FailureClass.LAUNCH_ENDED])
def test_a_launcher_that_did_nothing_never_climbs_whatever_its_node_says(failure):
    climb, why = ladder.should_escalate(outcome(failure), 1, max_replacements=3, diagnosis=health_diagnosis(failure))
    assert not climb and what_to_do(failure.value) in why


def test_the_stop_marker_is_moved_aside_only_for_the_blamed_failure_of_this_launch(tmp_path):
    cfg = RunConfig(run_id="r", run_dir=str(tmp_path / "run"), dataset_dir=str(tmp_path / "data"))
    handle = JobHandle(
        backend="local", run_id="r", job_name="r-0", launch_id="0", extra={"submitted_at": time.time() - 5}
    )
    user_bug = health_diagnosis(FailureClass.USER_ERROR)
    assert declare_stop(cfg.layout, FailureClass.NON_FINITE, rank=1, step=4, error="loss is nan")
    assert ladder.clear_blamed_stop(cfg, handle, user_bug, ["slot-0"]) == ""  # the marker records another fault
    assert read_stop(cfg.layout)["failure_class"] == "non_finite"
    cfg.layout.stop_marker.unlink()
    assert declare_stop(cfg.layout, FailureClass.USER_ERROR, rank=1, step=4, error="CUDA error: an illegal access")
    earlier = JobHandle(
        backend="local", run_id="r", job_name="r-0", launch_id="0", extra={"submitted_at": time.time() + 60}
    )
    assert ladder.clear_blamed_stop(cfg, earlier, user_bug, ["slot-0"]) == ""  # written before this launch
    assert ladder.clear_blamed_stop(cfg, handle, user_bug, []) == ""  # nothing replaced
    why = ladder.clear_blamed_stop(cfg, handle, user_bug, ["slot-0"])
    assert why.startswith("STOP.cleared.") and "user_error" in why and "slot-0" in why and "rank 1" in why
    assert read_stop(cfg.layout) is None
    (kept,) = cfg.layout.control.glob("STOP.cleared.*.json")
    assert kept.name == why.split(":")[0] and "CUDA error" in kept.read_text()  # kept, never deleted
