"""The run dir and its records (fsdp_resilience.training.contract.rundir): stop marker, final status."""

import pytest

from fsdp_resilience.training.contract.events import Event, EventLog
from fsdp_resilience.training.contract.failures import FailureClass
from fsdp_resilience.training.contract.rundir import RunDir, declare_stop, final_status, read_stop, record_membership


def test_final_status_reports_a_failed_node_over_a_successful_one(tmp_path):
    log = EventLog(RunDir(tmp_path).events, run_id="r")
    log.emit(Event.FINAL, node_rank=1, failure_class="restarts_exhausted", exit_code=75)
    log.emit(Event.FINAL, node_rank=0, failure_class="success", exit_code=0)
    assert final_status(tmp_path)["failure_class"] == "restarts_exhausted"
    assert final_status(tmp_path / "nothing") is None


def test_stop_marker_first_writer_wins(tmp_path):
    layout = RunDir(tmp_path)
    assert read_stop(layout) is None
    assert declare_stop(layout, FailureClass.NON_FINITE, rank=1, step=7, error="loss is nan")
    assert not declare_stop(layout, FailureClass.USER_ERROR, rank=0, step=7, error="x")
    assert read_stop(layout)["failure_class"] == "non_finite" and read_stop(layout)["rank"] == 1
    layout.stop_marker.write_text("{torn")
    assert read_stop(layout)["failure_class"] == "user_error"
    with pytest.raises(ValueError):
        declare_stop(layout, FailureClass.RESTARTS_EXHAUSTED)


def test_the_layout_names_every_path_under_the_run_dir(tmp_path):
    layout = RunDir(tmp_path)
    assert layout.checkpoint_dir(20) == tmp_path / "checkpoints" / "step_00000020"
    assert layout.launch_lock(3) == tmp_path / "control" / "launch-node3.lock"
    assert layout.launch_config("l2") == tmp_path / "launches" / "l2.json"
    assert layout.quarantine == tmp_path / "checkpoints" / "quarantine"
    layout.create()
    assert all(p.is_dir() for p in (layout.control, layout.logs, layout.checkpoints))


def test_membership_records_a_spare_that_took_a_lost_nodes_place(tmp_path):
    layout = RunDir(tmp_path)
    log = EventLog(layout.events, run_id="r", rank=0)
    # the first attempt: nothing to compare with
    assert record_membership(layout, log, "l1", 0, [(0, "a"), (1, "b")]) == []
    (promoted,) = record_membership(layout, log, "l1", 1, [(0, "a"), (2, "c")])
    assert promoted["event"] == "spare_promoted" and promoted["node_id"] == "c" and promoted["node_rank"] == 2
    assert promoted["replaces"] == ["b"] and promoted["replaced_node_ranks"] == [1]
    assert promoted["previous_attempt"] == 0
    assert record_membership(layout, log, "l2", 0, [(0, "a"), (1, "d")]) == []  # another launch starts afresh


def test_a_launch_ends_with_a_decisive_final_of_its_own_incarnation(tmp_path):
    """launch_ended_by: success or a failure that fails the launch ends it; an unknown final (a
    node killed, a spare dropped) does not; nor does a final of an earlier incarnation of the
    same launch id (a run triggered again under the same name); locally (no uid) nothing is
    known to have ended."""
    from fsdp_resilience.training.contract.rundir import launch_ended_by

    log = EventLog(RunDir(tmp_path).events, run_id="r", launch_id="0")
    log.emit(Event.FINAL, node_rank=0, failure_class="storage_error", exit_code=74, launch_uid="job-uid-old")
    log.emit(Event.FINAL, node_rank=2, failure_class="unknown", exit_code=1, launch_uid="job-uid-new")
    assert launch_ended_by(tmp_path, "0", "job-uid-new") is None
    log.emit(Event.FINAL, node_rank=1, failure_class="success", exit_code=0, launch_uid="job-uid-new")
    ended = launch_ended_by(tmp_path, "0", "job-uid-new")
    assert ended["node_rank"] == 1 and ended["failure_class"] == "success"
    assert launch_ended_by(tmp_path, "0", "job-uid-old")["failure_class"] == "storage_error"
    assert launch_ended_by(tmp_path, "1", "job-uid-new") is None  # another launch
    assert launch_ended_by(tmp_path, "0", "") is None  # no incarnation: never known to have ended
