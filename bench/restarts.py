"""Restart breakdowns from a run's events log and its ft_launcher log: which faults fired, the
restart that recovered each and where its time went, and the training loop's step cadence.

The events log is read with the run report's readers (``fsdp_resilience.control.report.records``:
standard library and the contract only), so both venvs import this module.
"""

from __future__ import annotations

import math
import re
import statistics
from datetime import datetime
from typing import Any

from bench.common import summarize
from fsdp_resilience.control.report.records import StepExecution, step_executions, timed_records
from fsdp_resilience.training.contract import Event

#: ft_launcher's log lines: NVRx 0.4.1 ``[2026-12-02 02:18:03,123] [INFO] [ft_launcher@host] msg``;
#: NVRx 0.7 ``2026-12-02 02:18:03,123 [INFO] [host] [workload:...] file.py:123 msg``.
_LOG_LINE = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\] \[\w+\] \[ft_launcher[^\]]*\] (.*)$")
_LOG_LINE_07 = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \[\w+\] \[[^\]]*\] \[[^\]]*\] \S+\.py:\d+ (.*)$")
_LOG_MARKS = (
    ("worker_failed", re.compile(r"failed \(exitcode|Worker group (UNHEALTHY|FAILED)")),
    ("rdzv_join", re.compile(r"attempts to join the next round")),
    # 0.4.1: "... has joined round 3 ..."; 0.7: "The node '...' has joined the rendezvous '...' as rank 0"
    ("rdzv_joined", re.compile(r"has joined round \d+|has joined the rendezvous ")),
)


def launcher_marks(text: str) -> list[tuple[float, str]]:
    """(unix time, mark) for the ft_launcher lines that time an in-job restart: a worker failed,
    the launcher joins the next rendezvous round (workers stopped), and it has joined (new
    workers start). The launcher logs local time with milliseconds, in either version's format."""
    marks = []
    for line in text.splitlines():
        m = _LOG_LINE.match(line) or _LOG_LINE_07.match(line)
        if not m:
            continue
        for name, pattern in _LOG_MARKS:
            if pattern.search(m.group(2)):
                ts = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
                marks.append((ts, name))
                break
    return sorted(marks)


def step_cadence(events: list[dict[str, Any]]) -> float | None:
    """Median wall seconds from one step to the next within one stretch of training (same process,
    same in-process attempt): the step itself plus the loop's overhead and checkpoint stalls."""
    last: dict[tuple[Any, Any], StepExecution] = {}
    gaps = []
    for run in step_executions(events):
        previous = last.get(run.segment)
        if previous is not None and run.step == previous.step + 1:
            gaps.append(run.end - previous.end)
        last[run.segment] = run
    return statistics.median(gaps) if gaps else None


def _first(records: list[dict[str, Any]], after: float, before: float, **match: Any) -> dict[str, Any] | None:
    for r in records:
        if after <= r["ts"] <= before and all(r.get(k) == v for k, v in match.items()):
            return r
    return None


