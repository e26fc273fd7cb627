"""The report's Markdown: status, summary, restarts, faults, failed checkpoints, escalations, spares,
launches, the goodput table and links to the figures."""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from fsdp_resilience.control.report.goodput import PRODUCTIVE, category_label
from fsdp_resilience.control.report.records import (
    ESCALATION,
    RESTART_LAYERS,
    SPARE_ADDED,
    SPARE_PROMOTED,
    WAITING_FOR_NODES,
    StepExecution,
    blame_evidence,
    fault_outcomes,
    node_list,
    number,
    read_json_object,
    timed_records,
)
from fsdp_resilience.training.contract import (
    WHAT_TO_DO,
    CheckpointCatalog,
    Event,
    RunDir,
    final_of,
    verify_checkpoint,
)

if TYPE_CHECKING:
    from fsdp_resilience.control.report.build import ReportPaths


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


def render_markdown(
    layout: RunDir,
    events: list[dict[str, Any]],
    accounting: dict[str, Any],
    executions: list[StepExecution],
    evaluation: dict[str, Any] | None,
    paths: ReportPaths | None,
) -> str:
    """The report in Markdown; without ``paths`` (the UI's view, which draws its own figures) it
    has no Figures section."""
    config = read_json_object(layout.config) or {}
    run_id = config.get("run_id") or next((r["run_id"] for r in events if r.get("run_id")), layout.root.name)
    final = final_of(events)
    start = accounting["start_ts"]

    lines = [f"# Run report: {run_id}", ""]
    if final is None:
        lines += ["**Status:** running (no `final` record yet)", ""]
    else:
        failure_class = final.get("failure_class") or "unknown"
        message = " ".join(str(final.get("message") or "").split())
        lines += [
            f"**Status:** `{failure_class}` (exit code {final.get('exit_code', '?')})"
            + (f" — {message}" if message else ""),
            "",
        ]
        if failure_class in WHAT_TO_DO and failure_class != "unknown":
            lines += [f"**What to do:** {WHAT_TO_DO[failure_class]}.", ""]

    by_kind: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for record in events:
        by_kind[str(record.get("event"))].append(record)
    # The newest kept execution that logged a loss (with log_interval > 1 not every step does).
    last_logged = max(
        (run for run in executions if not run.replayed and run.loss is not None), key=lambda run: run.step, default=None
    )
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
        ("steps trained", f"{last_step if last_step is not None else 0}" + (f" / {configured}" if configured else "")),
        ("final loss", last_logged and f"{last_logged.loss:.4f} (step {last_logged.step})"),
        ("eval val_loss", _eval_summary(evaluation)),
        ("newest committed checkpoint", _newest_committed(newest)),
        ("model / world size", _world(config)),
        ("restart mode", config.get("restart_mode")),
        ("launches", len(launches) or None),
        (
            "restarts",
            ", ".join(f"{layer}: {len(latencies)}" for layer, latencies in _by_layer_order(layer_latencies)) or "none",
        ),
        ("escalations", len(escalations) or "none"),
        ("spares promoted / added", _spare_counts(by_kind)),
        ("checkpoints committed", len(by_kind.get(Event.CHECKPOINT_COMMIT.value, [])) or "none"),
        ("checkpoints quarantined / skipped / stale saves", _checkpoint_counts(checkpoint_rows)),
        (
            "faults injected / detected",
            f"{len(by_kind.get(Event.FAULT_INJECTED.value, []))} / {len(by_kind.get(Event.FAULT_DETECTED.value, []))}",
        ),
        (
            "wall time",
            f"{accounting['wall_s']:.1f} s ({_utc(start)} → {_utc(accounting['end_ts'])})"
            if accounting["wall_s"] > 0
            else None,
        ),
        ("ETTR (productive / wall)", None if ettr is None else f"{ettr:.3f}"),
    ]
    lines += ["## Summary", ""] + _table(("", ""), summary)

    lines += ["## Restarts", ""]
    if layer_latencies:
        rows = []
        for layer, latencies in _by_layer_order(layer_latencies):
            known = [x for x in latencies if x is not None]
            rows.append(
                (
                    layer,
                    len(latencies),
                    ", ".join(f"{x:.1f}" for x in known),
                    _seconds(sum(known) / len(known)) if known else None,
                    _seconds(max(known, default=None)),
                )
            )
        lines += _table(("layer", "count", "latency each (s)", "mean (s)", "max (s)"), rows)
        lines += ["Latency is `restart_end.latency_s`: from the fault to the first step completed after it.", ""]
    else:
        lines += ["No restarts.", ""]

    faults = fault_rows(events, start)
    if faults:
        lines += [
            "## Faults",
            "",
            "Each fault a rank caught, the layer that took it and whether training recovered; "
            '"points at" is what the launch would have ended with had no restart helped.',
            "",
        ] + _table(("t (s)", "event", "step", "rank", "kind", "taken by", "outcome", "points at", "error"), faults)

    checks = [r for r in timed_records(events) if r.get("event") == Event.HEALTH_CHECK_FAILED.value]
    if checks:
        lines += ["## Failed health checks", "", "NVRx's health checks that failed: evidence against the node.", ""]
        lines += _table(
            ("t (s)", "node", "check", "source", "NVRx", "message"),
            (
                (
                    f"{r['ts'] - start:.1f}",
                    r.get("node_id"),
                    r.get("check"),
                    r.get("source"),
                    r.get("nvrx_version"),
                    str(r.get("message") or "")[:160],
                )
                for r in checks
            ),
        )

    quarantined, skipped, stale = checkpoint_rows
    if quarantined or skipped or stale:
        lines += ["## Checkpoints that failed", ""]
    if quarantined:
        lines += [
            "Quarantined: moved to `checkpoints/quarantine/`, never loaded again, never deleted "
            "(inspect them there; move one back to `checkpoints/` to have it verified again).",
            "",
        ]
        lines += _table(("t (s)", "checkpoint", "step", "by", "reason", "now at"), quarantined)
    if skipped:
        lines += [
            "Skipped: passed over, left where it is (torn, or failed a check where it could not be moved aside).",
            "",
        ]
        lines += _table(("t (s)", "checkpoint", "step", "by", "reason"), skipped)
    if stale:
        lines += [
            "Stale saves: the model bytes equal an earlier checkpoint's although steps advanced (the save "
            "wrote old state).",
            "",
        ]
        lines += _table(("t (s)", "checkpoint", "step", "same as"), stale)

    if escalations:
        lines += [
            "## Escalations",
            "",
            "Evidence per blamed node: what the node says of its own health (a monitoring agent's "
            "condition, an NVRx health check), then drills, faults, lost pods and exit codes.",
            "",
        ] + _table(
            ("t (s)", "rung", "from launch", "to launch", "failure class", "nodes replaced", "evidence per node"),
            (
                (
                    f"{r['ts'] - start:.1f}" if number(r, "ts") is not None else None,
                    r.get("rung"),
                    r.get("from_launch"),
                    r.get("to_launch"),
                    r.get("failure_class"),
                    ", ".join(map(str, r["nodes"])) if isinstance(r.get("nodes"), list) else r.get("nodes"),
                    blame_evidence(r),
                )
                for r in escalations
            ),
        )

    spares = _spare_rows(events, start)
    if spares:
        lines += [
            "## Hot spares",
            "",
            "A spare promoted: it took a lost node's place at an in-job restart (no relaunch). A spare "
            "added: the control plane took the lost node out of service and started a new spare while "
            "training went on (each one spends one of max_node_replacements). Waiting for nodes: the "
            "survivors of a loss no spare covered, waiting for the replacement the control plane "
            "announced; no spare left: nothing was coming, and the launch ended at once.",
            "",
        ]
        lines += _table(("t (s)", "launch", "event", "node out", "spare in", "detail"), spares)

    if len(launches) > 1 or any(row[3] not in (None, "success") for row in launches):
        lines += ["## Launches", ""] + _table(
            ("launch", "started (s)", "ended (s)", "failure class", "exit code", "message"), launches
        )

    wall = accounting["wall_s"]
    share = (lambda s: f"{100 * s / wall:.1f} %") if wall > 0 else (lambda s: None)
    goodput_rows = [
        (PRODUCTIVE.replace("_", " "), _seconds(accounting["productive_s"]), share(accounting["productive_s"]))
    ]
    goodput_rows += [
        (category_label(c), _seconds(s), share(s))
        for c, s in accounting["badput_s"].items()
        if s > 0 or not c.startswith("restart_")
    ]  # no empty rows for layers never used
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
        "ETTR = productive / wall.",
        "",
    ]

    if paths is None:
        return "\n".join(lines)
    lines += ["## Figures", ""]
    for title, png in (("Loss", paths.loss_png), ("Timeline", paths.timeline_png), ("Goodput", paths.goodput_png)):
        lines += [f"![{title}]({png.relative_to(paths.markdown.parent).as_posix()})", ""]
    return "\n".join(lines)


