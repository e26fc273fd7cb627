"""The run report as the Airflow UI's view reads it: incrementally, with each fault's outcome."""

from __future__ import annotations

import json
import math

from fsdp_resilience.control.report.build import build_report
from fsdp_resilience.control.report.event_feed import RunDirEventFeed, event_feed_for
from fsdp_resilience.control.report.live import MAX_POINTS, LiveReport, LiveReports, numbers_only
from fsdp_resilience.control.report.records import fault_outcomes
from fsdp_resilience.training.contract import Event, read_events

from control.fakes.simulated_run import STEPS, SimulatedRun, injob_run, inprocess_run


class CountingFeed(RunDirEventFeed):
    """The run dir's feed, counting the bytes it reads."""

    def __init__(self, run_dir):
        super().__init__(run_dir)
        self.bytes_read = 0

    def read(self, offset):
        records, end = super().read(offset)
        self.bytes_read += self.path.stat().st_size - offset if self.path.exists() else 0
        return records, end


def test_a_recovered_fault_shows_the_layer_that_took_it_never_restarts_exhausted(tmp_path):
    for scenario, layer in ((inprocess_run, "inprocess"), (injob_run, "injob")):
        run = scenario(tmp_path / layer)
        (outcome,) = fault_outcomes(read_events(run.layout.events))
        assert (outcome.taken_by, outcome.recovered) == (layer, True)
        assert outcome.outcome.startswith(f"recovered ({layer}, ")
        assert outcome.points_at == "the machine (transient)"
        faults = build_report(run.layout.root).markdown.read_text().split("## Faults")[1].split("##")[0]
        assert f"| {layer} | recovered ({layer}, " in faults
        assert "restarts_exhausted" not in faults


def test_a_fault_the_launch_could_not_recover_is_recovered_by_the_relaunch(tmp_path):
    run = SimulatedRun(tmp_path / "r", "relaunched")
    run.launch(launch_id="1")
    run.train(1, 12)
    run.inject("sigkill", 13, rank=0)
    run.detect("injob", 13)
    run.final("restarts_exhausted", 75)
    still = fault_outcomes(read_events(run.layout.events))
    ended = "not recovered in launch 1: it ended restarts_exhausted"
    assert [(o.recovered, o.outcome) for o in still] == [(False, ended)]
    run.now += 20.0
    run.launch(launch_id="2", start_step=10)
    run.emit(run.rank0, Event.RESTART_BEGIN, layer="relaunch", reason="relaunch: started again", fault_ts=run.fault_ts)
    run.train(11, STEPS, resumed_layer="relaunch")
    (outcome,) = fault_outcomes(read_events(run.layout.events))
    assert (outcome.taken_by, outcome.recovered) == ("relaunch", True)
    assert outcome.outcome == "launch 1 ended restarts_exhausted; recovered by relaunch 2"


def test_a_fault_of_a_run_still_going_is_not_recovered_yet(tmp_path):
    run = SimulatedRun(tmp_path / "r", "going")
    run.launch()
    run.train(1, 5)
    run.detect("inprocess", 6)
    (outcome,) = fault_outcomes(read_events(run.layout.events))
    assert (outcome.taken_by, outcome.recovered, outcome.outcome) == ("inprocess", None, "not recovered yet")


def test_the_live_report_reads_each_byte_of_the_log_once(tmp_path):
    run = SimulatedRun(tmp_path / "r", "live")
    feed = CountingFeed(run.layout.root)
    live = LiveReport(str(run.layout.root), feed)
    assert live.refresh() == 0 and live.status() == {"state": "not_started"}
    run.launch()
    run.train(1, 8)
    first = live.refresh()
    assert first == len(read_events(run.layout.events)) and live.status()["state"] == "running"
    size_then = run.layout.events.stat().st_size
    assert live.brief()["last_step"] == 8

    # A line still being written is left for the next look.
    partial = '{"event": "step", "ts": 1'
    with open(run.layout.events, "a") as f:
        f.write(partial)
    assert live.refresh() == 0 and live.offset == size_then
    with open(run.layout.events, "a") as f:
        f.write(f'{run.now + 1}, "step": 9, "step_s": 1.0, "rank": 0, "pid": 1000}}\n')
    assert live.refresh() == 1

    run.train(10, STEPS)
    run.final()
    live.refresh()
    assert live.events == read_events(run.layout.events)
    # Every byte once; only the line that was half-written when first looked at, twice.
    assert feed.bytes_read == run.layout.events.stat().st_size + len(partial)
    view = live.view(to_html=lambda md: md.upper())
    assert view["status"]["state"] == "success" and view["brief"]["last_step"] == STEPS
    assert view["sections_html"].startswith("## SUMMARY") and "## Figures" not in view["sections_markdown"]
    assert {row[0] for row in view["figures"]["steps"]} == set(range(1, STEPS + 1)) and view["figures"]["wall_s"] > 0
    json.dumps(numbers_only(view), allow_nan=False)


