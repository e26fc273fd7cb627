"""The report's Markdown (``report.markdown``), built from simulated runs: status, summary, restarts,
escalations, spares, failed checkpoints, what to do, and records with fields missing."""

from __future__ import annotations

import pytest

from fsdp_resilience.control.report.build import build_report
from fsdp_resilience.control.report.goodput import goodput
from fsdp_resilience.training.contract import CheckpointCatalog, Event, EventLog, read_events

from control.fakes.simulated_run import (
    SCENARIOS,
    STEPS,
    T0,
    SimulatedRun,
    clean_run,
    loss_at,
    spare_run,
)
from control.support.report_checks import assert_report_files


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
    without = [
        r
        for r in events
        if r["event"] not in ("spare_promoted", "spare_added")
        and not (r["event"] == "launch_begin" and r.get("standby"))
    ]
    assert goodput(events) == goodput(without)
    clean = assert_report_files(build_report(clean_run(tmp_path / "clean").layout.root))
    assert "| spares promoted / added | none |" in clean and "## Hot spares" not in clean


def test_report_shows_the_wait_for_nodes_and_when_nothing_was_coming(tmp_path):
    run = SimulatedRun(tmp_path / "waiting", "waiting-run")
    run.launch(launch_id="1")
    run.train(1, 12)
    run.inject("node_loss", 13, rank=1)
    launcher = run.log.bind(pid=1, node_rank=0, role="launcher", launch_id="1")
    coming = run.emit(
        launcher,
        Event.WAITING_FOR_NODES,
        after=18.0,
        missing=1,
        nodes=["node-b"],
        missing_node_ranks=[1],
        until=run.now + 18.0 + 60.0,
        why="a replacement is coming: the pool keeper is adding a spare for node 1 (node-b)",
    )
    run.emit(
        launcher,
        Event.WAITING_FOR_NODES,
        after=61.0,
        missing=1,
        nodes=["node-b"],
        missing_node_ranks=[1],
        until=None,
        why="no replacement is coming: the pool keeper is adding a spare (its deadline passed)",
    )
    run.final("restarts_exhausted", 75)
    text = assert_report_files(build_report(run.layout.root))
    assert "## Hot spares" in text
    [waiting] = [line for line in text.splitlines() if "| waiting for nodes |" in line]
    assert "| node-b |" in waiting and f"waits until t={coming['until'] - T0:.1f} s" in waiting
    [ended] = [line for line in text.splitlines() if "| no spare left |" in line]
    assert "its deadline passed" in ended


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
    run.emit(
        rank1,
        Event.CHECKPOINT_QUARANTINED,
        after=0.5,
        checkpoint_id=info.checkpoint_id,
        step=STEPS,
        reason="__1_0.distcp fails its crc32c check",
        moved_to=str(moved),
    )
    for _ in range(2):  # every rank logs the same skip: one row
        run.emit(
            run.rank0,
            Event.CHECKPOINT_SKIP,
            after=0.1,
            checkpoint_id="step_00000030",
            step=30,
            reason="torn: no commit marker",
        )
    run.emit(
        run.rank0, Event.CHECKPOINT_STALE, after=0.1, checkpoint_id="step_00000010", step=10, same_as="step_00000000"
    )
    run.final()
    text = assert_report_files(build_report(run.layout.root))
    assert "## Checkpoints that failed" in text
    assert "| step_00000020 | 20 | rank 1 | __1_0.distcp fails its crc32c check | checkpoints/quarantine/" in text
    assert text.count("torn: no commit marker") == 1
    assert "| step_00000010 | 10 | step_00000000 |" in text
    assert "| checkpoints quarantined / skipped / stale saves | 1 / 1 / 1 |" in text
    # The newest committed checkpoint is the one left, and it passes the size check.
    assert "| newest committed checkpoint | step_00000010 (step 10) |" in text


@pytest.mark.parametrize(
    "failure_class, exit_code, advice",
    [
        ("storage_error", 74, "free space on it or fix its mount"),
        ("non_finite", 65, "Lower lr (or grad_clip), or check the data"),
    ],
)
def test_report_says_what_to_do_after_a_storage_or_non_finite_end(tmp_path, failure_class, exit_code, advice):
    run = SimulatedRun(tmp_path / failure_class, failure_class.replace("_", "-"))
    run.launch()
    run.train(1, 12)
    run.final(failure_class, exit_code)
    text = assert_report_files(build_report(run.layout.root))
    assert f"**Status:** `{failure_class}` (exit code {exit_code})" in text
    assert "**What to do:** " in text and advice in text


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


def test_report_shows_the_evidence_per_blamed_node_and_the_failed_health_checks(tmp_path):
    run = SimulatedRun(tmp_path / "blamed", "blamed-run")
    run.launch(startup_s=4.0)
    run.train(1, 5)
    run.emit(
        run.log.bind(node_id="node-b"),
        Event.HEALTH_CHECK_FAILED,
        after=1.0,
        check="gpu",
        source="inprocess_wrapper",
        message="GPU health check failed",
        nvrx_version="0.7.0",
    )
    run.emit(
        run.log.bind(role="control-plane"),
        Event.ESCALATION,
        after=1.0,
        rung=1,
        from_launch="0",
        to_launch="1",
        failure_class="user_error",
        nodes=["node-b"],
        reason="status: ...; node node-b: ...",
        signals={
            "node-b": ["AcceleratedHardwareReady=False (NvidiaXID79: off the bus)", "NVRx gpu health check failed"]
        },
    )
    text = assert_report_files(build_report(run.layout.root))
    assert "## Failed health checks" in text
    assert "| node-b | gpu | inprocess_wrapper | 0.7.0 | GPU health check failed |" in text
    assert "node-b: AcceleratedHardwareReady=False (NvidiaXID79: off the bus); NVRx gpu health check failed" in text
