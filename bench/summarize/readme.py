"""The README's benchmark block, between its markers: a few lines of headline figures and a link to
docs/benchmarks.md, which has every target, table and plot (the README stays short)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.summarize.formats import fmt_s
from bench.summarize.lanes import lane_label
from bench.summarize.sections.spares_used_up import with_relaunch_rung
from bench.summarize.targets import targets

README_BEGIN, README_END = "<!-- bench:begin (make bench writes this block) -->", "<!-- bench:end -->"
#: Restart layers in the order a fault climbs them, and how the README names them.
_LAYERS = (
    ("inprocess", "in-process"),
    ("injob", "in-job"),
    ("relaunch", "relaunch on a replaced node (from the failed launch)"),
    ("spare", "a hot spare in the lost node's place"),
)


def _spread(values: list[float]) -> str:
    """The smallest and the largest median, or the one."""
    low, high = min(values), max(values)
    return fmt_s(low) if fmt_s(low) == fmt_s(high) else f"{fmt_s(low)}–{fmt_s(high)}"


def _recovery(tp: dict[str, Any], cp: dict[str, Any] | None = None) -> str | None:
    """Median recovery (fault → next completed step) per layer, over the fault kinds it recovered,
    on one training-plane lane (``cp``: the control plane's relaunch and spare rows, measured on the
    .venv lane)."""
    cp = cp or {}
    medians: dict[str, list[float]] = {}
    for row in (tp.get("recovery") or {}).get("rows") or []:
        if row.get("restart_mode") != "torchrun" and row["latency_s"].get("n"):
            medians.setdefault(row["layer"], []).append(row["latency_s"]["median"])
    for row in (cp.get("relaunch") or {}).get("rows") or []:
        if row["total_s"].get("n"):
            medians.setdefault("relaunch", []).append(row["total_s"]["median"])
    spares = []
    if ((tp.get("spare") or {}).get("recovery_s") or {}).get("n"):
        spares.append(fmt_s(tp["spare"]["recovery_s"]["median"]) + " (training plane)")
    if ((cp.get("spare") or {}).get("recovery_s") or {}).get("n"):
        spares.append(fmt_s(cp["spare"]["recovery_s"]["median"]) + " (driven through the control plane)")
    parts = [f"{name} {_spread(medians[layer])}" for layer, name in _LAYERS if medians.get(layer)]
    if spares:
        parts.append(f"{_LAYERS[-1][1]} {', '.join(spares)}")
    used = tp.get("spares_used_up") or {}
    if (used.get("total_s") or {}).get("n"):
        combined = with_relaunch_rung(used, cp.get("relaunch"))
        parts.append(
            f"node loss with the spares used up {fmt_s(used['total_s']['median'])} (launch end "
            f"{fmt_s(used['loss_to_end_s']['median'])} + relaunch {fmt_s(used['end_to_first_step_s']['median'])}"
            + (f"; through the relaunch rung {fmt_s(combined)}" if combined is not None else "")
            + ")"
        )
    return "; ".join(parts) if parts else None


def readme_block(summary: dict[str, Any]) -> str:
    """The README's block: what measured the figures, how many targets were met, the headline
    figures, and the link to the details (which stay in docs/benchmarks.md)."""
    tp, cp, chaos = summary.get("training_plane") or {}, summary.get("control_plane") or {}, summary.get("chaos")
    run = summary.get("run") or {}
    machine = tp.get("machine") or cp.get("machine") or (chaos or {}).get("machine") or {}
    versions = {**(tp.get("versions") or {}), **(cp.get("versions") or {})}
    rows = targets(summary)
    met = sum(1 for *_, ok in rows if ok)
    stack = ", ".join(f"{k} {v}" for k, v in sorted(versions.items()))
    lines = [
        f"Measured by `{run.get('command', 'make bench')}`"
        + (f" on {run['started_at'][:10]}" if run.get("started_at") else "")
        + f" on {machine.get('cores', '?')} CPU cores ({stack}): **{met} of {len(rows)} targets met**.",
        "",
    ]
    sizes = (tp.get("stall") or {}).get("sizes") or []
    if sizes and "nvrx_async_over_torch_async_save_best" in sizes[-1]["ratios"]:
        r = sizes[-1]["ratios"]
        lines.append(
            f"- Checkpoint stall, {sizes[-1]['state_mb']:.0f} MB of state: "
            f"{r['nvrx_async_over_torch_async_save_best']}× torch `async_save` at its best, "
            f"{r['nvrx_async_over_memcpy']}× a bare memcpy."
        )
    # The production NVRx (0.7, the lane's root) first, then the .venv lane's.
    tp07 = summary.get("training_plane_nvrx07") or {}
    if tp07 and (recovery := _recovery(tp07)):
        lines.append(f"- Recovery on {lane_label(tp07)}, fault → next completed step (medians): {recovery}.")
    if recovery := _recovery(tp, cp):
        on = f" on {lane_label(tp)}" if tp07 else ""
        lines.append(f"- Recovery{on}, fault → next completed step (medians): {recovery}.")
    if chaos:
        lines.append(
            f"- Goodput under chaos (one fault per ~{chaos['mtbf_s']:.0f} s, Llama 3 mix, "
            f"{chaos['faults_injected']} faults): ETTR {chaos['ettr']:.3f}, "
            f"{fmt_s(chaos['lost_per_fault_s'])} lost per fault."
        )
    slots = cp.get("slots")
    if slots:
        lines.append(
            f"- Airflow worker slots held while training runs: {slots['slots_held_while_deferred']} "
            "(the sensor defers to the triggerer)."
        )
    lines += [
        "",
        "Every target (the missed ones too), table, plot and method: [docs/benchmarks.md](docs/benchmarks.md).",
    ]
    return "\n".join([README_BEGIN, *lines, README_END])


def update_readme(readme: Path, summary: dict[str, Any]) -> None:
    text = readme.read_text()
    if README_BEGIN not in text or README_END not in text:
        return
    head, rest = text.split(README_BEGIN, 1)
    tail = rest.split(README_END, 1)[1]
    readme.write_text(head + readme_block(summary) + tail)
