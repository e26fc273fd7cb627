"""Build a run's report: ``report.md`` and three figures in ``<run_dir>/report/``, from the run dir
alone (a run still going included)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from fsdp_resilience.control.report.figures import plot_goodput, plot_loss, plot_timeline
from fsdp_resilience.control.report.goodput import goodput
from fsdp_resilience.control.report.markdown import render_markdown
from fsdp_resilience.control.report.records import read_json_object, step_executions
from fsdp_resilience.training.contract import Event, RunDir, read_events

REPORT_DIRNAME = "report"


@dataclass(frozen=True)
class ReportPaths:
    """Where ``build_report`` wrote the report (all inside ``<run_dir>/report/``)."""

    markdown: Path
    loss_png: Path
    timeline_png: Path
    goodput_png: Path

    @property
    def pngs(self) -> tuple[Path, Path, Path]:
        return self.loss_png, self.timeline_png, self.goodput_png

    def to_dict(self) -> dict[str, str]:
        """Plain strings, for XCom."""
        return {
            "markdown": str(self.markdown),
            "loss_png": str(self.loss_png),
            "timeline_png": str(self.timeline_png),
            "goodput_png": str(self.goodput_png),
        }


def build_report(run_dir: str | os.PathLike) -> ReportPaths:
    """Write ``report.md``, ``loss.png``, ``timeline.png`` and ``goodput.png`` into
    ``<run_dir>/report/`` from what the run dir holds now (a run still going, without an
    evaluation or without any events yet included), and return their paths."""
    layout = RunDir(run_dir)
    out = layout.root / REPORT_DIRNAME
    out.mkdir(parents=True, exist_ok=True)
    paths = ReportPaths(out / "report.md", out / "loss.png", out / "timeline.png", out / "goodput.png")

    events = read_events(layout.events)
    accounting = goodput(events)
    executions = step_executions([r for r in events if r.get("event") != Event.EVAL.value])
    evaluation = read_json_object(layout.eval_result) or next(
        (r for r in reversed(events) if r.get("event") == Event.EVAL.value), None
    )

    plot_loss(paths.loss_png, executions, evaluation)
    plot_timeline(paths.timeline_png, events, executions, accounting)
    plot_goodput(paths.goodput_png, accounting)
    markdown = render_markdown(layout, events, accounting, executions, evaluation, paths)
    _replace_atomically(paths.markdown, markdown.encode())
    return paths


def _replace_atomically(path: Path, data: bytes) -> None:
    # A reader (the Airflow UI, a human) sees the old report or the new one, never half of one.
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)