def injected_faults(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per fault that fired, oldest first (a node loss is logged by every rank of the
    node: the first record stands for it)."""
    seen: dict[tuple[Any, ...], dict[str, Any]] = {}
    for r in timed_records(events):
        if r.get("event") != Event.FAULT_INJECTED.value:
            continue
        key = (r.get("kind"), r.get("step"), r.get("attempt"), r.get("launch_id"), r.get("node_id"))
        if r.get("kind") != "node_loss":
            key += (r.get("rank"), r.get("pid"))
        seen.setdefault(key, r)
    return sorted(seen.values(), key=lambda r: r["ts"])


def restart_trials(events: list[dict[str, Any]], marks: list[tuple[float, str]] = ()) -> list[dict[str, Any]]:
    """For each injected fault, the restart that recovered it: the layer, ``latency_s`` (the
    project's ``restart_end.latency_s``: fault -> next completed step) and where that time went.

    in-process: detect (fault -> the last rank logs it: a peer learns of it when its collective
    times out), tear down (-> ``restart_begin``: the Wrapper aborted the process group; zero when
    rank 0 decided that while a peer was still detecting), rendezvous + restore (-> ``train_begin``:
    new group, model, checkpoint loaded), first step (-> ``restart_end``).
    in-job: detect (fault -> ft_launcher sees a worker fail), tear down (-> it joins the next
    rendezvous round: workers stopped), rendezvous (-> joined), start + restore (-> ``train_begin``:
    new processes import, form the group, build the model, load the checkpoint), first step.
    relaunch: see ``bench.drive`` (the control plane times its own part).
    A fault followed by another before any restart finished is reported without a latency.
    """
    records = timed_records(events)
    faults = injected_faults(records)
    ends = [r for r in records if r.get("event") == "restart_end"]
    trials = []
    for i, fault in enumerate(faults):
        f = fault["ts"]
        horizon = faults[i + 1]["ts"] if i + 1 < len(faults) else math.inf
        end = next((r for r in ends if f < r["ts"] < horizon), None)
        trial: dict[str, Any] = {
            "kind": fault.get("kind"),
            "step": fault.get("step"),
            "rank": fault.get("rank"),
            "attempt": fault.get("attempt"),
            "fault_ts": f,
        }
        if end is None:
            trial.update(layer=None, latency_s=None, parts={}, note="no completed step before the next fault")
            trials.append(trial)
            continue
        e = end["ts"]
        layer = end.get("layer")
        parts: dict[str, float | None] = {}
        if layer == "inprocess":
            # The next attempt's first train_begin; everything before it belongs to this restart.
            start = _first(records, f, e, event="train_begin", rank=0)
            t = start["ts"] if start else e
            detected = [r["ts"] for r in records if r.get("event") == "fault_detected" and f <= r["ts"] <= t]
            begin = _first(records, f, t, event="restart_begin", layer="inprocess")
            # Phases in time order. Rank 0 may decide to restart (restart_begin) before a peer has
            # even noticed the fault (it was rank 0 that failed): that tear down overlaps detection.
            d = max(detected) if detected else f
            b = max(d, begin["ts"]) if begin else d
            parts = {
                "detect": d - f,
                "tear_down": b - d,
                "rendezvous_restore": (t - b) if start else None,
                "first_step": (e - t) if start else None,
            }
        elif layer == "injob":

            def mark(name: str, after: float, e: float = e) -> float | None:
                return next((ts for ts, m in marks if m == name and after <= ts <= e), None)

            failed = mark("worker_failed", f)
            join = mark("rdzv_join", failed) if failed else None
            joined = mark("rdzv_joined", join) if join else None
            start = _first(records, joined or f, e, event="train_begin", rank=0)
            t = start["ts"] if start else None
            parts = {
                "detect": (failed - f) if failed else None,
                "tear_down": (join - failed) if (join and failed) else None,
                "rendezvous": (joined - join) if (joined and join) else None,
                "start_restore": (t - (joined or f)) if t else None,
                "first_step": (e - t) if t else None,
            }
            if joined is None and t:  # no launcher log: one bucket from the fault to the new workers
                parts["start_restore"] = None
                parts["detect_to_new_workers"] = t - f
        trial.update(
            layer=layer,
            latency_s=end.get("latency_s"),
            measured_s=round(e - f, 4),
            resumed_step=end.get("step"),
            parts={k: (round(v, 4) if v is not None else None) for k, v in parts.items()},
        )
        trials.append(trial)
    return trials


def group_trials(trials: list[dict[str, Any]], mode: str) -> list[dict[str, Any]]:
    """Latency statistics per (fault kind, restart mode, layer that recovered it), with the median
    of each part of the breakdown."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for t in trials:
        if t.get("latency_s") is None:
            continue
        groups.setdefault((t["kind"], t["layer"]), []).append(t)
    rows = []
    for (kind, layer), ts in groups.items():
        part_names = list(dict.fromkeys(k for t in ts for k in t["parts"]))
        rows.append(
            {
                "kind": kind,
                "restart_mode": mode,
                "layer": layer,
                "latency_s": summarize(t["latency_s"] for t in ts),
                "parts_median_s": {p: summarize(t["parts"].get(p) for t in ts).get("median") for p in part_names},
            }
        )
    return rows
