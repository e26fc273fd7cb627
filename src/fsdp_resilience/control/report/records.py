"""Reading a run's records: the events log's records as numbers, in time order, as step executions,
save windows and start-up spans, and the small JSON files beside it.

Defensively: a partial or older log must never make the report fail (a field of the wrong type
reads as missing). Standard library and the contract only, so the benchmarks (either venv) read
runs with it too.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from fsdp_resilience.training.contract import Event

#: Restart layers, innermost first (the order of ``Event.RESTART_BEGIN``'s ``layer`` values).
RESTART_LAYERS = ("inprocess", "injob", "relaunch")
#: Written by the control plane when it replaces nodes and relaunches.
ESCALATION = Event.ESCALATION.value
#: Hot spares: a spare took a lost node's place (rank 0), and the control plane refilled the pool.
SPARE_PROMOTED, SPARE_ADDED = Event.SPARE_PROMOTED.value, Event.SPARE_ADDED.value
WAITING_FOR_NODES = Event.WAITING_FOR_NODES.value


def number(record: dict[str, Any], key: str) -> float | None:
    """``record[key]`` as a finite float; None when missing, not a number, a bool, inf or NaN."""
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def integer(record: dict[str, Any], key: str) -> int | None:
    """``record[key]`` as an int (truncated), as ``number`` reads it."""
    value = number(record, key)
    return int(value) if value is not None else None


def timed_records(events: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Records with a usable ``ts``, oldest first (stable: equal stamps keep log order)."""
    return sorted((r for r in events if isinstance(r, dict) and number(r, "ts") is not None), key=lambda r: r["ts"])


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
    for record in timed_records(events):
        kind, ts = record.get("event"), record["ts"]
        segment = (record.get("pid"), record.get("iteration"))
        if kind == Event.TRAIN_BEGIN.value:
            start_step = integer(record, "start_step")
            if start_step is not None:
                position[segment] = (start_step, ts)
            continue
        step = integer(record, "step")
        if kind != Event.STEP.value or step is None:
            continue
        loss, step_s = number(record, "loss"), number(record, "step_s")
        previous = position.get(segment)
        position[segment] = (step, ts)
        if previous is not None and step - previous[0] > 1 and previous[1] < ts:
            first, since = previous[0] + 1, previous[1]
            share = (ts - since) / (step - first + 1)
            for i, s in enumerate(range(first, step + 1)):
                runs.append(
                    StepExecution(s, since + i * share, since + (i + 1) * share, loss if s == step else None, segment)
                )
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
    for record in timed_records(events):
        kind, step = record.get("event"), integer(record, "step")
        if step is None:
            continue
        key = (record.get("launch_id"), record.get("attempt"), step)
        if kind == Event.CHECKPOINT_BEGIN.value:
            begins[key] = record["ts"]
        elif kind == Event.CHECKPOINT_COMMIT.value and key in begins:
            windows.append((begins.pop(key), record["ts"]))
    return windows


def steps_during_saves(
    executions: list[StepExecution], windows: list[tuple[float, float]]
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


def startup_spans(timed: list[dict[str, Any]]) -> list[tuple[float, float]]:
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
        for later in timed[i + 1 :]:
            if later.get("event") == Event.STEP.value:
                break
            if later.get("event") == Event.TRAIN_BEGIN.value and (
                kind == Event.LAUNCH_BEGIN.value or later.get("pid") == marker.get("pid")
            ):
                spans.append((marker["ts"], later["ts"]))
                break
    return spans


def read_json_object(path: Path) -> dict[str, Any] | None:
    """A JSON object from ``path`` (``run.json``, ``eval.json``); None when missing, torn or not an object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def node_list(value: Any) -> str | None:
    """A record's node field (a list of names, or one) as text; None when empty."""
    if isinstance(value, list):
        return ", ".join(map(str, value)) or None
    return None if value is None else str(value)


def blame_evidence(escalation: dict[str, Any]) -> str | None:
    """An escalation's evidence, per blamed node ("node: signal; signal | node: ..."): its
    ``signals``; a record written before they were kept has only the joined ``reason``."""
    signals = escalation.get("signals")
    if isinstance(signals, dict) and signals:
        return " | ".join(
            f"{node}: {'; '.join(map(str, found)) if isinstance(found, list) else found}"
            for node, found in signals.items()
        )
    return escalation.get("reason")


#: What a ``fault_detected`` record's ``failure_class`` says the fault points at, in words. The
#: class is what the launch ends with *if* no restart recovers it, so a report must not show it as
#: the fault's outcome ("restarts_exhausted" for an exception recovered in-process at once).
POINTS_AT = {
    "restarts_exhausted": "the machine (transient)",
    "user_error": "the user's code",
    "storage_error": "storage",
    "non_finite": "non-finite state",
    "checkpoint": "a checkpoint's files",
}


@dataclass(frozen=True)
class FaultOutcome:
    """What became of one ``fault_detected``: the layer that took it, whether training recovered
    (None while the launch is still going and nothing has resumed yet), and in words."""

    fault: dict[str, Any]
    taken_by: str | None
    recovered: bool | None
    outcome: str

    @property
    def points_at(self) -> str | None:
        failure_class = self.fault.get("failure_class")
        return POINTS_AT.get(str(failure_class), failure_class)


def fault_outcomes(events: Iterable[dict[str, Any]]) -> list[FaultOutcome]:
    """One ``FaultOutcome`` per ``fault_detected``, oldest first.

    Recovered by a layer: the first ``restart_end`` after the fault in the same launch (in-process,
    in-job, or a non-finite rollback). Not recovered in the launch: its ``final`` came first with a
    failure; then the ladder's relaunch recovered it if a later launch resumed training
    (``restart_end`` of layer ``relaunch``). A launch that ended ``success`` after the fault
    recovered it too (a fault at the last step needs no step after it).
    """
    timed = timed_records(events)
    out = []
    for i, fault in enumerate(timed):
        if fault.get("event") != Event.FAULT_DETECTED.value:
            continue
        launch = fault.get("launch_id")
        taken_by: str | None = str(fault.get("layer") or "") or None
        recovered: bool | None = None
        outcome = "not recovered yet"
        if fault.get("layer") == "none":
            recovered, outcome = False, f"not retried: the run stopped ({fault.get('failure_class')})"
        ended: dict[str, Any] | None = None
        for later in timed[i + 1 :] if recovered is None else ():
            kind = later.get("event")
            if ended is None and later.get("launch_id") == launch:
                if kind == Event.RESTART_END.value:
                    taken_by, recovered = str(later.get("layer") or taken_by), True
                    latency = number(later, "latency_s")
                    outcome = f"recovered ({taken_by}" + (f", {latency:.1f} s)" if latency is not None else ")")
                    break
                if kind == Event.FINAL.value:
                    if later.get("failure_class") == "success":
                        recovered, outcome = True, "recovered (the launch completed)"
                        break
                    ended = later
                    recovered = False
                    outcome = f"not recovered in launch {launch}: it ended {later.get('failure_class')}"
            elif ended is not None and kind == Event.RESTART_END.value and later.get("layer") == "relaunch":
                taken_by, recovered = "relaunch", True
                outcome = (
                    f"launch {launch} ended {ended.get('failure_class')}; "
                    f"recovered by relaunch {later.get('launch_id')}"
                )
                break
        out.append(FaultOutcome(fault, taken_by, recovered, outcome))
    return out
