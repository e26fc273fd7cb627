"""The benchmark plots: checkpoint stall by state size, recovery per rung, and ETTR against the
checkpoint interval (matplotlib, imported when a plot is drawn)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.summarize.formats import METHOD_NAMES, fmt_s

#: Phases of a recovery, in time order, and their colours in the plot.
PHASES = (
    "detect",
    "tear_down",
    "rendezvous",
    "rendezvous_restore",
    "detect_to_new_workers",
    "diagnose_replace",
    "capacity_submit",
    "start_restore",
    "first_step",
)
PHASE_COLORS = {
    "detect": "tab:red",
    "tear_down": "tab:orange",
    "rendezvous": "tab:olive",
    "rendezvous_restore": "tab:purple",
    "detect_to_new_workers": "tab:brown",
    "diagnose_replace": "tab:pink",
    "capacity_submit": "tab:gray",
    "start_restore": "tab:cyan",
    "first_step": "tab:green",
}
PLOTS = (
    "stall.png",
    "recovery.png",
    "young_daly.png",
    "chaos-timeline.png",
    "chaos-goodput.png",
    "chaos_spares-timeline.png",
    "chaos_spares-goodput.png",
)


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=110, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def plot_stall(stall: dict[str, Any], path: Path) -> None:
    figure = _figure(8, 4.5)
    ax = figure.subplots()
    sizes = [s["state_mb"] for s in stall["sizes"]]
    for method in stall["sizes"][0]["methods"]:
        stats = [s["methods"][method]["blocking_s"] for s in stall["sizes"]]
        med = [x["median"] for x in stats]
        err = [[m - x["min"] for m, x in zip(med, stats)], [x["max"] - m for m, x in zip(med, stats)]]
        ax.errorbar(
            sizes,
            med,
            yerr=err,
            marker="o",
            capsize=3,
            label=METHOD_NAMES.get(method, method),
            linestyle="--" if method == "memcpy" else "-",
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("checkpoint state, MB (total over ranks)")
    ax.set_ylabel("blocking time per save, s (median, min–max)")
    ax.set_title(f"Checkpoint stall, {stall['world_size']} ranks, {stall['device']}")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize="small")
    figure.savefig(path)


def plot_recovery(tp: dict[str, Any], cp: dict[str, Any], path: Path) -> None:
    rows = []
    for row in (tp.get("recovery") or {}).get("rows", []):
        rows.append(
            (
                f"{row['kind']} ({row['restart_mode']}) → {row['layer']}",
                row["parts_median_s"],
                row["latency_s"],
                row.get("target_s"),
            )
        )
    for row in (cp.get("relaunch") or {}).get("rows", []):
        rows.append(
            (f"{row['kind']} → relaunch (control plane)", row["parts_median_s"], row["total_s"], row.get("target_s"))
        )
    spare = cp.get("spare")
    if spare and spare["recovery_s"].get("n"):
        # Until rank 0 sees the spare in the group (spare_promoted), then the rest to the first step.
        promoted, total = spare["promoted_s"].get("median"), spare["recovery_s"]["median"]
        parts = (
            {"detect_to_new_workers": promoted, "first_step": total - promoted} if promoted else {"first_step": total}
        )
        rows.append(("node_loss → a hot spare (in-job)", parts, spare["recovery_s"], None))
    if not rows:
        return
    figure = _figure(10, 0.55 * len(rows) + 1.6)
    ax = figure.subplots()
    for y, (_label, parts, total, target) in enumerate(rows):
        left = 0.0
        for name in sorted(parts, key=lambda n: PHASES.index(n) if n in PHASES else len(PHASES)):
            value = parts[name]
            if not value:
                continue
            ax.barh(y, value, left=left, color=PHASE_COLORS.get(name, "tab:gray"), label=name.replace("_", " "))
            left += value
        ax.errorbar(
            [total["median"]],
            [y],
            xerr=[[total["median"] - total["min"]], [total["max"] - total["median"]]],
            fmt="k|",
            capsize=4,
        )
        if target:
            ax.plot([target], [y], marker="v", color="black", markersize=7)
    handles, labels = ax.get_legend_handles_labels()
    seen = {}
    for h, label in zip(handles, labels):
        seen.setdefault(label, h)
    order = [p.replace("_", " ") for p in PHASES]
    labels = sorted(seen, key=lambda label: order.index(label) if label in order else len(order))  # time order
    ax.legend(
        [seen[label] for label in labels],
        labels,
        fontsize="small",
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        frameon=False,
    )
    ax.set_yticks(range(len(rows)), [r[0] for r in rows], fontsize="small")
    ax.invert_yaxis()
    ax.set_xlabel(
        "seconds from the fault to the next completed step (bars: median breakdown; whisker: min–max; ▼ target)"
    )
    ax.set_title("Recovery per rung")
    ax.grid(alpha=0.3, axis="x")
    figure.savefig(path)


def plot_young_daly(chaos: dict[str, Any], path: Path) -> None:
    from bench.common import ettr_model

    m = chaos["model"]
    figure = _figure(8, 4.5)
    ax = figure.subplots()
    for row in chaos["young_daly"]:
        tau = row["young_interval_s"]
        xs = [tau * 2 ** (k / 8) for k in range(-24, 25)]
        ys = [
            ettr_model(
                x,
                save_cost_s=m["C_save_cost_s"],
                mtbf_s=row["mtbf_s"],
                restart_s=m["R_restart_per_fault_s"],
                commit_s=m["W_commit_s"],
                loop_overhead=m["loop_overhead"],
            )
            for x in xs
        ]
        (line,) = ax.plot(xs, ys, label=f"MTBF {fmt_s(row['mtbf_s'])}: {row['mtbf']}")
        ax.plot(
            [tau / 2, tau, 2 * tau],
            [row["ettr"]["half"], row["ettr"]["young_daly"], row["ettr"]["double"]],
            "o",
            color=line.get_color(),
        )
    ax.plot(
        [chaos["interval_s"]],
        [m["check"]["measured_ettr_steady"]],
        "k*",
        markersize=12,
        label="measured in the chaos run (without start-up and shutdown)",
    )
    ax.set_xscale("log")
    ax.set_ylim(0, 1)
    ax.set_xlabel("checkpoint interval, s (dots: ½×, 1×, 2× the Young/Daly interval)")
    ax.set_ylabel("ETTR (modeled from measured costs)")
    ax.set_title("ETTR against checkpoint interval")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize="small", loc="lower center")
    figure.savefig(path)
