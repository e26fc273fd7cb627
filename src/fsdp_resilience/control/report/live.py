"""A run's report while it trains: the events read so far, topped up from the run's ``EventFeed``
on each look, and what the Airflow UI's report view shows (``LiveReport.view``) or the fleet page
lists (``LiveReport.brief``).

The same accounting as ``report.md`` (``goodput``, ``render_markdown``, ``fault_outcomes``): the
view is that report, with the figures' data as numbers for the page to draw instead of PNGs.
"""

from __future__ import annotations

import math
import threading
from collections import Counter, OrderedDict
from typing import Any, Callable

from fsdp_resilience.control.report.event_feed import EventFeed
from fsdp_resilience.control.report.goodput import PRODUCTIVE, category_label, goodput
from fsdp_resilience.control.report.markdown import render_markdown
from fsdp_resilience.control.report.records import (
    ESCALATION,
    SPARE_ADDED,
    SPARE_PROMOTED,
    WAITING_FOR_NODES,
    blame_evidence,
    fault_outcomes,
    read_json_object,
    step_executions,
    timed_records,
)
from fsdp_resilience.training.contract import Event, RunDir, final_of

#: At most this many points per figure series: a week-long run logs millions of steps, and the
#: page needs no more points than it has pixels.
MAX_POINTS = 2000


class LiveReport:
    """One run's events, read incrementally. Thread-safe: the API server answers requests from a
    thread pool, and two tabs may look at the same run."""

    def __init__(self, run_dir: str, feed: EventFeed):
        self.layout = RunDir(run_dir)
        self.feed = feed
        self.offset = 0
        self.events: list[dict[str, Any]] = []
        self.reads = 0
        self._lock = threading.Lock()

    def refresh(self) -> int:
        """Read what was appended since the last look; how many records that was."""
        with self._lock:
            new, self.offset = self.feed.read(self.offset)
            self.events.extend(new)
            self.reads += 1
            return len(new)

    def status(self) -> dict[str, Any]:
        """``state``: not_started (no record yet), running (no ``final`` yet), or the run's
        failure class (``success`` included), with the exit code and message of that ``final``."""
        final = final_of(self.events)
        if final is None:
            return {"state": "running" if self.events else "not_started"}
        return {
            "state": final.get("failure_class") or "unknown",
            "exit_code": final.get("exit_code"),
            "message": " ".join(str(final.get("message") or "").split()),
        }

    def brief(self, accounting: dict[str, Any] | None = None, config: dict[str, Any] | None = None) -> dict[str, Any]:
        """One row of the fleet page: status, steps, ETTR, restarts per layer, escalations and the
        nodes they replaced (``accounting`` and ``config``: ``goodput`` of the events and
        ``run.json``, when the caller has them already)."""
        events = self.events
        accounting = goodput(events) if accounting is None else accounting
        restarts = Counter(r["layer"] for r in accounting["restarts"])
        escalations = [r for r in events if r.get("event") == ESCALATION]
        replaced = Counter(str(n) for r in escalations if isinstance(r.get("nodes"), list) for n in r["nodes"])
        config = (read_json_object(self.layout.config) or {}) if config is None else config
        return {
            **self.status(),
            "run_id": config.get("run_id") or self.layout.root.name,
            "last_step": accounting["last_step"],
            "steps": config.get("steps"),
            "ettr": accounting["ettr"],
            "wall_s": accounting["wall_s"],
            "lost_s": accounting["wall_s"] - accounting["productive_s"],
            "restarts": dict(restarts),
            "restarts_total": sum(restarts.values()),
            "escalations": len(escalations),
            "nodes_replaced": dict(replaced),
            "start_ts": accounting["start_ts"] if events else None,
        }

    def view(self, to_html: Callable[[str], str] | None = None) -> dict[str, Any]:
        """Everything the report view shows: the status, the report's sections (Markdown, or HTML
        through ``to_html``) and the figures' data (times in seconds since the first launch)."""
        events = self.events
        accounting = goodput(events)
        executions = step_executions([r for r in events if r.get("event") != Event.EVAL.value])
        evaluation = read_json_object(self.layout.eval_result) or next(
            (r for r in reversed(events) if r.get("event") == Event.EVAL.value), None
        )
        markdown = render_markdown(self.layout, events, accounting, executions, evaluation, None)
        # The title and status line are the page's own; the sections start at the summary.
        sections = markdown[markdown.find("## ") :] if "## " in markdown else ""
        start = accounting["start_ts"]
        t = lambda ts: round(ts - start, 3)  # noqa: E731
        timed = timed_records(events)
        restart_reasons = [r for r in timed if r.get("event") == Event.RESTART_BEGIN.value]
        figures = {
            "wall_s": accounting["wall_s"],
            "steps": _thin([[run.step, t(run.start), t(run.end), run.loss, run.replayed] for run in executions]),
            "restarts": [
                {
                    "t": t(r["ts"]),
                    "layer": r["layer"],
                    "latency_s": r["latency_s"],
                    "step": r["step"],
                    "reason": _reason_before(restart_reasons, r["ts"], r["layer"]),
                }
                for r in accounting["restarts"]
            ],
            "faults": [
                {
                    "t": t(o.fault["ts"]),
                    "rank": o.fault.get("rank"),
                    "step": o.fault.get("step"),
                    "kind": o.fault.get("kind"),
                    "taken_by": o.taken_by,
                    "recovered": o.recovered,
                    "outcome": o.outcome,
                    "error": str(o.fault.get("error") or "")[:200],
                }
                for o in fault_outcomes(events)
            ],
            "injected": [
                {"t": t(r["ts"]), "kind": r.get("kind"), "step": r.get("step"), "rank": r.get("rank")}
                for r in timed
                if r.get("event") == Event.FAULT_INJECTED.value
            ],
            "checkpoints": [
                {"t": t(r["ts"]), "step": r.get("step"), "event": r.get("event")}
                for r in timed
                if r.get("event")
                in (
                    Event.CHECKPOINT_COMMIT.value,
                    Event.CHECKPOINT_QUARANTINED.value,
                    Event.CHECKPOINT_SKIP.value,
                )
            ][-MAX_POINTS:],
            "escalations": [
                {
                    "t": t(r["ts"]),
                    "rung": r.get("rung"),
                    "nodes": r.get("nodes"),
                    "failure_class": r.get("failure_class"),
                    "evidence": blame_evidence(r),
                }
                for r in timed
                if r.get("event") == ESCALATION
            ],
            "spares": [
                {"t": t(r["ts"]), "event": r.get("event"), "node_id": r.get("node_id")}
                for r in timed
                if r.get("event") in (SPARE_PROMOTED, SPARE_ADDED)
            ]
            + [
                {
                    "t": t(r["ts"]),
                    "event": r.get("event"),
                    "node_id": ", ".join(map(str, r.get("nodes") or [])),
                    "until": t(r["until"]) if isinstance(r.get("until"), (int, float)) else None,
                    "why": r.get("why"),
                }
                for r in timed
                if r.get("event") == WAITING_FOR_NODES
            ],
            "launches": [
                {"t": t(r["ts"]), "launch_id": r.get("launch_id")}
                for r in timed
                if r.get("event") == Event.LAUNCH_BEGIN.value and r.get("node_rank") in (None, 0)
            ],
            "goodput": [{"category": "productive", "seconds": accounting["productive_s"]}]
            + [{"category": category_label(c), "seconds": s} for c, s in accounting["badput_s"].items() if s > 0],
        }
        brief = self.brief(accounting, read_json_object(self.layout.config) or {})
        return {
            "run_id": brief["run_id"],
            "status": {k: brief[k] for k in ("state", "exit_code", "message") if k in brief},
            "brief": brief,
            "sections_html": to_html(sections) if to_html else None,
            "sections_markdown": sections,
            "figures": figures,
            "events_read": len(events),
            "offset": self.offset,
            "source": self.feed.source,
            "productive_category": PRODUCTIVE,
        }


