"""Run reports: where a run's wall time went (goodput), a Markdown summary and three figures.

Everything is computed from the run dir alone — the events log, ``run.json``, ``eval.json`` and the
checkpoint commit markers — so a report can be built by an Airflow task, by hand on a laptop, or
while the run is still going. The module is torch-free; matplotlib is imported only when figures
are drawn, so importing it (e.g. while the DAG processor parses a DAG) stays cheap.

Usage::

    python -m fsdp_resilience.control.report RUN_DIR     # prints the path of RUN_DIR/report/report.md
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable

from fsdp_resilience.training.contract import (
    CheckpointCatalog,
    Event,
    RunDir,
    WHAT_TO_DO,
    final_status,
    read_events,
    verify_checkpoint,
)



#: Restart layers, innermost first (the order of ``Event.RESTART_BEGIN``'s ``layer`` values).
RESTART_LAYERS = ("inprocess", "injob", "relaunch")
#: Written by the control plane when it replaces nodes and relaunches.
ESCALATION = Event.ESCALATION.value
#: Hot spares: a spare took a lost node's place (rank 0), and the control plane refilled the pool.
SPARE_PROMOTED, SPARE_ADDED = Event.SPARE_PROMOTED.value, Event.SPARE_ADDED.value
REPORT_DIRNAME = "report"

PRODUCTIVE = "productive"
CHECKPOINT_BLOCKING = "checkpoint_blocking"
CHECKPOINT_INTERFERENCE = "checkpoint_interference"
STARTUP_RESTORE = "startup_restore"
LOST_PROGRESS = "lost_progress"
OTHER = "other"

#: Which category an instant covered by several intervals belongs to: the first one listed.
#: Measured intervals (checkpoint stalls, step executions) win over the windows that contain them.
_PRIORITY = (CHECKPOINT_BLOCKING, CHECKPOINT_INTERFERENCE, PRODUCTIVE, LOST_PROGRESS, STARTUP_RESTORE,
             *(f"restart_{layer}" for layer in RESTART_LAYERS))

_LAYER_COLORS = {"inprocess": "tab:orange", "injob": "tab:red", "relaunch": "tab:purple"}
_CATEGORY_COLORS = {
    PRODUCTIVE: "tab:green",
    CHECKPOINT_BLOCKING: "tab:blue",
    CHECKPOINT_INTERFERENCE: "tab:pink",
    STARTUP_RESTORE: "tab:cyan",
    LOST_PROGRESS: "tab:brown",
    **{f"restart_{layer}": color for layer, color in _LAYER_COLORS.items()},
    OTHER: "tab:gray",
}


# --------------------------------------------------------------------------------------------
# Reading records defensively: a partial or older log must never make the report fail
# --------------------------------------------------------------------------------------------


def _num(record: dict[str, Any], key: str) -> float | None:
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _int(record: dict[str, Any], key: str) -> int | None:
    value = _num(record, key)
    return int(value) if value is not None else None


def _timed(events: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Records with a usable ``ts``, oldest first (stable: equal stamps keep log order)."""
    return sorted((r for r in events if isinstance(r, dict) and _num(r, "ts") is not None),
                  key=lambda r: r["ts"])


# --------------------------------------------------------------------------------------------
# Goodput
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepExecution:
    """One execution of one training step, in wall-clock seconds (unix time)."""

    step: int
    start: float
    end: float
    loss: float | None
    segment: tuple[Any, Any]  # (pid, iteration): one uninterrupted stretch of training
    replayed: bool = False  # the step ran again later, after a restart


def step_executions(events: Iterable[dict[str, Any]]) -> list[StepExecution]:
    """Every step execution in the log, oldest first, with ``replayed`` set on all but the last
    execution of each step.

    A ``step`` record covers ``[ts - step_s, ts]``. With ``log_interval > 1`` the steps between two
    records of the same process are not logged; they get an equal share of the time between the
    previous record (or the ``train_begin`` they resumed from) and this one.
    """
    runs: list[StepExecution] = []
    # Where each training process last was: (step, ts), per (pid, in-process iteration).
    position: dict[tuple[Any, Any], tuple[int, float]] = {}
    for record in _timed(events):
        kind, ts = record.get("event"), record["ts"]
        segment = (record.get("pid"), record.get("iteration"))
        if kind == Event.TRAIN_BEGIN.value:
            start_step = _int(record, "start_step")
            if start_step is not None:
                position[segment] = (start_step, ts)
            continue
        step = _int(record, "step")
        if kind != Event.STEP.value or step is None:
            continue
        loss, step_s = _num(record, "loss"), _num(record, "step_s")
        previous = position.get(segment)
        position[segment] = (step, ts)
        if previous is not None and step - previous[0] > 1 and previous[1] < ts:
            first, since = previous[0] + 1, previous[1]
            share = (ts - since) / (step - first + 1)
            for i, s in enumerate(range(first, step + 1)):
                runs.append(StepExecution(s, since + i * share, since + (i + 1) * share,
                                          loss if s == step else None, segment))
        else:
            runs.append(StepExecution(step, ts - max(step_s or 0.0, 0.0), ts, loss, segment))
    last_end: dict[int, float] = {}
    for run in runs:
        last_end[run.step] = max(run.end, last_end.get(run.step, run.end))
    return [dataclasses.replace(run, replayed=True) if run.end < last_end[run.step] else run for run in runs]


