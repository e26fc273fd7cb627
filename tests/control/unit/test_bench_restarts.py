"""The benchmarks' restart breakdowns (bench/restarts.py) of simulated runs: which faults fired, the
restart that recovered each and where its time went, and the step cadence; read with the run
report's readers, so a log the report accepts is a log the benchmarks accept."""

from __future__ import annotations

import pytest

from bench.restarts import group_trials, injected_faults, restart_trials, step_cadence
from fsdp_resilience.training.contract import read_events

from control.fakes.simulated_run import STEP_S, clean_run, injob_run, inprocess_run


def test_an_inprocess_restart_is_broken_down_into_its_phases(tmp_path):
    events = read_events(inprocess_run(tmp_path / "inprocess").layout.events)
    [fault] = injected_faults(events)
    assert fault["kind"] == "exception" and fault["step"] == 13
    [trial] = restart_trials(events)
    assert trial["layer"] == "inprocess" and trial["resumed_step"] == 11
    assert trial["parts"] == pytest.approx(
        {"detect": 0.01, "tear_down": 3.0, "rendezvous_restore": 0.5, "first_step": STEP_S}
    )
    assert trial["measured_s"] == pytest.approx(sum(trial["parts"].values()))
    [row] = group_trials([trial], "layered")
    assert row["kind"] == "exception" and row["layer"] == "inprocess" and row["latency_s"]["n"] == 1


def test_an_injob_restart_without_a_launcher_log_is_one_bucket_to_the_new_workers(tmp_path):
    events = read_events(injob_run(tmp_path / "injob").layout.events)
    [trial] = restart_trials(events)
    assert trial["layer"] == "injob"
    assert trial["parts"]["detect_to_new_workers"] == pytest.approx(12.05)
    assert trial["parts"]["first_step"] == pytest.approx(STEP_S)


def test_step_cadence_is_the_median_gap_between_consecutive_steps(tmp_path):
    events = read_events(clean_run(tmp_path / "clean").layout.events)
    assert step_cadence(events) == pytest.approx(STEP_S)  # the two saves' stalls are outliers
    assert injected_faults(events) == [] and restart_trials(events) == []
    assert step_cadence([]) is None and step_cadence([{"event": "step"}]) is None
