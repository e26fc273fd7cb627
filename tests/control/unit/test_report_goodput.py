"""The goodput accounting (``report.goodput``) of simulated runs: every second of wall time in one
category, replayed steps, each restart layer, log-interval gaps, saves in flight, partial logs."""

from __future__ import annotations

import json

import pytest

from fsdp_resilience.control.report.goodput import goodput
from fsdp_resilience.control.report.records import step_executions
from fsdp_resilience.training.contract import Event, EventLog, read_events

from control.fakes.simulated_run import (
    BLOCKING_S,
    SCENARIOS,
    STEP_S,
    STEPS,
    T0,
    SimulatedRun,
    clean_run,
    injob_run,
    inprocess_run,
    relaunch_run,
)
from control.support.report_checks import assert_adds_up


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_goodput_parts_add_up_to_wall_time(tmp_path, scenario):
    run = SCENARIOS[scenario](tmp_path / scenario)
    accounting = goodput(read_events(run.layout.events))
    assert_adds_up(accounting)
    assert accounting["steps_completed"] == STEPS
    assert accounting["productive_s"] == pytest.approx(STEPS * STEP_S)
    assert accounting["badput_s"]["checkpoint_blocking"] == pytest.approx(2 * BLOCKING_S)
    json.dumps(accounting)  # XCom-safe


def test_clean_run_has_no_restart_or_lost_time(tmp_path):
    run = clean_run(tmp_path / "clean")
    accounting = goodput(read_events(run.layout.events))
    # launch 4 s, 20 steps, 2 saves, 1.5 s launcher shutdown; the eval after it is not wall time.
    assert accounting["wall_s"] == pytest.approx(4.0 + STEPS * STEP_S + 2 * BLOCKING_S + 1.5)
    badput = accounting["badput_s"]
    assert badput["startup_restore"] == pytest.approx(4.0)
    assert badput["other"] == pytest.approx(1.5)
    assert badput["lost_progress"] == badput["restart_inprocess"] == badput["restart_injob"] == 0
    assert accounting["replayed_steps"] == [] and accounting["restarts"] == []


def test_replayed_steps_count_once_productive_and_once_lost(tmp_path):
    run = inprocess_run(tmp_path / "inprocess")
    events = read_events(run.layout.events)
    accounting = goodput(events)
    assert accounting["replayed_steps"] == [11, 12]
    assert accounting["step_executions"] == STEPS + 2
    assert accounting["productive_s"] == pytest.approx(STEPS * STEP_S)  # 11 and 12 once each
    assert accounting["badput_s"]["lost_progress"] == pytest.approx(2 * STEP_S)  # their first run
    executions = step_executions(events)
    assert [e.step for e in executions if e.replayed] == [11, 12]
    kept = [e for e in executions if e.step in (11, 12) and not e.replayed]
    assert len(kept) == 2 and all(e.segment[1] == 1 for e in kept)  # the kept ones: iteration 1
    # Fault -> restart_begin (3.01 s) is restart; restart_begin -> train_begin (0.5 s) restore;
    # the first step after it is productive although restart_end's latency window covers it.
    assert accounting["badput_s"]["restart_inprocess"] == pytest.approx(3.01)
    assert accounting["badput_s"]["startup_restore"] == pytest.approx(4.0 + 0.5)
    [restart] = accounting["restarts"]
    assert restart["layer"] == "inprocess" and restart["latency_s"] == pytest.approx(3.01 + 0.5 + STEP_S)


def test_injob_restart_window_is_restart_time_except_the_resumed_step(tmp_path):
    run = injob_run(tmp_path / "injob")
    accounting = goodput(read_events(run.layout.events))
    assert accounting["replayed_steps"] == [11, 12]
    # 0.05 s to detect + 12 s for new processes (in-job restarts log no process start).
    assert accounting["badput_s"]["restart_injob"] == pytest.approx(12.05)
    assert accounting["badput_s"]["startup_restore"] == pytest.approx(4.0)
    assert accounting["badput_s"]["lost_progress"] == pytest.approx(2 * STEP_S)


def test_relaunch_counts_both_launches_and_the_gap(tmp_path):
    run = relaunch_run(tmp_path / "relaunch")
    accounting = goodput(read_events(run.layout.events))
    badput = accounting["badput_s"]
    assert badput["startup_restore"] == pytest.approx(4.0 + 6.0)
    # fault -> final (2) -> escalation (3) -> replacement (20) -> launch-2; its startup is not restart.
    assert badput["restart_relaunch"] == pytest.approx(25.0)
    assert badput["lost_progress"] == pytest.approx(2 * STEP_S)
    assert [r["layer"] for r in accounting["restarts"]] == ["relaunch"]


def test_log_interval_gaps_are_shared_between_the_unlogged_steps(tmp_path):
    log = EventLog(tmp_path / "events.jsonl", run_id="sparse", pid=1, rank=0, iteration=0)
    log.emit(Event.LAUNCH_BEGIN, ts=T0, nodes=1)
    log.emit(Event.TRAIN_BEGIN, ts=T0 + 2, start_step=0)
    for step in (5, 10):  # log_interval=5, 1 s per step
        log.emit(Event.STEP, ts=T0 + 2 + step, step=step, loss=1.0, step_s=1.0)
    accounting = goodput(read_events(tmp_path / "events.jsonl"))
    assert accounting["steps_completed"] == 10 and accounting["last_step"] == 10
    assert accounting["productive_s"] == pytest.approx(10.0)
    assert accounting["ettr"] == pytest.approx(10 / 12)


def test_steps_slowed_by_a_save_in_flight_count_as_interference_not_productive(tmp_path):
    log = EventLog(tmp_path / "events.jsonl", run_id="writer", pid=1, rank=0, iteration=0)
    log.emit(Event.LAUNCH_BEGIN, ts=T0, nodes=1)
    log.emit(Event.TRAIN_BEGIN, ts=T0, start_step=0)
    ts = T0
    for step in range(1, 11):  # 1 s steps, except 1.5 s while step 4's save is written (steps 5, 6)
        ts += 1.5 if step in (5, 6) else 1.0
        log.emit(Event.STEP, ts=ts, step=step, loss=1.0, step_s=1.5 if step in (5, 6) else 1.0)
        if step == 4:
            log.emit(Event.CHECKPOINT_BEGIN, ts=ts, step=4, blocking_s=0.0, launch_id="l", attempt=0)
        if step == 6:
            log.emit(Event.CHECKPOINT_COMMIT, ts=ts, step=4, launch_id="l", attempt=0)
    accounting = goodput(read_events(tmp_path / "events.jsonl"))
    assert accounting["usual_step_s"] == pytest.approx(1.0) and accounting["steps_during_saves"] == 2
    assert accounting["badput_s"]["checkpoint_interference"] == pytest.approx(1.0)
    assert accounting["productive_s"] == pytest.approx(10.0)
    assert accounting["ettr"] == pytest.approx(10.0 / 11.0)


def test_goodput_of_nothing_or_of_a_partial_log(tmp_path):
    assert goodput([])["ettr"] is None
    assert goodput([{"event": "step"}, {"ts": "late", "event": "step"}])["wall_s"] == 0
    # A run still going whose last line was torn: wall time runs to the newest complete record.
    run = SimulatedRun(tmp_path / "going")
    run.launch()
    run.train(1, 5)
    with open(run.layout.events, "a") as f:
        f.write('{"ts": 1800000099.0, "event": "step", "step": 6, "lo')
    accounting = goodput(read_events(run.layout.events))
    assert accounting["wall_s"] == pytest.approx(4.0 + 5 * STEP_S)
    assert_adds_up(accounting)