def save_windows(events: Iterable[dict[str, Any]]) -> list[tuple[float, float]]:
    """``(begin, committed)`` of each save that committed: from its ``checkpoint_begin`` to its
    ``checkpoint_commit`` (same launch, launcher attempt and step), the time its background writer
    shared the machine with the training loop. A save that never committed has no end to take."""
    begins: dict[tuple[Any, Any, int], float] = {}
    windows = []
    for record in _timed(events):
        kind, step = record.get("event"), _int(record, "step")
        if step is None:
            continue
        key = (record.get("launch_id"), record.get("attempt"), step)
        if kind == Event.CHECKPOINT_BEGIN.value:
            begins[key] = record["ts"]
        elif kind == Event.CHECKPOINT_COMMIT.value and key in begins:
            windows.append((begins.pop(key), record["ts"]))
    return windows


def steps_during_saves(executions: list[StepExecution], windows: list[tuple[float, float]]
                        ) -> tuple[float | None, list[StepExecution]]:
    """The usual step time (median of the last executions that overlap no save window) and the
    last executions that overlap one."""
    slowed, others = [], []
    for run in executions:
        if not run.replayed:
            if any(run.start < hi and lo < run.end for lo, hi in windows):
                slowed.append(run)
            else:
                others.append(run.end - run.start)
    others.sort()
    if not others:
        return None, slowed
    mid = len(others) // 2
    usual = others[mid] if len(others) % 2 else (others[mid - 1] + others[mid]) / 2
    return usual, slowed