def fault_rows(events: list[dict[str, Any]], start: float) -> list[tuple[Any, ...]]:
    """The Faults table: every drill that fired (``fault_injected``) and every fault a rank caught
    (``fault_detected``) with its ``FaultOutcome``, in time order."""
    outcomes = {id(o.fault): o for o in fault_outcomes(events)}
    rows = []
    for r in timed_records(events):
        if r.get("event") == Event.FAULT_INJECTED.value:
            rows.append(
                (f"{r['ts'] - start:.1f}", "injected", r.get("step"), r.get("rank"), r.get("kind"))
                + (None, None, None, None)
            )
        elif (o := outcomes.get(id(r))) is not None:
            rows.append(
                (
                    f"{r['ts'] - start:.1f}",
                    "detected",
                    r.get("step"),
                    r.get("rank"),
                    r.get("kind"),
                    o.taken_by,
                    o.outcome,
                    o.points_at,
                    str(r.get("error") or "")[:120],
                )
            )
    return rows


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
        if record.get("task"):
            return f"control plane ({record.get('task')})"
        return str(record.get("by") or "control plane")
    if record.get("rank") is not None:
        return f"rank {record['rank']}"
    return str(record.get("by") or record.get("role") or "—")


def _checkpoint_trouble(
    layout: RunDir, events: list[dict[str, Any]], start: float
) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """Rows for the quarantined checkpoints (the quarantine's records, and quarantine events whose
    folder is no longer there), the skipped ones (each checkpoint and reason once) and stale saves."""
    at = lambda r: f"{r['ts'] - start:.1f}" if number(r, "ts") is not None else None  # noqa: E731
    quarantined, seen = [], set()
    for record in CheckpointCatalog(layout).quarantined():
        seen.add(Path(record["path"]).name)
        moved_at = number(record, "quarantined_at")
        quarantined.append(
            (
                None if moved_at is None else f"{moved_at - start:.1f}",
                record.get("checkpoint_id"),
                record.get("step"),
                _by(record),
                record.get("reason"),
                f"checkpoints/quarantine/{Path(record['path']).name}",
            )
        )
    for r in timed_records(events):
        if r.get("event") == Event.CHECKPOINT_QUARANTINED.value and Path(str(r.get("moved_to"))).name not in seen:
            seen.add(Path(str(r.get("moved_to"))).name)
            quarantined.append(
                (at(r), r.get("checkpoint_id"), r.get("step"), _by(r), r.get("reason"), "gone (moved back or deleted)")
            )
    skipped, reasons = [], set()
    for r in timed_records(events):
        key = (r.get("checkpoint_id"), r.get("reason"))
        if r.get("event") == Event.CHECKPOINT_SKIP.value and key not in reasons:
            reasons.add(key)
            skipped.append((at(r), r.get("checkpoint_id"), r.get("step"), _by(r), r.get("reason")))
    stale = [
        (at(r), r.get("checkpoint_id"), r.get("step"), r.get("same_as"))
        for r in timed_records(events)
        if r.get("event") == Event.CHECKPOINT_STALE.value
    ]
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
    for record in timed_records(events):
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
        rows.append(
            (
                launch_id or "(first)",
                f"{began - start:.1f}",
                f"{worst['ts'] - start:.1f}" if worst else "running",
                worst.get("failure_class"),
                worst.get("exit_code"),
                str(worst.get("message") or "")[:160],
            )
        )
    return rows


