"""Building a report (``report.build``) of a run still going, of none yet, of a real run a demo left;
and the CLI, ``python -m fsdp_resilience.control.report RUN_DIR``."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_resilience.control.report.build import build_report
from fsdp_resilience.control.report.goodput import goodput
from fsdp_resilience.training.contract import COMMIT_MARKER, Event, read_events

from control.fakes.simulated_run import SimulatedRun, inprocess_run
from control.support.report_checks import PNG_MAGIC, assert_adds_up, assert_report_files

REPO = Path(__file__).resolve().parents[3]


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


def test_cli_prints_the_report_path(tmp_path):
    run = inprocess_run(tmp_path / "cli")
    done = subprocess.run(
        [sys.executable, "-m", "fsdp_resilience.control.report", str(run.layout.root)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(run.layout.root / "report" / "report.md")
    missing = subprocess.run(
        [sys.executable, "-m", "fsdp_resilience.control.report", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert missing.returncode == 2 and "does not exist" in missing.stderr


# -- a real run, when a demo left one -----------------------------------------------------------


def _real_runs() -> list[Path]:
    return sorted(
        p.parent
        for p in (REPO / "runs").glob("*/events.jsonl")
        if any(r.get("event") == Event.STEP.value for r in read_events(p))
    )


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
