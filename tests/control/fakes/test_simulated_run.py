"""The simulated run (tests/control/fakes/simulated_run.py) writes what a real run writes: a log
the contract reads back in time order, checkpoints the catalog sees committed, and run.json."""

from __future__ import annotations

import json

import pytest

from fsdp_resilience.training.contract import CheckpointCatalog, Event, read_events

from control.fakes.simulated_run import CHECKPOINT_INTERVAL, SCENARIOS, STEPS, T0, loss_at


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_each_scenario_writes_a_readable_log_on_its_own_clock(tmp_path, scenario):
    run = SCENARIOS[scenario](tmp_path / scenario)
    events = read_events(run.layout.events)
    stamps = [r["ts"] for r in events]
    assert stamps[0] == T0 and stamps == sorted(stamps)
    assert events[0]["event"] == Event.LAUNCH_BEGIN.value
    assert events[-1]["event"] in (Event.FINAL.value, Event.EVAL.value)
    last_steps = {r["step"]: r["loss"] for r in events if r["event"] == Event.STEP.value}
    assert sorted(last_steps) == list(range(1, STEPS + 1))
    assert all(loss == loss_at(step) for step, loss in last_steps.items())
    committed = sorted(c.step for c in CheckpointCatalog(run.layout).committed())
    assert committed == list(range(CHECKPOINT_INTERVAL, STEPS + 1, CHECKPOINT_INTERVAL))
    assert json.loads((run.layout.root / "run.json").read_text())["steps"] == STEPS


def test_a_restart_replays_steps_and_logs_its_latency(tmp_path):
    run = SCENARIOS["inprocess"](tmp_path / "inprocess")
    events = read_events(run.layout.events)
    steps = [r["step"] for r in events if r["event"] == Event.STEP.value]
    assert steps.count(11) == steps.count(12) == 2  # the fault at 13 restored step 10
    [end] = [r for r in events if r["event"] == Event.RESTART_END.value]
    assert end["layer"] == "inprocess" and end["step"] == 11 and end["latency_s"] > 0