def _reason_before(restart_begins: list[dict[str, Any]], ts: float, layer: str) -> str | None:
    """The reason of the newest ``restart_begin`` of ``layer`` before a ``restart_end`` at ``ts``."""
    found = None
    for record in restart_begins:
        if record["ts"] > ts:
            break
        if record.get("layer") == layer:
            found = record.get("reason")
    return None if found is None else str(found)[:300]


def _thin(rows: list[list[Any]]) -> list[list[Any]]:
    """Every k-th row so at most ``MAX_POINTS`` remain, keeping the last and every replayed one
    (the restarts' lost work is what the timeline is for)."""
    if len(rows) <= MAX_POINTS:
        return rows
    every = -(-len(rows) // MAX_POINTS)
    return [row for i, row in enumerate(rows) if i % every == 0 or row[4] or i == len(rows) - 1]


class LiveReports:
    """The runs looked at lately, each read incrementally; the least recently used is dropped
    beyond ``size`` (it is read again from the start if looked at again)."""

    def __init__(self, size: int = 128):
        self.size = size
        self._reports: OrderedDict[str, LiveReport] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, run_dir: str, feed: Callable[[], EventFeed]) -> LiveReport:
        """The run's ``LiveReport``, refreshed."""
        with self._lock:
            report = self._reports.get(run_dir)
            if report is None:
                report = LiveReport(run_dir, feed())
                self._reports[run_dir] = report
            self._reports.move_to_end(run_dir)
            while len(self._reports) > self.size:
                self._reports.popitem(last=False)
        report.refresh()
        return report


def numbers_only(value: Any) -> Any:
    """``value`` with NaN/inf floats as None (JSON has no NaN; a diverging run logs one)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: numbers_only(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [numbers_only(v) for v in value]
    return value