def _spare_counts(by_kind: dict[str, list[dict[str, Any]]]) -> str:
    promoted, added = by_kind.get(SPARE_PROMOTED, []), by_kind.get(SPARE_ADDED, [])
    return f"{len(promoted)} / {len(added)}" if promoted or added else "none"


def _spare_rows(events: list[dict[str, Any]], start: float) -> list[tuple[Any, ...]]:
    """One row per promotion (which node left, which spare joined) and per refill (which node was
    taken out of service, which spare was added), in time order."""
    rows = []
    for r in timed_records(events):
        kind = r.get("event")
        if kind == SPARE_PROMOTED:
            ranks = r.get("replaced_node_ranks")
            rows.append(
                (
                    f"{r['ts'] - start:.1f}",
                    r.get("launch_id"),
                    "spare promoted",
                    node_list(r.get("replaces")) or "—",
                    f"{r.get('node_id')} (node {r.get('node_rank')})",
                    f"in-job attempt {r.get('attempt')}"
                    + (f"; replaces node(s) {node_list(ranks)}" if ranks else "")
                    + (f"; training: {node_list(r.get('members'))}" if r.get("members") else ""),
                )
            )
        elif kind == WAITING_FOR_NODES:
            until = r.get("until")
            rows.append(
                (
                    f"{r['ts'] - start:.1f}",
                    r.get("launch_id"),
                    "waiting for nodes" if until else "no spare left",
                    node_list(r.get("nodes")) or "—",
                    "—",
                    (f"node {r.get('node_rank')} waits until t={until - start:.1f} s: " if until else "")
                    + str(r.get("why") or "")[:160],
                )
            )
        elif kind == SPARE_ADDED:
            quarantined = node_list(r.get("quarantined"))
            rows.append(
                (
                    f"{r['ts'] - start:.1f}",
                    r.get("launch_id"),
                    "spare added",
                    f"{r.get('lost_node_id')} (node {r.get('lost_node_rank')})"
                    + ("; out of service" if quarantined else ""),
                    f"{r.get('node_id')} (node {r.get('node_rank')})",
                    (f"out of service: {quarantined}; " if quarantined else "") + str(r.get("reason") or "")[:160],
                )
            )
    return rows


def _by_layer_order(by_layer: dict[str, Any]) -> list[tuple[str, Any]]:
    order = {layer: i for i, layer in enumerate(RESTART_LAYERS)}
    return sorted(by_layer.items(), key=lambda kv: (order.get(kv[0], len(order)), kv[0]))


def _eval_summary(evaluation: dict[str, Any] | None) -> str | None:
    if not evaluation or number(evaluation, "val_loss") is None:
        return None
    text = f"{evaluation['val_loss']:.4f}"
    if (perplexity := number(evaluation, "perplexity")) is not None:
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
