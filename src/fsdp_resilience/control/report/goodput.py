"""Goodput: where the wall time of a run went (productive, checkpoints, start-up and restore, lost
progress, each restart layer, other), computed from its events log alone."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from fsdp_resilience.control.report.records import (
    RESTART_LAYERS,
    integer,
    number,
    save_windows,
    startup_spans,
    step_executions,
    steps_during_saves,
    timed_records,
)
from fsdp_resilience.training.contract import Event

PRODUCTIVE = "productive"
CHECKPOINT_BLOCKING = "checkpoint_blocking"
CHECKPOINT_INTERFERENCE = "checkpoint_interference"
STARTUP_RESTORE = "startup_restore"
LOST_PROGRESS = "lost_progress"
OTHER = "other"

#: Which category an instant covered by several intervals belongs to: the first one listed.
#: Measured intervals (checkpoint stalls, step executions) win over the windows that contain them.
_PRIORITY = (
    CHECKPOINT_BLOCKING,
    CHECKPOINT_INTERFERENCE,
    PRODUCTIVE,
    LOST_PROGRESS,
    STARTUP_RESTORE,
    *(f"restart_{layer}" for layer in RESTART_LAYERS),
)


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
    timed = timed_records(events)
    training = [r for r in timed if r.get("event") != Event.EVAL.value]
    launches = [r["ts"] for r in training if r.get("event") == Event.LAUNCH_BEGIN.value]
    start = min(launches) if launches else (training[0]["ts"] if training else 0.0)
    end = max(training[-1]["ts"], start) if training else start
    wall = end - start

    executions = step_executions(training)
    intervals: list[tuple[float, float, str]] = [
        (run.start, run.end, LOST_PROGRESS if run.replayed else PRODUCTIVE) for run in executions
    ]
    intervals += [(lo, hi, STARTUP_RESTORE) for lo, hi in startup_spans(training)]
    windows = save_windows(training)
    usual, slowed = steps_during_saves(executions, windows)
    intervals += [
        (run.start + usual, run.end, CHECKPOINT_INTERFERENCE)
        for run in slowed
        if usual is not None and run.end - run.start > usual
    ]
    restarts = []
    for record in training:
        kind, ts = record.get("event"), record["ts"]
        if kind == Event.CHECKPOINT_BEGIN.value and (blocking := number(record, "blocking_s")):
            intervals.append((ts - blocking, ts, CHECKPOINT_BLOCKING))
        elif kind == Event.RESTART_END.value:
            layer = str(record.get("layer") or "unknown")
            latency = number(record, "latency_s")
            restarts.append({"layer": layer, "latency_s": latency, "step": integer(record, "step"), "ts": ts})
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


def category_label(category: str) -> str:
    if category.startswith("restart_"):
        return f"restart ({category.removeprefix('restart_')})"
    return category.replace("_", " ").replace("startup restore", "startup / restore")
