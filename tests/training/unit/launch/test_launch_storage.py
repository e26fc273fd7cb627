"""Whether the run dir takes writes (fsdp_resilience.training.launch.storage)."""

from __future__ import annotations

import pytest

from fsdp_resilience.training.contract import ConfigError, FailureClass, RunDir, declare_stop, read_stop
from fsdp_resilience.training.launch.storage import clear_storage_stop, create_run_dir, storage_problem


def test_a_run_dir_under_a_file_is_a_config_error(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is not a folder"):
        create_run_dir(RunDir(tmp_path / "file" / "run"))
    layout = RunDir(tmp_path / "run")
    create_run_dir(layout)
    assert layout.checkpoints.is_dir() and storage_problem(layout) is None


def test_a_storage_stop_is_cleared_once_writes_work_again(tmp_path):
    layout = RunDir(tmp_path / "run")
    create_run_dir(layout)
    assert not clear_storage_stop(layout)  # no stop at all
    declare_stop(layout, FailureClass.STORAGE_ERROR, rank=0, step=5, error="disk full")
    assert clear_storage_stop(layout)
    assert read_stop(layout) is None
    assert list(layout.control.glob("STOP.cleared.*.json"))  # kept for the record


def test_other_stops_are_never_cleared(tmp_path):
    layout = RunDir(tmp_path / "run")
    create_run_dir(layout)
    declare_stop(layout, FailureClass.USER_ERROR, rank=0, step=5, error="ValueError")
    assert not clear_storage_stop(layout)
    assert read_stop(layout)["failure_class"] == FailureClass.USER_ERROR.value