def test_the_view_gives_each_restart_its_reason_and_thins_long_runs(tmp_path):
    run = inprocess_run(tmp_path / "r")
    live = LiveReport(str(run.layout.root), RunDirEventFeed(run.layout.root))
    live.refresh()
    figures = live.view()["figures"]
    (restart,) = figures["restarts"]
    assert restart["layer"] == "inprocess" and restart["reason"] == "timeout" and restart["latency_s"] > 0
    (fault,) = figures["faults"]
    assert fault["recovered"] is True and fault["taken_by"] == "inprocess"
    assert [row[0] for row in figures["steps"] if row[4]] == [11, 12]  # replayed: lost work

    from fsdp_resilience.control.report.live import _thin

    rows = [[i, i, i + 1, 1.0, i == 7] for i in range(10 * MAX_POINTS)]
    thinned = _thin(rows)
    assert len(thinned) <= MAX_POINTS + 2 and rows[7] in thinned and rows[-1] in thinned


def test_numbers_only_makes_nan_json_safe():
    assert numbers_only({"a": [math.nan, 1.5, math.inf], "b": "x"}) == {"a": [None, 1.5, None], "b": "x"}


def test_live_reports_keep_the_newest_runs(tmp_path):
    reports = LiveReports(size=2)
    runs = [SimulatedRun(tmp_path / f"r{i}", f"r{i}") for i in range(3)]
    for run in runs:
        run.launch()
        reports.get(str(run.layout.root), lambda run=run: RunDirEventFeed(run.layout.root))
    first = reports.get(str(runs[2].layout.root), lambda: RunDirEventFeed(runs[2].layout.root))
    assert reports.get(str(runs[2].layout.root), lambda: None) is first  # kept, not rebuilt
    assert str(runs[0].layout.root) not in reports._reports


def test_the_feed_is_the_run_dir_where_it_is_mounted(tmp_path, monkeypatch):
    monkeypatch.setenv("FSDP_RUNS_ROOT", str(tmp_path))
    monkeypatch.setenv("FSDP_CHECKPOINTS_S3", "s3://exports/runs")
    (tmp_path / "here").mkdir()
    assert isinstance(event_feed_for(str(tmp_path / "here")), RunDirEventFeed)
    remote = event_feed_for(str(tmp_path / "elsewhere"))  # not mounted here: its S3 export
    assert remote.source == "s3://exports/runs/elsewhere/events.jsonl"
    monkeypatch.delenv("FSDP_CHECKPOINTS_S3")
    assert isinstance(event_feed_for(str(tmp_path / "elsewhere")), RunDirEventFeed)


def test_the_view_shows_escalations_with_their_evidence_and_the_spares(tmp_path):
    from control.fakes.simulated_run import relaunch_run, spare_run

    for scenario in (relaunch_run, spare_run):
        run = scenario(tmp_path / scenario.__name__)
        live = LiveReport(str(run.layout.root), RunDirEventFeed(run.layout.root))
        live.refresh()
        view = live.view()
        figures, brief = view["figures"], view["brief"]
        if scenario is relaunch_run:
            (escalation,) = figures["escalations"]
            assert escalation["nodes"] == ["node-a"] and "replace node-a" in escalation["evidence"]
            assert brief["escalations"] == 1 and brief["nodes_replaced"] == {"node-a": 1}
            assert [launch["launch_id"] for launch in figures["launches"]] == ["launch-1", "launch-2"]
            assert "## Escalations" in view["sections_markdown"]
        else:
            assert {s["event"] for s in figures["spares"]} == {"spare_promoted", "spare_added"}
            assert "## Hot spares" in view["sections_markdown"]
