"""The ladder climbs past a user error only on a node unhealthy by its own signals: the local
backend, with a stand-in launcher (no training: what matters here is the run dir the ladder
reads), a rank's stop marker written with the contract's ``declare_stop`` and NVRx's failed
health check with the training plane's ``record_health_check``."""

from __future__ import annotations

import time

import pytest

from fsdp_resilience.control import ladder
from fsdp_resilience.control.progress import check_progress
from fsdp_resilience.control.task_data import Run
from fsdp_resilience.training.contract import (
    Event,
    EventLog,
    FailureClass,
    RunConfig,
    declare_stop,
    read_events,
    read_stop,
    what_to_do,
)
from fsdp_resilience.training.restart.health_checks import record_health_check

from control.fakes.stand_in_launcher import script_backend
from shared import FAST_RUN

#: A launcher (``python -m fsdp_resilience.training.launch --config <run_dir>/launches/<id>.json``)
#: that, once the test creates ``<run_dir>/go``, ends its launch with a user error as
#: fsdp_resilience.training.launch does after a rank declared one: its final event, exit 78.
FINAL = (
    '{"event": "final", "failure_class": "user_error", "exit_code": 78, "launch_id": "%s", '
    '"message": "a rank declared user_error", "node_rank": 0, "ts": %s}'
)
USER_ERROR_LAUNCHER = f"""#!/bin/sh
run_dir=$(dirname "$(dirname "$4")")
while [ ! -e "$run_dir/go" ]; do sleep 0.05; done
printf '{FINAL}\\n' "$TRAINING_LAUNCH_ID" "$(date +%s)" >> "$run_dir/events.jsonl"
exit 78
"""


@pytest.fixture()
def user_error_launch(tmp_path):
    """A one-node launch of a run whose rank hit a user error (STOP.json), ended; and the slot it
    ran on. ``health_check`` (set by the test before ``go``) adds NVRx's failed GPU check there."""
    backend = script_backend(tmp_path / "stand-in", USER_ERROR_LAUNCHER, slots=2, cancel_grace_s=2)
    cfg = RunConfig(
        **{**FAST_RUN, "run_id": "user-bug", "run_dir": str(tmp_path / "run"), "dataset_dir": str(tmp_path / "data")}
    )
    handle = backend.submit(cfg, launch_id="0")
    slot = backend.status(handle).nodes[0].node_id
    run = Run(config=cfg.to_dict(), backend=backend.to_config(), max_node_replacements=1)

    def end(health_check: bool):
        on_slot = EventLog(cfg.layout.events, run_id=cfg.run_id, node_id=slot)
        on_slot.emit(Event.LAUNCH_BEGIN, launch_id="0", node_rank=0, nodes=1, spare_nodes=0, standby=False)
        if health_check:
            record_health_check(
                on_slot.bind(rank=1), "gpu", "inprocess_wrapper", "GPU 1 failed its health check: XID 79"
            )
        assert declare_stop(
            cfg.layout, FailureClass.USER_ERROR, rank=1, step=4, error="RuntimeError: CUDA error: illegal memory access"
        )
        (cfg.layout.root / "go").touch()
        deadline = time.time() + 60
        while backend.status(handle).state != "failed" and time.time() < deadline:
            time.sleep(0.1)
        return check_progress(
            backend, handle, run_dir=cfg.run_dir, final_step=cfg.steps, stall_timeout_s=3600.0, launched_at=0.0
        )

    yield backend, cfg, run, slot, end
    backend.cancel(handle)


def test_a_user_error_on_a_slot_whose_gpu_check_failed_replaces_it_and_clears_the_stop(user_error_launch):
    backend, cfg, run, slot, end = user_error_launch
    outcome = end(health_check=True)
    assert outcome.failure_class == "user_error", outcome
    climb, why = ladder.decide_escalation(run, outcome, rung=1)
    assert climb and slot in why and "gpu health check failed" in why, why
    replaced = ladder.diagnose_and_replace(run, outcome, rung=1)
    assert replaced["replaced"] == [slot] and backend.capacity().quarantined == [slot]
    # The relaunch may start: the launcher refuses only while STOP.json is there.
    assert read_stop(cfg.layout) is None
    (kept,) = cfg.layout.control.glob("STOP.cleared.*.json")
    assert "illegal memory access" in kept.read_text()
    (escalation,) = read_events(cfg.layout.events, "escalation")
    assert escalation["failure_class"] == "user_error" and escalation["nodes"] == [slot]
    assert escalation["stop_cleared"].startswith(kept.name) and slot in escalation["stop_cleared"]
    assert "gpu health check failed" in escalation["signals"][slot][0]
    assert ladder.decide_escalation(run, outcome, rung=2) == (False, "max_node_replacements=1 spent")


def test_the_same_user_error_on_a_healthy_slot_stops_the_run_and_replaces_nothing(user_error_launch):
    backend, cfg, run, slot, end = user_error_launch
    outcome = end(health_check=False)
    climb, why = ladder.decide_escalation(run, outcome, rung=1)
    assert not climb and what_to_do("user_error") in why
    assert "user_error" in ladder.failure_message(run, outcome)
    assert backend.capacity().quarantined == []
    assert read_stop(cfg.layout)["failure_class"] == "user_error"
    assert not read_events(cfg.layout.events, "escalation")
