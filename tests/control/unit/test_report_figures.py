"""The report's figures (``report.figures``): each one drawn for every simulated scenario and for a
run with nothing logged yet; matplotlib (and torch) stay unimported until a figure is drawn."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fsdp_resilience.control.report.figures import plot_goodput, plot_loss, plot_timeline
from fsdp_resilience.control.report.goodput import goodput
from fsdp_resilience.control.report.records import step_executions
from fsdp_resilience.training.contract import read_events

from control.fakes.simulated_run import SCENARIOS
from control.support.report_checks import PNG_MAGIC


def assert_png(path) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC), path
    assert len(data) > 8_000, f"{path} is suspiciously small ({len(data)} bytes)"


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_each_figure_is_drawn_for_each_scenario(tmp_path, scenario):
    run = SCENARIOS[scenario](tmp_path / scenario)
    events = read_events(run.layout.events)
    executions = step_executions(events)
    accounting = goodput(events)
    plot_loss(tmp_path / "loss.png", executions, {"step": 20, "val_loss": 2.5})
    plot_timeline(tmp_path / "timeline.png", events, executions, accounting)
    plot_goodput(tmp_path / "goodput.png", accounting)
    for name in ("loss.png", "timeline.png", "goodput.png"):
        assert_png(tmp_path / name)
    assert not list(tmp_path.glob(".*.tmp.*"))  # written atomically: no temporary file left behind


def test_figures_of_a_run_with_nothing_logged_say_so(tmp_path):
    accounting = goodput([])
    plot_loss(tmp_path / "loss.png", [], None)
    plot_timeline(tmp_path / "timeline.png", [], [], accounting)
    plot_goodput(tmp_path / "goodput.png", accounting)
    for name in ("loss.png", "timeline.png", "goodput.png"):
        assert (tmp_path / name).read_bytes().startswith(PNG_MAGIC)


def test_import_needs_neither_torch_nor_matplotlib():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import fsdp_resilience.control.report.build\n"
        "import fsdp_resilience.control.report.figures\n"
        "assert 'matplotlib' not in sys.modules, 'matplotlib is imported eagerly'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
