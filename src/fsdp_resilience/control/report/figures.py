"""The report's figures: training loss, a timeline of the run, and the goodput bar.

matplotlib is imported only when a figure is drawn, so importing the report (e.g. while the DAG
processor parses a DAG) stays cheap.
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path
from typing import Any

from fsdp_resilience.control.report.goodput import (
    CHECKPOINT_BLOCKING,
    CHECKPOINT_INTERFERENCE,
    LOST_PROGRESS,
    OTHER,
    PRODUCTIVE,
    STARTUP_RESTORE,
    category_label,
)
from fsdp_resilience.control.report.records import (
    ESCALATION,
    SPARE_ADDED,
    SPARE_PROMOTED,
    WAITING_FOR_NODES,
    StepExecution,
    node_list,
    number,
    startup_spans,
    timed_records,
)
from fsdp_resilience.training.contract import Event

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


def plot_loss(path: Path, executions: list[StepExecution], evaluation: dict[str, Any] | None) -> None:
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
            ax.scatter(
                *zip(*replayed),
                s=36,
                facecolors="none",
                edgecolors="tab:red",
                linewidths=1.2,
                zorder=3,
                label=f"replayed after a restart ({len(replayed)})",
            )
        if evaluation and number(evaluation, "val_loss") is not None and number(evaluation, "step") is not None:
            ax.scatter(
                [evaluation["step"]],
                [evaluation["val_loss"]],
                marker="*",
                s=160,
                color="tab:green",
                zorder=4,
                label=f"eval val_loss {evaluation['val_loss']:.3f}",
            )
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right")
    ax.set_title("Training loss")
    _save(figure, path)


def plot_timeline(
    path: Path, events: list[dict[str, Any]], executions: list[StepExecution], accounting: dict[str, Any]
) -> None:
    figure = _new_figure(11.0, 5.0)
    ax = figure.subplots()
    start = accounting["start_ts"]
    scale, unit = _time_scale(accounting["wall_s"])
    at = lambda ts: (ts - start) / scale  # noqa: E731
    timed = timed_records(events)
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
        ax.plot(
            [at(r.end) for r in runs],
            [r.step for r in runs],
            color="tab:blue",
            linewidth=1.5,
            marker="." if len(runs) < 80 else None,
            markersize=3,
            label=label("step"),
        )
    replayed = [r for r in executions if r.replayed]
    if replayed:
        ax.scatter(
            [at(r.end) for r in replayed],
            [r.step for r in replayed],
            s=22,
            color="tab:brown",
            zorder=3,
            label=label("step later replayed (lost)"),
        )

    for lo, hi in startup_spans([r for r in timed if r.get("event") != Event.EVAL.value]):
        ax.axvspan(
            at(lo), at(hi), color=_CATEGORY_COLORS[STARTUP_RESTORE], alpha=0.15, label=label("startup / restore")
        )
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
            step = number(record, "step")
            if step is None:  # no step to place it at: a line across the plot instead
                ax.axvline(x, color="black", linestyle=":" if injected else "-.", label=label(text))
            else:
                ax.scatter(
                    [x],
                    [step],
                    marker="X" if injected else "v",
                    s=90 if injected else 45,
                    zorder=5,
                    color="black" if injected else "gold",
                    edgecolors="black",
                    linewidths=0.6,
                    label=label(text),
                )
        elif kind == Event.RESTART_BEGIN.value:
            ax.axvline(x, color=color, linestyle="--", linewidth=1.2, label=label(f"restart begin ({layer})"))
        elif kind == Event.RESTART_END.value:
            latency = number(record, "latency_s") or 0.0
            ax.axvspan(at(record["ts"] - latency), x, color=color, alpha=0.18, label=label(f"restart window ({layer})"))
            ax.axvline(x, color=color, linewidth=1.2, label=label(f"restart end ({layer})"))
        elif kind == ESCALATION:
            ax.axvline(x, color="darkviolet", linewidth=2.4, label=label("escalation"))
        elif kind == WAITING_FOR_NODES:
            until = number(record, "until")
            if until is not None:
                ax.axvspan(x, at(until), color="orange", alpha=0.12, label=label("waiting for nodes"))
            ax.axvline(x, color="orange", linewidth=1.8, label=label("waiting for nodes (no spare left)"))
        elif kind in (SPARE_PROMOTED, SPARE_ADDED):
            promoted = kind == SPARE_PROMOTED
            ax.axvline(
                x,
                color="teal" if promoted else "olive",
                linestyle="-" if promoted else "-.",
                linewidth=1.8,
                label=label("spare promoted" if promoted else "spare added"),
            )
            # Which node left and which spare joined, at the top of the line.
            out = node_list(record.get("quarantined")) or record.get("lost_node_id")
            text = (
                f"{node_list(record.get('replaces')) or '?'} → {record.get('node_id')}"
                if promoted
                else f"+{record.get('node_id')} (out: {out})"
            )
            ax.annotate(
                text,
                xy=(x, 1.0),
                xycoords=("data", "axes fraction"),
                xytext=(-2, -4),
                textcoords="offset points",
                rotation=90,
                fontsize="x-small",
                ha="right",
                va="top",
                color="teal" if promoted else "olive",
            )
        elif kind in (Event.CHECKPOINT_QUARANTINED.value, Event.CHECKPOINT_STALE.value):
            text = "checkpoint quarantined" if kind == Event.CHECKPOINT_QUARANTINED.value else "stale save"
            ax.axvline(
                x,
                color="crimson" if kind == Event.CHECKPOINT_QUARANTINED.value else "darkorange",
                linestyle=":",
                linewidth=1.6,
                label=label(text),
            )
        elif kind == Event.FINAL.value:
            ok = record.get("failure_class") == "success"
            ax.axvline(
                x,
                color="black" if ok else "crimson",
                linewidth=2.0,
                label=label("final: " + str(record.get("failure_class") or "?")),
            )

    ax.set_xlim(left=min(0.0, ax.get_xlim()[0]))
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel(f"time since first launch ({unit})")
    ax.set_ylabel("step")
    ax.grid(alpha=0.25)
    if labelled:  # a log of only other records (e.g. checkpoint checks) has nothing to name
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)
    ax.set_title("Timeline: steps, checkpoints, faults, restarts and spares")
    _save(figure, path)


def plot_goodput(path: Path, accounting: dict[str, Any]) -> None:
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
            ax.barh(
                [0],
                [seconds],
                left=left,
                color=_CATEGORY_COLORS.get(category, "tab:olive"),
                edgecolor="white",
                label=f"{category_label(category)}: {seconds:.1f} s ({100 * seconds / wall:.1f} %)",
            )
            left += seconds
        ax.set_xlim(0, wall)
        ax.set_yticks([])
        ax.set_xlabel("seconds of wall time")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)
    ettr = accounting["ettr"]
    ax.set_title("Goodput" + (f": ETTR {ettr:.3f} over {wall:.1f} s" if ettr is not None else ""))
    _save(figure, path)