def _startup_spans(timed: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """From each launcher start (``launch_begin``) or in-process restart (``restart_begin``) to
    the ``train_begin`` it led to: process start, process-group init, model build, restore.

    A ``restart_begin`` pairs only with a later ``train_begin`` of the same process: in-job and
    relaunch records are written by the new process after its ``train_begin``, so they have none.
    A step in between means the marker led to no start.
    """
    spans = []
    for i, marker in enumerate(timed):
        kind = marker.get("event")
        if kind not in (Event.LAUNCH_BEGIN.value, Event.RESTART_BEGIN.value):
            continue
        for later in timed[i + 1:]:
            if later.get("event") == Event.STEP.value:
                break
            if later.get("event") == Event.TRAIN_BEGIN.value and (
                    kind == Event.LAUNCH_BEGIN.value or later.get("pid") == marker.get("pid")):
                spans.append((marker["ts"], later["ts"]))
                break
    return spans


def _attribute(intervals: list[tuple[float, float, str]], start: float, end: float) -> dict[str, float]:
    """Seconds of ``[start, end]`` per category; an instant covered by several intervals goes to
    the category listed first in ``_PRIORITY``, an instant covered by none to ``other``."""
    rank = {c: i for i, c in enumerate(_PRIORITY)}
    boundaries: list[tuple[float, int, str]] = []
    for lo, hi, category in intervals:
        lo, hi = max(lo, start), min(hi, end)
        if hi > lo:
            rank.setdefault(category, len(rank))  # an unknown restart layer ranks last
            boundaries += [(lo, +1, category), (hi, -1, category)]
    boundaries.sort(key=lambda b: b[0])
    totals: dict[str, float] = defaultdict(float)
    active: dict[str, int] = defaultdict(int)
    cursor = start
    for ts, delta, category in boundaries:
        if ts > cursor:
            covering = [c for c, n in active.items() if n > 0]
            totals[min(covering, key=rank.__getitem__) if covering else OTHER] += ts - cursor
            cursor = ts
        active[category] += delta
    totals[OTHER] += max(end - cursor, 0.0)
    return totals


def goodput(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Where the wall time of a run (all its launches) went, from its events log.

    Definitions (all times are event timestamps, seconds):

    - **wall**: from the first ``launch_begin`` (else the first record) to the last record other
      than ``eval`` — for a finished run its last ``final`` / ``train_end``, for a run still going
      its newest record.
    - Every instant of the wall time is put in exactly one category, so the categories add up to
      wall time. Where intervals overlap, the first category listed here wins:

      1. ``checkpoint_blocking``: the training loop stopped for a save,
         ``[ts - blocking_s, ts]`` of each ``checkpoint_begin``.
      2. ``checkpoint_interference``: how much longer than usual a step took while a save was
         being written in the background (``save_windows``: ``checkpoint_begin`` → its
         ``checkpoint_commit``) — the writer shares the machine with the training loop. For each
         last execution of a step that overlaps a save window, the part beyond the usual step time
         (the median of the steps that overlap none, ``usual_step_s``).
      3. ``productive``: the *last* execution of each step, ``[ts - step_s, ts]`` of its ``step``
         record (so a step replayed after a restart counts once).
      4. ``lost_progress``: every earlier execution of a step that was executed again later —
         work a restart threw away.
      5. ``startup_restore``: from a ``launch_begin`` (or an in-process ``restart_begin``) to the
         ``train_begin`` it led to: starting processes, building the model, loading the checkpoint.
      6. ``restart_<layer>`` (``inprocess``, ``injob``, ``relaunch``): the rest of each recovery
         window ``[ts - latency_s, ts]`` of a ``restart_end`` (fault → training resumed) — fault
         detection, teardown, and for in-job restarts (which log no process start) the start-up
         of the new processes too.
      7. ``other``: everything else — launcher shutdown, time before a fault that was never
         recovered, steps not logged before a crash, loop overhead between steps.

    - **ETTR** (effective training time ratio) = productive / wall (None while wall is 0).

    A step's last execution is provisional while the run goes on: a later restart may replay it.

    Returns a JSON-serialisable dict: ``wall_s``, ``productive_s``, ``ettr``, ``badput_s`` (every
    category but productive, seconds), ``usual_step_s`` (None without a step outside a save),
    ``steps_during_saves``, ``start_ts``, ``end_ts``, ``steps_completed`` (distinct
    steps executed), ``last_step``, ``step_executions``, ``replayed_steps`` (step numbers run more
    than once) and ``restarts`` (one ``{layer, latency_s, step, ts}`` per ``restart_end``).
    """
    timed = _timed(events)
    training = [r for r in timed if r.get("event") != Event.EVAL.value]
    launches = [r["ts"] for r in training if r.get("event") == Event.LAUNCH_BEGIN.value]
    start = min(launches) if launches else (training[0]["ts"] if training else 0.0)
    end = max(training[-1]["ts"], start) if training else start
    wall = end - start

    executions = step_executions(training)
    intervals: list[tuple[float, float, str]] = [
        (run.start, run.end, LOST_PROGRESS if run.replayed else PRODUCTIVE) for run in executions]
    intervals += [(lo, hi, STARTUP_RESTORE) for lo, hi in _startup_spans(training)]
    windows = save_windows(training)
    usual, slowed = steps_during_saves(executions, windows)
    intervals += [(run.start + usual, run.end, CHECKPOINT_INTERFERENCE)
                  for run in slowed if usual is not None and run.end - run.start > usual]
    restarts = []
    for record in training:
        kind, ts = record.get("event"), record["ts"]
        if kind == Event.CHECKPOINT_BEGIN.value and (blocking := _num(record, "blocking_s")):
            intervals.append((ts - blocking, ts, CHECKPOINT_BLOCKING))
        elif kind == Event.RESTART_END.value:
            layer = str(record.get("layer") or "unknown")
            latency = _num(record, "latency_s")
            restarts.append({"layer": layer, "latency_s": latency, "step": _int(record, "step"), "ts": ts})
            if latency:
                intervals.append((ts - latency, ts, f"restart_{layer}"))

    totals = _attribute(intervals, start, end)
    productive = totals.pop(PRODUCTIVE, 0.0)
    totals.pop(OTHER, None)  # recomputed as the remainder: the parts add up to wall exactly
    badput = {c: totals.pop(c, 0.0) for c in _PRIORITY if c != PRODUCTIVE}
    badput.update(totals)  # restart layers outside RESTART_LAYERS, if a newer writer adds one
    badput[OTHER] = max(wall - productive - sum(badput.values()), 0.0)
    steps = {run.step for run in executions}
    return {
        "start_ts": start,
        "end_ts": end,
        "wall_s": wall,
        "productive_s": productive,
        "ettr": productive / wall if wall > 0 else None,
        "badput_s": badput,
        "usual_step_s": usual,
        "steps_during_saves": len(slowed),
        "steps_completed": len(steps),
        "last_step": max(steps, default=None),
        "step_executions": len(executions),
        "replayed_steps": sorted({run.step for run in executions if run.replayed}),
        "restarts": restarts,
    }


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


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
        return {"markdown": str(self.markdown), "loss_png": str(self.loss_png),
                "timeline_png": str(self.timeline_png), "goodput_png": str(self.goodput_png)}


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


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
    evaluation = _read_json(layout.eval_result) or next(
        (r for r in reversed(events) if r.get("event") == Event.EVAL.value), None)

    _plot_loss(paths.loss_png, executions, evaluation)
    _plot_timeline(paths.timeline_png, events, executions, accounting)
    _plot_goodput(paths.goodput_png, accounting)
    markdown = _render_markdown(layout, events, accounting, executions, evaluation, paths)
    _replace_atomically(paths.markdown, markdown.encode())
    return paths


def _replace_atomically(path: Path, data: bytes) -> None:
    # A reader (the Airflow UI, a human) sees the old report or the new one, never half of one.
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


# -- Markdown ---------------------------------------------------------------------------------


def _cell(value: Any) -> str:
    """A table cell: one line, pipes escaped."""
    text = "—" if value is None or value == "" else str(value)
    return " ".join(text.split()).replace("|", "\\|")


def _table(header: Iterable[str], rows: Iterable[Iterable[Any]]) -> list[str]:
    header = list(header)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return lines + [""]


def _seconds(value: float | None) -> str | None:
    return None if value is None else f"{value:.2f}"


def _utc(ts: float | None) -> str | None:
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _category_label(category: str) -> str:
    if category.startswith("restart_"):
        return f"restart ({category.removeprefix('restart_')})"
    return category.replace("_", " ").replace("startup restore", "startup / restore")


def _render_markdown(layout: RunDir, events: list[dict[str, Any]], accounting: dict[str, Any],
                     executions: list[StepExecution], evaluation: dict[str, Any] | None,
                     paths: ReportPaths) -> str:
    config = _read_json(layout.config) or {}
    run_id = config.get("run_id") or next((r["run_id"] for r in events if r.get("run_id")), layout.root.name)
    final = final_status(layout.root)
    start = accounting["start_ts"]

    lines = [f"# Run report: {run_id}", ""]
    if final is None:
        lines += ["**Status:** running (no `final` record yet)", ""]
    else:
        failure_class = final.get("failure_class") or "unknown"
        message = " ".join(str(final.get("message") or "").split())
        lines += [f"**Status:** `{failure_class}` (exit code {final.get('exit_code', '?')})"
                  + (f" — {message}" if message else ""), ""]
        if failure_class in WHAT_TO_DO and failure_class != "unknown":
            lines += [f"**What to do:** {WHAT_TO_DO[failure_class]}.", ""]

    by_kind: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for record in events:
        by_kind[str(record.get("event"))].append(record)
    # The newest kept execution that logged a loss (with log_interval > 1 not every step does).
    last_logged = max((run for run in executions if not run.replayed and run.loss is not None),
                      key=lambda run: run.step, default=None)
    last_step = accounting["last_step"]
    newest = CheckpointCatalog(layout).latest()
    layer_latencies: dict[str, list[float | None]] = defaultdict(list)
    for restart in accounting["restarts"]:
        layer_latencies[restart["layer"]].append(restart["latency_s"])
    escalations = by_kind.get(ESCALATION, [])
    checkpoint_rows = _checkpoint_trouble(layout, events, start)
    launches = _launches(events, start)  # one per launch id, however many nodes it had
    ettr = accounting["ettr"]
    configured = config.get("steps")

    summary = [
        ("steps trained", f"{last_step if last_step is not None else 0}"
                          + (f" / {configured}" if configured else "")),
        ("final loss", last_logged and f"{last_logged.loss:.4f} (step {last_logged.step})"),
        ("eval val_loss", _eval_summary(evaluation)),
        ("newest committed checkpoint", _newest_committed(newest)),
        ("model / world size", _world(config)),
        ("restart mode", config.get("restart_mode")),
        ("launches", len(launches) or None),
        ("restarts", ", ".join(f"{layer}: {len(latencies)}"
                               for layer, latencies in _by_layer_order(layer_latencies)) or "none"),
        ("escalations", len(escalations) or "none"),
        ("spares promoted / added", _spare_counts(by_kind)),
        ("checkpoints quarantined / skipped / stale saves", _checkpoint_counts(checkpoint_rows)),
        ("faults injected / detected", f"{len(by_kind.get(Event.FAULT_INJECTED.value, []))} / "
                                       f"{len(by_kind.get(Event.FAULT_DETECTED.value, []))}"),
        ("wall time", f"{accounting['wall_s']:.1f} s ({_utc(start)} → {_utc(accounting['end_ts'])})"
                      if accounting["wall_s"] > 0 else None),
        ("ETTR (productive / wall)", None if ettr is None else f"{ettr:.3f}"),
    ]
    lines += ["## Summary", ""] + _table(("", ""), summary)

    lines += ["## Restarts", ""]
    if layer_latencies:
        rows = []
        for layer, latencies in _by_layer_order(layer_latencies):
            known = [x for x in latencies if x is not None]
            rows.append((layer, len(latencies), ", ".join(f"{x:.1f}" for x in known),
                         _seconds(sum(known) / len(known)) if known else None, _seconds(max(known, default=None))))
        lines += _table(("layer", "count", "latency each (s)", "mean (s)", "max (s)"), rows)
        lines += ["Latency is `restart_end.latency_s`: from the fault to the first step completed after it.", ""]
    else:
        lines += ["No restarts.", ""]

    faults = [r for r in _timed(events)
              if r.get("event") in (Event.FAULT_INJECTED.value, Event.FAULT_DETECTED.value)]
    if faults:
        lines += ["## Faults", ""] + _table(
            ("t (s)", "event", "step", "rank", "kind", "layer", "class", "error"),
            ((f"{r['ts'] - start:.1f}", r.get("event"), r.get("step"), r.get("rank"), r.get("kind"),
              r.get("layer"), r.get("failure_class"), str(r.get("error") or "")[:120]) for r in faults))

    quarantined, skipped, stale = checkpoint_rows
    if quarantined or skipped or stale:
        lines += ["## Checkpoints that failed", ""]
    if quarantined:
        lines += ["Quarantined: moved to `checkpoints/quarantine/`, never loaded again, never deleted "
                  "(inspect them there; move one back to `checkpoints/` to have it verified again).", ""]
        lines += _table(("t (s)", "checkpoint", "step", "by", "reason", "now at"), quarantined)
    if skipped:
        lines += ["Skipped: passed over, left where it is (torn, or failed a check where it could not be "
                  "moved aside).", ""]
        lines += _table(("t (s)", "checkpoint", "step", "by", "reason"), skipped)
    if stale:
        lines += ["Stale saves: the model bytes equal an earlier checkpoint's although steps advanced (the save "
                  "wrote old state).", ""]
        lines += _table(("t (s)", "checkpoint", "step", "same as"), stale)

    if escalations:
        lines += ["## Escalations", ""] + _table(
            ("t (s)", "rung", "from launch", "to launch", "failure class", "nodes replaced", "reason"),
            ((f"{r['ts'] - start:.1f}" if _num(r, "ts") is not None else None, r.get("rung"),
              r.get("from_launch"), r.get("to_launch"), r.get("failure_class"),
              ", ".join(map(str, r["nodes"])) if isinstance(r.get("nodes"), list) else r.get("nodes"),
              r.get("reason")) for r in escalations))

    spares = _spare_rows(events, start)
    if spares:
        lines += ["## Hot spares", "",
                  "A spare promoted: it took a lost node's place at an in-job restart (no relaunch). A spare "
                  "added: the control plane took the lost node out of service and started a new spare while "
                  "training went on (each one spends one of max_node_replacements).", ""]
        lines += _table(("t (s)", "launch", "event", "node out", "spare in", "detail"), spares)

    if len(launches) > 1 or any(row[3] not in (None, "success") for row in launches):
        lines += ["## Launches", ""] + _table(
            ("launch", "started (s)", "ended (s)", "failure class", "exit code", "message"), launches)

    wall = accounting["wall_s"]
    share = (lambda s: f"{100 * s / wall:.1f} %") if wall > 0 else (lambda s: None)
    goodput_rows = [(PRODUCTIVE.replace("_", " "), _seconds(accounting["productive_s"]),
                     share(accounting["productive_s"]))]
    goodput_rows += [(_category_label(c), _seconds(s), share(s)) for c, s in accounting["badput_s"].items()
                     if s > 0 or not c.startswith("restart_")]  # no empty rows for layers never used
    goodput_rows.append(("**wall**", _seconds(wall), "100 %" if wall > 0 else None))
    replayed = accounting["replayed_steps"]
    lines += ["## Goodput", ""] + _table(("category", "seconds", "share of wall"), goodput_rows)
    lines += [
        "Every second of wall time (first launch → last record before evaluation) is in exactly one "
        "category. Productive: the last execution of each step; lost progress: earlier executions of "
        "steps replayed after a restart"
        + (f" (steps {_ranges(replayed)})" if replayed else "")
        + "; startup / restore: launch or in-process restart → `train_begin`; restart: the rest of "
        "each fault → resumed window; checkpoint blocking: the loop stopped for a save; checkpoint "
        "interference: steps slower than usual while a save was written in the background (the "
        "excess over the median step outside saves). "
        "ETTR = productive / wall.", ""]

    lines += ["## Figures", ""]
    for title, png in (("Loss", paths.loss_png), ("Timeline", paths.timeline_png), ("Goodput", paths.goodput_png)):
        lines += [f"![{title}]({png.relative_to(paths.markdown.parent).as_posix()})", ""]
    return "\n".join(lines)


def _newest_committed(newest: Any) -> str | None:
    """The newest committed checkpoint, and whether it passes the cheap half of verification
    (every file listed with a checksum, present, of its size): the report reads no shard bytes."""
    if newest is None:
        return None
    text = f"{newest.checkpoint_id} (step {newest.step})"
    reason = verify_checkpoint(newest.path, checksum=[])
    return text + (f" — fails verification: {reason}" if reason else "")


def _by(record: dict[str, Any]) -> str:
    """Who found a checkpoint bad: a rank, or the control plane's task."""
    if record.get("role") == "control-plane" or str(record.get("by") or "").startswith("control plane"):
        return f"control plane ({record.get('task')})" if record.get("task") else str(record.get("by") or "control plane")
    if record.get("rank") is not None:
        return f"rank {record['rank']}"
    return str(record.get("by") or record.get("role") or "—")


def _checkpoint_trouble(layout: RunDir, events: list[dict[str, Any]], start: float
                        ) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """Rows for the quarantined checkpoints (the quarantine's records, and quarantine events whose
    folder is no longer there), the skipped ones (each checkpoint and reason once) and stale saves."""
    at = lambda r: f"{r['ts'] - start:.1f}" if _num(r, "ts") is not None else None  # noqa: E731
    quarantined, seen = [], set()
    for record in CheckpointCatalog(layout).quarantined():
        seen.add(Path(record["path"]).name)
        moved_at = _num(record, "quarantined_at")
        quarantined.append((None if moved_at is None else f"{moved_at - start:.1f}", record.get("checkpoint_id"),
                            record.get("step"), _by(record), record.get("reason"),
                            f"checkpoints/quarantine/{Path(record['path']).name}"))
    for r in _timed(events):
        if r.get("event") == Event.CHECKPOINT_QUARANTINED.value and Path(str(r.get("moved_to"))).name not in seen:
            seen.add(Path(str(r.get("moved_to"))).name)
            quarantined.append((at(r), r.get("checkpoint_id"), r.get("step"), _by(r), r.get("reason"),
                                "gone (moved back or deleted)"))
    skipped, reasons = [], set()
    for r in _timed(events):
        key = (r.get("checkpoint_id"), r.get("reason"))
        if r.get("event") == Event.CHECKPOINT_SKIP.value and key not in reasons:
            reasons.add(key)
            skipped.append((at(r), r.get("checkpoint_id"), r.get("step"), _by(r), r.get("reason")))
    stale = [(at(r), r.get("checkpoint_id"), r.get("step"), r.get("same_as"))
             for r in _timed(events) if r.get("event") == Event.CHECKPOINT_STALE.value]
    return quarantined, skipped, stale


def _checkpoint_counts(rows: tuple[list[Any], list[Any], list[Any]]) -> str:
    quarantined, skipped, stale = rows
    if not (quarantined or skipped or stale):
        return "none"
    return f"{len(quarantined)} / {len(skipped)} / {len(stale)}"


def _launches(events: list[dict[str, Any]], start: float) -> list[tuple[Any, ...]]:
    """One row per launch id, in order: when it started and ended, and how (the worst ``final``
    of its nodes, as ``contract.final_status`` picks it)."""
    begun: dict[str, float] = {}
    finals: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for record in _timed(events):
        launch_id = str(record.get("launch_id") or "")
        if record.get("event") == Event.LAUNCH_BEGIN.value:
            begun.setdefault(launch_id, record["ts"])
        elif record.get("event") == Event.FINAL.value:
            begun.setdefault(launch_id, record["ts"])
            finals[launch_id].append(record)
    rows = []
    for launch_id, began in begun.items():
        ended = finals.get(launch_id, [])
        worst = ([r for r in ended if r.get("failure_class") != "success"] or ended or [{}])[-1]
        rows.append((launch_id or "(first)", f"{began - start:.1f}",
                     f"{worst['ts'] - start:.1f}" if worst else "running", worst.get("failure_class"),
                     worst.get("exit_code"), str(worst.get("message") or "")[:160]))
    return rows


def _nodes(value: Any) -> str | None:
    if isinstance(value, list):
        return ", ".join(map(str, value)) or None
    return None if value is None else str(value)


def _spare_counts(by_kind: dict[str, list[dict[str, Any]]]) -> str:
    promoted, added = by_kind.get(SPARE_PROMOTED, []), by_kind.get(SPARE_ADDED, [])
    return f"{len(promoted)} / {len(added)}" if promoted or added else "none"


def _spare_rows(events: list[dict[str, Any]], start: float) -> list[tuple[Any, ...]]:
    """One row per promotion (which node left, which spare joined) and per refill (which node was
    taken out of service, which spare was added), in time order."""
    rows = []
    for r in _timed(events):
        kind = r.get("event")
        if kind == SPARE_PROMOTED:
            ranks = r.get("replaced_node_ranks")
            rows.append((f"{r['ts'] - start:.1f}", r.get("launch_id"), "spare promoted",
                         _nodes(r.get("replaces")) or "—", f"{r.get('node_id')} (node {r.get('node_rank')})",
                         f"in-job attempt {r.get('attempt')}"
                         + (f"; replaces node(s) {_nodes(ranks)}" if ranks else "")
                         + (f"; training: {_nodes(r.get('members'))}" if r.get("members") else "")))
        elif kind == SPARE_ADDED:
            quarantined = _nodes(r.get("quarantined"))
            rows.append((f"{r['ts'] - start:.1f}", r.get("launch_id"), "spare added",
                         f"{r.get('lost_node_id')} (node {r.get('lost_node_rank')})"
                         + ("; out of service" if quarantined else ""),
                         f"{r.get('node_id')} (node {r.get('node_rank')})",
                         (f"out of service: {quarantined}; " if quarantined else "")
                         + str(r.get("reason") or "")[:160]))
    return rows


def _by_layer_order(by_layer: dict[str, Any]) -> list[tuple[str, Any]]:
    order = {layer: i for i, layer in enumerate(RESTART_LAYERS)}
    return sorted(by_layer.items(), key=lambda kv: (order.get(kv[0], len(order)), kv[0]))


def _eval_summary(evaluation: dict[str, Any] | None) -> str | None:
    if not evaluation or _num(evaluation, "val_loss") is None:
        return None
    text = f"{evaluation['val_loss']:.4f}"
    if (perplexity := _num(evaluation, "perplexity")) is not None:
        text += f", perplexity {perplexity:.2f}"
    if evaluation.get("checkpoint_id"):
        text += f" ({evaluation['checkpoint_id']})"
    return text


def _world(config: dict[str, Any]) -> str | None:
    nodes, procs = config.get("nodes"), config.get("procs_per_node")
    if not config.get("model") and not (nodes and procs):
        return None
    world = f"{nodes} × {procs}" if nodes and procs else "?"
    return f"{config.get('model', '?')} / {world}"


def _ranges(steps: list[int]) -> str:
    """[11, 12, 13, 31, 32] -> '11–13, 31–32'."""
    parts: list[str] = []
    for step in steps:
        if parts and step == parts[-1][1] + 1:
            parts[-1] = (parts[-1][0], step)
        else:
            parts.append((step, step))
    return ", ".join(f"{a}" if a == b else f"{a}–{b}" for a, b in parts)


# -- Figures ----------------------------------------------------------------------------------


def _new_figure(width: float = 10.0, height: float = 4.5):
    # Lazy, and no pyplot: pyplot keeps global state and may pick an interactive backend; an
    # explicit Agg canvas is safe in a worker thread and leaks nothing.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=110, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _save(figure, path: Path) -> None:
    tmp = path.with_name(f".{path.stem}.tmp.{os.getpid()}{path.suffix}")
    figure.savefig(tmp, format="png")
    os.replace(tmp, path)


def _no_data(ax, message: str) -> None:
    ax.text(0.5, 0.5, message, ha="center", va="center", transform=ax.transAxes, color="gray")
    ax.set_xticks([])
    ax.set_yticks([])


def _time_scale(wall_s: float) -> tuple[float, str]:
    if wall_s > 3 * 3600:
        return 3600.0, "h"
    if wall_s > 3 * 60:
        return 60.0, "min"
    return 1.0, "s"


def _plot_loss(path: Path, executions: list[StepExecution], evaluation: dict[str, Any] | None) -> None:
    figure = _new_figure()
    ax = figure.subplots()
    kept = sorted(((r.step, r.loss) for r in executions if not r.replayed and r.loss is not None))
    replayed = [(r.step, r.loss) for r in executions if r.replayed and r.loss is not None]
    if not kept and not replayed:
        _no_data(ax, "no step losses logged yet")
    else:
        if kept:
            ax.plot(*zip(*kept), color="tab:blue", linewidth=1.4, label="loss (kept execution)")
        if replayed:
            ax.scatter(*zip(*replayed), s=36, facecolors="none", edgecolors="tab:red", linewidths=1.2,
                       zorder=3, label=f"replayed after a restart ({len(replayed)})")
        if evaluation and _num(evaluation, "val_loss") is not None and _num(evaluation, "step") is not None:
            ax.scatter([evaluation["step"]], [evaluation["val_loss"]], marker="*", s=160, color="tab:green",
                       zorder=4, label=f"eval val_loss {evaluation['val_loss']:.3f}")
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right")
    ax.set_title("Training loss")
    _save(figure, path)


def _plot_timeline(path: Path, events: list[dict[str, Any]], executions: list[StepExecution],
                   accounting: dict[str, Any]) -> None:
    figure = _new_figure(11.0, 5.0)
    ax = figure.subplots()
    start = accounting["start_ts"]
    scale, unit = _time_scale(accounting["wall_s"])
    at = lambda ts: (ts - start) / scale  # noqa: E731
    timed = _timed(events)
    if not timed:
        _no_data(ax, "no events yet")
        ax.set_title("Timeline")
        _save(figure, path)
        return

    labelled: set[str] = set()

    def label(text: str) -> str:
        # One legend entry per kind of marker.
        if text in labelled:
            return "_nolegend_"
        labelled.add(text)
        return text

    # Steps: one line per uninterrupted stretch, so a replay shows as a drop back.
    segments: dict[tuple[Any, Any], list[StepExecution]] = defaultdict(list)
    for run in executions:
        segments[run.segment].append(run)
    for runs in segments.values():
        ax.plot([at(r.end) for r in runs], [r.step for r in runs], color="tab:blue", linewidth=1.5,
                marker="." if len(runs) < 80 else None, markersize=3, label=label("step"))
    replayed = [r for r in executions if r.replayed]
    if replayed:
        ax.scatter([at(r.end) for r in replayed], [r.step for r in replayed], s=22, color="tab:brown", zorder=3,
                   label=label("step later replayed (lost)"))

    for lo, hi in _startup_spans([r for r in timed if r.get("event") != Event.EVAL.value]):
        ax.axvspan(at(lo), at(hi), color=_CATEGORY_COLORS[STARTUP_RESTORE], alpha=0.15,
                   label=label("startup / restore"))
    for record in timed:
        kind, x = record.get("event"), at(record["ts"])
        layer = str(record.get("layer") or "")
        color = _LAYER_COLORS.get(layer, "black")
        if kind == Event.CHECKPOINT_COMMIT.value:
            ax.axvline(x, color="tab:green", linestyle=":", linewidth=0.9, alpha=0.8, label=label("checkpoint commit"))
        elif kind == Event.LAUNCH_BEGIN.value and not record.get("standby"):  # a spare's launcher: no new launch
            ax.axvline(x, color="black", linestyle="--", linewidth=1.2, label=label("launch"))
        elif kind in (Event.FAULT_INJECTED.value, Event.FAULT_DETECTED.value):
            injected = kind == Event.FAULT_INJECTED.value
            text = "fault injected" if injected else "fault detected"
            step = _num(record, "step")
            if step is None:  # no step to place it at: a line across the plot instead
                ax.axvline(x, color="black", linestyle=":" if injected else "-.", label=label(text))
            else:
                ax.scatter([x], [step], marker="X" if injected else "v", s=90 if injected else 45, zorder=5,
                           color="black" if injected else "gold", edgecolors="black", linewidths=0.6,
                           label=label(text))
        elif kind == Event.RESTART_BEGIN.value:
            ax.axvline(x, color=color, linestyle="--", linewidth=1.2, label=label(f"restart begin ({layer})"))
        elif kind == Event.RESTART_END.value:
            latency = _num(record, "latency_s") or 0.0
            ax.axvspan(at(record["ts"] - latency), x, color=color, alpha=0.18,
                       label=label(f"restart window ({layer})"))
            ax.axvline(x, color=color, linewidth=1.2, label=label(f"restart end ({layer})"))
        elif kind == ESCALATION:
            ax.axvline(x, color="darkviolet", linewidth=2.4, label=label("escalation"))
        elif kind in (SPARE_PROMOTED, SPARE_ADDED):
            promoted = kind == SPARE_PROMOTED
            ax.axvline(x, color="teal" if promoted else "olive", linestyle="-" if promoted else "-.", linewidth=1.8,
                       label=label("spare promoted" if promoted else "spare added"))
            # Which node left and which spare joined, at the top of the line.
            out = _nodes(record.get("quarantined")) or record.get("lost_node_id")
            text = (f"{_nodes(record.get('replaces')) or '?'} → {record.get('node_id')}" if promoted else
                    f"+{record.get('node_id')} (out: {out})")
            ax.annotate(text, xy=(x, 1.0), xycoords=("data", "axes fraction"), xytext=(-2, -4),
                        textcoords="offset points", rotation=90, fontsize="x-small", ha="right", va="top",
                        color="teal" if promoted else "olive")
        elif kind in (Event.CHECKPOINT_QUARANTINED.value, Event.CHECKPOINT_STALE.value):
            text = "checkpoint quarantined" if kind == Event.CHECKPOINT_QUARANTINED.value else "stale save"
            ax.axvline(x, color="crimson" if kind == Event.CHECKPOINT_QUARANTINED.value else "darkorange",
                       linestyle=":", linewidth=1.6, label=label(text))
        elif kind == Event.FINAL.value:
            ok = record.get("failure_class") == "success"
            ax.axvline(x, color="black" if ok else "crimson", linewidth=2.0,
                       label=label("final: " + str(record.get("failure_class") or "?")))

    ax.set_xlim(left=min(0.0, ax.get_xlim()[0]))
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel(f"time since first launch ({unit})")
    ax.set_ylabel("step")
    ax.grid(alpha=0.25)
    if labelled:  # a log of only other records (e.g. checkpoint checks) has nothing to name
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)
    ax.set_title("Timeline: steps, checkpoints, faults, restarts and spares")
    _save(figure, path)


def _plot_goodput(path: Path, accounting: dict[str, Any]) -> None:
    figure = _new_figure(10.0, 2.8)
    ax = figure.subplots()
    wall = accounting["wall_s"]
    parts = [(PRODUCTIVE, accounting["productive_s"]), *accounting["badput_s"].items()]
    parts = [(c, s) for c, s in parts if s > 0]
    if wall <= 0 or not parts:
        _no_data(ax, "no wall time yet")
    else:
        left = 0.0
        for category, seconds in parts:
            ax.barh([0], [seconds], left=left, color=_CATEGORY_COLORS.get(category, "tab:olive"),
                    edgecolor="white", label=f"{_category_label(category)}: {seconds:.1f} s "
                                             f"({100 * seconds / wall:.1f} %)")
            left += seconds
        ax.set_xlim(0, wall)
        ax.set_yticks([])
        ax.set_xlabel("seconds of wall time")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)
    ettr = accounting["ettr"]
    ax.set_title("Goodput" + (f": ETTR {ettr:.3f} over {wall:.1f} s" if ettr is not None else ""))
    _save(figure, path)


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fsdp_resilience.control.report",
                                     description="Build RUN_DIR/report/report.md and its figures.")
    parser.add_argument("run_dir", help="the run's folder (holds events.jsonl)")
    args = parser.parse_args(argv)
    if not Path(args.run_dir).is_dir():
        print(f"error: run dir {args.run_dir} does not exist", file=sys.stderr)
        return 2
    print(build_report(args.run_dir).markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
