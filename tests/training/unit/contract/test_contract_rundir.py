"""The run dir and its records (fsdp_resilience.training.contract.rundir): stop marker, final status."""

import pytest

from fsdp_resilience.training.contract.events import Event, EventLog
from fsdp_resilience.training.contract.failures import FailureClass
from fsdp_resilience.training.contract.rundir import RunDir, declare_stop, final_status, read_stop


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
