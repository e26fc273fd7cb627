"""What a launch's end means (fsdp_resilience.training.launch.outcome): the failure class and the
``final`` record's message, from ft_launcher's exit code and what the run dir holds."""

from __future__ import annotations

import pytest

from fsdp_resilience.training.contract import ExitCode, FailureClass, RunConfig, declare_stop
from fsdp_resilience.training.launch.outcome import classify, describe_stop, dropped_spare_reason, stop_record


@pytest.fixture
def cfg(tmp_path) -> RunConfig:
    cfg = RunConfig(run_id="r", run_dir=str(tmp_path / "r"), dataset_dir=str(tmp_path / "data"), steps=10)
    cfg.layout.create()
    return cfg


def test_an_exit_without_the_final_checkpoint_is_no_success(cfg):
    failure, message = classify(cfg, 0, stalled=False)
    assert failure is FailureClass.UNKNOWN and "before the final checkpoint" in message


def test_a_stall_or_nvrx_no_progress_exit_is_no_progress(cfg):
    assert classify(cfg, 1, stalled=True)[0] is FailureClass.NO_PROGRESS
    failure, message = classify(cfg, int(ExitCode.NO_PROGRESS), stalled=False)
    assert failure is FailureClass.NO_PROGRESS and "past step 0" in message


def test_a_launcher_killed_by_a_signal_is_unknown(cfg):
    assert classify(cfg, -9, stalled=False) == (FailureClass.UNKNOWN, "the launcher was killed by signal 9")


def test_workers_that_never_started_blame_the_launcher_not_the_machine(cfg):
    failure, message = classify(cfg, 1, stalled=False, workers_started=False, log_hint="node0.log")
    assert failure is FailureClass.UNKNOWN
    assert message.startswith("the workers never started: ft_launcher exited 1") and message.endswith("node0.log")


def test_a_failed_launch_exhausted_its_restarts(cfg):
    failure, message = classify(cfg, 1, stalled=False)
    assert failure is FailureClass.RESTARTS_EXHAUSTED and f"max_restarts={cfg.max_restarts}" in message
    none = cfg.replace(restart_mode="none")
    failure, message = classify(none, 1, stalled=False)
    assert failure is FailureClass.RESTARTS_EXHAUSTED and "restart_mode=none has no in-job restarts" in message


def test_a_declared_stop_decides_the_outcome(cfg):
    declare_stop(cfg.layout, FailureClass.USER_ERROR, rank=1, step=4, error="ValueError: bad")
    assert stop_record(cfg.layout)["failure_class"] == FailureClass.USER_ERROR.value
    assert classify(cfg, 1, stalled=True) == (FailureClass.USER_ERROR, "user error at step 4: ValueError: bad")


def test_describe_stop_says_what_where_and_why():
    assert describe_stop({"failure_class": "non_finite", "reason": "NaN"}) == (
        FailureClass.NON_FINITE,
        "non finite: NaN",
    )
    failure, message = describe_stop({"failure_class": "storage_error", "step": 3})
    assert failure is FailureClass.STORAGE_ERROR
    assert message.startswith("storage error at step 3: no details recorded; free space")


def test_a_dropped_spare_names_the_health_check_that_turned_it_away(tmp_path):
    log = tmp_path / "node2.log"
    log.write_text("rendezvous joined\nERROR: storage health check failed: /fsx/run is gone\nexiting\n")
    reason = dropped_spare_reason(1, str(log))
    assert reason == f"NVRx turned the node away: ERROR: storage health check failed: /fsx/run is gone; read {log}"
    log.write_text("nothing special\n")
    assert dropped_spare_reason(3, str(log)) == f"ft_launcher exited 3; read {log}"
    assert dropped_spare_reason(3, "the pod's log") == "ft_launcher exited 3"


def test_a_spare_turned_away_says_why(tmp_path):
    """A spare whose ft_launcher leaves the rendezvous before its node trained (NVRx's health
    checks at join) is reported with NVRx's own reason from the node's log."""
    log = tmp_path / "node2.log"
    log.write_text(
        "starting\n[ERROR] Health check failed for node localhost_77_0: Storage path health check "
        "failed: /fsx/runs/r/checkpoints is not reachable\nexit\n"
    )
    reason = dropped_spare_reason(1, str(log))
    assert "NVRx turned the node away" in reason and "/fsx/runs/r/checkpoints is not reachable" in reason
    assert dropped_spare_reason(1, str(tmp_path / "none.log")).startswith("ft_launcher exited 1")
