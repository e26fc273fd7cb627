"""Run reports from real events logs: goodput accounting, the Markdown, the figures, the CLI.

The logs are written with the contract's ``EventLog`` in the shape real runs give them (see
``src/fsdp_resilience/training/train.py`` and ``src/fsdp_resilience/training/restart.py``: ``step`` records from rank 0, ``restart_end``
just before the first step after a restart, in-job ``restart_begin`` after the new
``train_begin``), with timestamps set explicitly so the expected seconds are exact.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_resilience.training.contract import COMMIT_MARKER, CheckpointCatalog, Event, EventLog, RunDir, read_events

REPO = Path(__file__).resolve().parents[3]

from fsdp_resilience.control.report import ReportPaths, build_report, goodput, step_executions  # noqa: E402
from control.fakes.saved_checkpoints import save_checkpoint  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
T0 = 1_800_000_000.0
STEP_S = 1.0
BLOCKING_S = 0.25
STEPS = 20
CHECKPOINT_INTERVAL = 10


def loss_at(step: int) -> float:
    # Deterministic, as a resumed run's losses are: a replayed step logs the same loss again.
    return 6.0 / (1.0 + 0.2 * step)


class SimulatedRun:
    """Writes a run's events log the way the launcher, the workers and the control plane do,
    on a clock it advances itself."""

    def __init__(self, run_dir: Path, run_id: str = "sim-run"):
        self.layout = RunDir(run_dir)
        self.layout.create()
        self.run_id = run_id
        self.now = T0
        self.next_pid = 1000
        self.log = EventLog(self.layout.events, run_id=run_id, host="node-a", node_id="node-a")
        self.rank0 = self.log
        self.attempt = 0
        self.iteration = 0
        self.launch_id = ""
        self.fault_ts: float | None = None
        (run_dir / "run.json").write_text(json.dumps({
            "run_id": run_id, "run_dir": str(run_dir), "dataset_dir": "data/x", "model": "tiny",
            "nodes": 1, "procs_per_node": 2, "steps": STEPS, "checkpoint_interval": CHECKPOINT_INTERVAL,
            "restart_mode": "layered"}))

    def emit(self, log: EventLog, event: Event, after: float = 0.0, **fields) -> dict:
        self.now += after
        return log.emit(event, ts=round(self.now, 6), **fields)

    def _workers(self) -> list[EventLog]:
        ranks = []
        for rank in (0, 1):
            ranks.append(self.log.bind(pid=self.next_pid, rank=rank, node_rank=0, attempt=self.attempt,
                                       iteration=self.iteration))
            self.next_pid += 1
        self.rank0 = ranks[0]
        return ranks

    def launch(self, startup_s: float = 4.0, launch_id: str = "", start_step: int = 0) -> None:
        self.launch_id = launch_id
        self.attempt, self.iteration = 0, 0
        launcher = self.log.bind(pid=self.next_pid, node_rank=0, role="launcher", launch_id=launch_id)
        self.next_pid += 1
        self.emit(launcher, Event.LAUNCH_BEGIN, nodes=1, procs_per_node=2, restart_mode="layered", command="ft")
        self.now += startup_s
        self.begin_training(start_step)

    def begin_training(self, start_step: int, workers: list[EventLog] | None = None) -> None:
        for log in workers or self._workers():
            self.emit(log, Event.TRAIN_BEGIN, start_step=start_step, world_size=2, device="cpu",
                      resumed_from=f"step_{start_step:08d}" if start_step else None)

    def train(self, first: int, last: int, *, resumed_layer: str | None = None) -> None:
        for step in range(first, last + 1):
            self.now += STEP_S
            if resumed_layer is not None:
                self.rank0.emit(Event.RESTART_END, ts=round(self.now, 6), layer=resumed_layer, step=step,
                                latency_s=round(self.now - self.fault_ts, 3))
                resumed_layer = None
            self.emit(self.rank0, Event.STEP, step=step, loss=loss_at(step), step_s=STEP_S, tokens_per_s=4096.0)
            if step % CHECKPOINT_INTERVAL == 0:
                self.emit(self.rank0, Event.CHECKPOINT_BEGIN, after=BLOCKING_S, step=step, blocking_s=BLOCKING_S)
                self.commit(step)

    def commit(self, step: int) -> None:
        checkpoint = save_checkpoint(self.layout.root, step, world_size=2)
        self.rank0.emit(Event.CHECKPOINT_COMMIT, ts=round(self.now, 6), step=step,
                        checkpoint_id=checkpoint.name, save_s=0.4)

    def inject(self, kind: str, step: int, rank: int = 1) -> None:
        self.fault_ts = self.now
        self.emit(self.rank0 if rank == 0 else self.rank0.bind(rank=1, pid=self.rank0.context["pid"] + 1),
                  Event.FAULT_INJECTED, kind=kind, step=step)

    def detect(self, layer: str, step: int, after: float = 0.01) -> None:
        self.emit(self.rank0.bind(rank=1, pid=self.rank0.context["pid"] + 1), Event.FAULT_DETECTED, after=after,
                  layer=layer, kind="RuntimeError", step=step, error="peer gone | see logs", repeated=False)

    def restart_inprocess(self, detect_s: float, restore_s: float, start_step: int) -> None:
        # Same PIDs, next Wrapper iteration; rank 0 logs restart_begin, then both ranks restore.
        self.emit(self.rank0, Event.RESTART_BEGIN, after=detect_s, layer="inprocess", reason="timeout")
        self.iteration += 1
        pids = [self.rank0.context["pid"], self.rank0.context["pid"] + 1]
        workers = [self.log.bind(pid=pid, rank=rank, node_rank=0, attempt=self.attempt, iteration=self.iteration)
                   for rank, pid in enumerate(pids)]
        self.rank0 = workers[0]
        self.now += restore_s
        self.begin_training(start_step, workers)

    def restart_injob(self, down_s: float, start_step: int, layer: str = "injob") -> None:
        # New processes: train_begin first, then rank 0 finds out it is recovering.
        self.attempt += 1 if layer == "injob" else 0
        self.iteration = 0
        self.now += down_s
        self.begin_training(start_step)
        self.emit(self.rank0, Event.RESTART_BEGIN, layer=layer, reason=f"{layer}: started again",
                  fault_ts=self.fault_ts)

    def final(self, failure_class: str = "success", exit_code: int = 0, after: float = 1.5) -> None:
        launcher = self.log.bind(pid=1, node_rank=0, role="launcher", launch_id=self.launch_id)
        if failure_class == "success":
            self.emit(self.rank0, Event.TRAIN_END, step=STEPS, status="completed")
        self.emit(launcher, Event.FINAL, after=after, failure_class=failure_class, exit_code=exit_code,
                  step=STEPS, message=f"ended {failure_class}")

    def evaluate(self) -> None:
        evaluation = {"checkpoint_id": f"step_{STEPS:08d}", "step": STEPS, "val_loss": 2.5, "perplexity": 12.18}
        (self.layout.eval_result).write_text(json.dumps(evaluation))
        self.emit(self.log.bind(role="evaluate"), Event.EVAL, after=5.0, **evaluation)


# -- scenarios --------------------------------------------------------------------------------


def clean_run(run_dir: Path) -> SimulatedRun:
    run = SimulatedRun(run_dir, "clean-run")
    run.launch(startup_s=4.0)
    run.train(1, STEPS)
    run.final()
    run.evaluate()
    return run


def inprocess_run(run_dir: Path) -> SimulatedRun:
    """An exception in rank 1 at step 13: in-process restart from step 10, replays 11 and 12."""
    run = SimulatedRun(run_dir, "inprocess-run")
    run.launch(startup_s=4.0)
    run.train(1, 12)
    run.inject("exception", 13)
    run.detect("inprocess", 13)
    run.restart_inprocess(detect_s=3.0, restore_s=0.5, start_step=10)
    run.train(11, STEPS, resumed_layer="inprocess")
    run.final()
    return run


def injob_run(run_dir: Path) -> SimulatedRun:
    """SIGKILL of rank 0 at step 13: ft_launcher starts new processes, which resume from step 10."""
    run = SimulatedRun(run_dir, "injob-run")
    run.launch(startup_s=4.0)
    run.train(1, 12)
    run.inject("sigkill", 13, rank=0)
    run.detect("inprocess", 13, after=0.05)
    run.restart_injob(down_s=12.0, start_step=10)
    run.train(11, STEPS, resumed_layer="injob")
    run.final()
    return run


def relaunch_run(run_dir: Path) -> SimulatedRun:
    """In-job restarts exhausted at step 13; the control plane escalates and relaunches."""
    run = SimulatedRun(run_dir, "relaunch-run")
    run.launch(startup_s=4.0, launch_id="launch-1")
    run.train(1, 12)
    run.inject("sigkill", 13, rank=0)
    run.final("restarts_exhausted", 75, after=2.0)
    control_plane = run.log.bind(pid=7, role="control-plane")
    run.emit(control_plane, Event.ESCALATION, after=3.0, rung=1, from_launch="launch-1", to_launch="launch-2",
             failure_class="restarts_exhausted", nodes=["node-a"], reason="restarts exhausted: replace node-a")
    run.now += 20.0  # node replacement
    run.launch(startup_s=6.0, launch_id="launch-2", start_step=10)
    run.emit(run.rank0, Event.RESTART_BEGIN, layer="relaunch", reason="relaunch: started again", fault_ts=run.fault_ts)
    run.train(11, STEPS, resumed_layer="relaunch")
    run.final()
    return run


def spare_run(run_dir: Path) -> SimulatedRun:
    """Hot spares: node-b (node 1) is lost at step 13; the spare node-c takes its place at the
    in-job restart (spare_promoted), and the control plane quarantines node-b and adds node-d as
    a new spare while training goes on (spare_added; its launcher logs a standby launch_begin)."""
    run = SimulatedRun(run_dir, "spare-run")
    run.launch(startup_s=4.0, launch_id="0")
    run.train(1, 12)
    run.inject("node_loss", 13, rank=1)
    run.detect("injob", 13, after=0.05)
    run.restart_injob(down_s=6.0, start_step=10)
    run.emit(run.rank0, Event.SPARE_PROMOTED, node_id="node-c", node_rank=2, replaces=["node-b"],
             replaced_node_ranks=[1], members=["node-a", "node-c"], previous_attempt=0, launch_id="0")
    run.train(11, 14, resumed_layer="injob")
    run.emit(run.log.bind(pid=7, role="control-plane"), Event.SPARE_ADDED, launch_id="0", lost_node_id="node-b",
             lost_node_rank=1, quarantined=["node-b"], node_id="node-d", node_rank=3,
             reason="launch 0: node 1 lost while training went on")
    run.emit(run.log.bind(pid=8, node_rank=3, node_id="node-d", role="launcher", launch_id="0"), Event.LAUNCH_BEGIN,
             nodes=2, spare_nodes=1, procs_per_node=1, restart_mode="injob", command="ft", standby=True)
    run.train(15, STEPS)
    run.final()
    return run


SCENARIOS = {"clean": clean_run, "inprocess": inprocess_run, "injob": injob_run, "relaunch": relaunch_run,
             "spare": spare_run}


def assert_adds_up(accounting: dict) -> None:
    parts = accounting["productive_s"] + sum(accounting["badput_s"].values())
    assert parts == pytest.approx(accounting["wall_s"], abs=1e-6)
    assert all(seconds >= 0 for seconds in accounting["badput_s"].values())
    assert 0 < accounting["ettr"] <= 1


# -- goodput ----------------------------------------------------------------------------------


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


# -- report -----------------------------------------------------------------------------------


def assert_report_files(paths: ReportPaths) -> str:
    assert paths.markdown.is_file()
    for png in paths.pngs:
        data = png.read_bytes()
        assert data.startswith(PNG_MAGIC), png
        assert len(data) > 8_000, f"{png} is suspiciously small ({len(data)} bytes)"
    assert set(paths.to_dict()) == {"markdown", "loss_png", "timeline_png", "goodput_png"}
    json.dumps(paths.to_dict())
    text = paths.markdown.read_text()
    for png in paths.pngs:
        assert f"]({png.name})" in text  # embedded with a relative link
    return text


def test_report_of_a_clean_run(tmp_path):
    run = clean_run(tmp_path / "clean")
    paths = build_report(run.layout.root)
    assert paths.markdown == run.layout.root / "report" / "report.md"
    text = assert_report_files(paths)
    assert text.startswith("# Run report: clean-run")
    assert "`success`" in text
    assert f"{STEPS} / {STEPS}" in text
    assert f"{loss_at(STEPS):.4f}" in text  # final loss
    assert "2.5000, perplexity 12.18" in text  # eval.json
    assert f"step_{STEPS:08d} (step {STEPS})" in text  # newest committed checkpoint
    assert "No restarts." in text and "## Escalations" not in text


def test_report_names_the_restart_layers_and_the_escalation(tmp_path):
    texts = {}
    for scenario in ("inprocess", "injob", "relaunch"):
        run = SCENARIOS[scenario](tmp_path / scenario)
        texts[scenario] = assert_report_files(build_report(run.layout.root))
    assert "| inprocess | 1 | 4.5 |" in texts["inprocess"]
    assert "| injob | 1 |" in texts["injob"]
    relaunch = texts["relaunch"]
    assert "| relaunch | 1 |" in relaunch and "## Escalations" in relaunch
    assert "restarts exhausted: replace node-a" in relaunch and "node-a" in relaunch
    # The final status is the last launch's; the first launch's failure class is in the launches table.
    assert "**Status:** `success`" in relaunch
    assert "restarts_exhausted" in relaunch and "launch-1" in relaunch and "launch-2" in relaunch
    assert "peer gone \\| see logs" in texts["injob"]  # table cells are escaped


def test_report_shows_which_node_left_which_spare_joined_and_the_refill(tmp_path):
    run = spare_run(tmp_path / "spare")
    text = assert_report_files(build_report(run.layout.root))
    assert "| spares promoted / added | 1 / 1 |" in text
    assert "## Hot spares" in text and "## Escalations" not in text
    rows = [line for line in text.splitlines() if "| spare promoted |" in line or "| spare added |" in line]
    assert len(rows) == 2, rows
    promoted, added = rows
    assert "| node-b |" in promoted and "node-c (node 2)" in promoted and "attempt 1" in promoted
    assert "node-b (node 1); out of service" in added and "node-d (node 3)" in added
    assert "out of service: node-b" in added
    assert "| injob | 1 |" in text and "## Launches" not in text  # one launch, recovered in-job
    # The spare events change no goodput category: the same accounting without them.
    events = read_events(run.layout.events)
    without = [r for r in events if r["event"] not in ("spare_promoted", "spare_added")
               and not (r["event"] == "launch_begin" and r.get("standby"))]
    assert goodput(events) == goodput(without)
    clean = assert_report_files(build_report(clean_run(tmp_path / "clean").layout.root))
    assert "| spares promoted / added | none |" in clean and "## Hot spares" not in clean


def test_report_of_a_failed_run_states_its_failure_class(tmp_path):
    run = SimulatedRun(tmp_path / "failed", "failed-run")
    run.launch()
    run.train(1, 12)
    run.inject("sigkill", 13, rank=0)
    run.final("restarts_exhausted", 75)
    text = assert_report_files(build_report(run.layout.root))
    assert "**Status:** `restarts_exhausted` (exit code 75)" in text


def test_report_lists_quarantined_skipped_and_stale_checkpoints(tmp_path):
    """A rank found step 20's shard damaged at resume and quarantined it; a torn save was skipped;
    a save repeated the model bytes of the one before. Each shows once, with its reason."""
    run = SimulatedRun(tmp_path / "checkpoints", "bad-checkpoints")
    run.launch()
    run.train(1, STEPS)
    catalog = CheckpointCatalog(run.layout)
    [info] = [c for c in catalog.committed() if c.step == STEPS]
    moved = catalog.quarantine(info, "__1_0.distcp fails its crc32c check", rank=1)
    rank1 = run.rank0.bind(rank=1)
    run.emit(rank1, Event.CHECKPOINT_QUARANTINED, after=0.5, checkpoint_id=info.checkpoint_id, step=STEPS,
             reason="__1_0.distcp fails its crc32c check", moved_to=str(moved))
    for _ in range(2):  # every rank logs the same skip: one row
        run.emit(run.rank0, Event.CHECKPOINT_SKIP, after=0.1, checkpoint_id="step_00000030", step=30,
                 reason="torn: no commit marker")
    run.emit(run.rank0, Event.CHECKPOINT_STALE, after=0.1, checkpoint_id="step_00000010", step=10,
             same_as="step_00000000")
    run.final()
    text = assert_report_files(build_report(run.layout.root))
    assert "## Checkpoints that failed" in text
    assert "| step_00000020 | 20 | rank 1 | __1_0.distcp fails its crc32c check | checkpoints/quarantine/" in text
    assert text.count("torn: no commit marker") == 1
    assert "| step_00000010 | 10 | step_00000000 |" in text
    assert "| checkpoints quarantined / skipped / stale saves | 1 / 1 / 1 |" in text
    # The newest committed checkpoint is the one left, and it passes the size check.
    assert "| newest committed checkpoint | step_00000010 (step 10) |" in text


@pytest.mark.parametrize("failure_class, exit_code, advice", [
    ("storage_error", 74, "free space on it or fix its mount"),
    ("non_finite", 65, "Lower lr (or grad_clip), or check the data"),
])
def test_report_says_what_to_do_after_a_storage_or_non_finite_end(tmp_path, failure_class, exit_code, advice):
    run = SimulatedRun(tmp_path / failure_class, failure_class.replace("_", "-"))
    run.launch()
    run.train(1, 12)
    run.final(failure_class, exit_code)
    text = assert_report_files(build_report(run.layout.root))
    assert f"**Status:** `{failure_class}` (exit code {exit_code})" in text
    assert "**What to do:** " in text and advice in text


def test_report_of_a_run_still_going_or_not_started(tmp_path):
    run = SimulatedRun(tmp_path / "going")
    run.launch()
    run.train(1, 3)
    with open(run.layout.events, "a") as f:
        f.write('{"ts": 1800000099.0, "event": "st')  # torn last line
    text = assert_report_files(build_report(run.layout.root))
    assert "running (no `final` record yet)" in text
    # An empty run dir (the launch has not written anything yet) still gets a report.
    empty = tmp_path / "empty"
    empty.mkdir()
    paths = build_report(empty)
    assert paths.markdown.is_file() and all(p.read_bytes().startswith(PNG_MAGIC) for p in paths.pngs)


def test_records_missing_optional_fields_do_not_break_the_report(tmp_path):
    log = EventLog(tmp_path / "events.jsonl", run_id="sparse-fields")
    log.emit(Event.LAUNCH_BEGIN, ts=T0)
    log.emit(Event.TRAIN_BEGIN, ts=T0 + 1)
    log.emit(Event.STEP, ts=T0 + 2, step=1)  # no loss, no step_s
    log.emit(Event.STEP, ts=T0 + 3, step="two", loss=None)
    log.emit(Event.CHECKPOINT_BEGIN, ts=T0 + 3.5)
    log.emit(Event.FAULT_INJECTED, ts=T0 + 4)
    log.emit(Event.RESTART_END, ts=T0 + 5, latency_s="slow")
    log.emit(Event.ESCALATION, ts=T0 + 6)
    log.emit(Event.FINAL, ts=T0 + 7)
    (tmp_path / "eval.json").write_text("{not json")
    text = assert_report_files(build_report(tmp_path))
    assert "## Escalations" in text and "unknown" in text


def test_cli_prints_the_report_path(tmp_path):
    run = inprocess_run(tmp_path / "cli")
    done = subprocess.run([sys.executable, "-m", "fsdp_resilience.control.report", str(run.layout.root)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(run.layout.root / "report" / "report.md")
    missing = subprocess.run([sys.executable, "-m", "fsdp_resilience.control.report", str(tmp_path / "nope")],
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "does not exist" in missing.stderr


def test_import_needs_neither_torch_nor_matplotlib():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import fsdp_resilience.control.report\n"
            "assert 'matplotlib' not in sys.modules, 'matplotlib is imported eagerly'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


# -- a real run, when a demo left one -----------------------------------------------------------


def _real_runs() -> list[Path]:
    return sorted(p.parent for p in (REPO / "runs").glob("*/events.jsonl")
                  if any(r.get("event") == Event.STEP.value for r in read_events(p)))


@pytest.mark.skipif(not _real_runs(), reason="no real run under runs/ (make demo writes one)")
def test_report_of_a_real_run(tmp_path):
    source = _real_runs()[-1]
    # Work on a copy (events, config, eval, commit markers): the test must not write into runs/.
    run_dir = tmp_path / source.name
    run_dir.mkdir()
    for name in ("events.jsonl", "run.json", "eval.json"):
        if (source / name).is_file():
            shutil.copy2(source / name, run_dir / name)
    for marker in (source / "checkpoints").glob(f"*/{COMMIT_MARKER}"):
        (run_dir / "checkpoints" / marker.parent.name).mkdir(parents=True)
        shutil.copy2(marker, run_dir / "checkpoints" / marker.parent.name / COMMIT_MARKER)

    events = read_events(run_dir / "events.jsonl")
    accounting = goodput(events)
    assert_adds_up(accounting)
    assert accounting["steps_completed"] == len({r["step"] for r in events if r.get("event") == Event.STEP.value})
    text = assert_report_files(build_report(run_dir))
    for layer in {r["layer"] for r in accounting["restarts"]}:
        assert f"| {layer} |" in text
