"""docs/benchmarks.md, section 2 (after the relaunch rung): a node loss when the hot spares are used
up: the launch ends, and the relaunch after it, per training-plane lane; and the figure that joins
it to the control plane's relaunch rung."""

from __future__ import annotations

from typing import Any

from bench.summarize.formats import fmt_load, fmt_s, fmt_stat, md_table
from bench.summarize.lanes import lane_label

#: The breakdown's parts in time order, and how the page names them.
PART_NAMES = (
    ("detect", "detect (→ `waiting_for_nodes`)"),
    ("shut_down", "shut down (→ `final`)"),
    ("exit", "exit"),
    ("launcher_start", "launcher start"),
    ("start_restore", "rendezvous + start + restore"),
    ("first_step", "first step"),
)
#: The control plane's own parts of a relaunch rung row (the rest is the relaunch's start).
CONTROL_PLANE_PARTS = ("detect", "diagnose_replace", "capacity_submit")


def relaunch_rung(relaunch: dict[str, Any] | None) -> dict[str, Any] | None:
    """The control plane's relaunch rung row that stands for this loss: the node_loss row (else
    the first with figures)."""
    rows = [r for r in (relaunch or {}).get("rows") or [] if (r.get("total_s") or {}).get("n")]
    return next((r for r in rows if r["kind"] == "node_loss"), rows[0] if rows else None)


def control_plane_own_s(row: dict[str, Any] | None) -> float | None:
    """What the relaunch rung's control plane itself takes (medians): detect, diagnose + replace,
    capacity + submit; the relaunch's start + restore and first step are the training plane's."""
    parts = (row or {}).get("parts_median_s") or {}
    values = [parts.get(p) for p in CONTROL_PLANE_PARTS]
    return sum(values) if values and all(v is not None for v in values) else None


def with_relaunch_rung(used_up: dict[str, Any], relaunch: dict[str, Any] | None) -> float | None:
    """Fault -> first step through the control plane: the training plane's fault -> launch end
    (median) and the relaunch rung's failed launch -> first step (median), which holds the control
    plane's own time and the relaunch's start in its place of the bench's direct relaunch."""
    row = relaunch_rung(relaunch)
    end = (used_up.get("loss_to_end_s") or {}).get("median")
    if row is None or end is None:
        return None
    return end + row["total_s"]["median"]


def used_up_parts_text(parts: dict[str, Any]) -> str:
    return " · ".join(f"{label} {fmt_s(parts.get(key))}" for key, label in PART_NAMES if key in parts)


def spares_used_up_section(lanes: list[dict[str, Any]], relaunch: dict[str, Any] | None) -> list[str]:
    """The lanes' spares-used-up rows, side by side, and what the relaunch rung adds."""
    lanes = [tp for tp in lanes if ((tp.get("spares_used_up") or {}).get("total_s") or {}).get("n")]
    if not lanes:
        return []
    row = relaunch_rung(relaunch)
    first = lanes[0]["spares_used_up"]
    lines = [
        f"Node loss with the spares used up, on the training plane (each lane the same way): {first['nodes']} "
        f"training nodes + {first['spare_nodes']} spare (one `fsdp_resilience.training.launch` per node), `tiny` "
        f"model, `layered` restarts, `node_loss` drills at steps {first['fault_steps'][0]} (the spare takes the "
        f"lost node's place) and {first['fault_steps'][1]} (the spare's node: no spare left). Node 0's launcher "
        "logs `waiting_for_nodes` (nothing announced, nothing coming) and ends the launch (`final`: "
        "`restarts_exhausted`, lost and no spare left) instead of waiting out the rendezvous' join timeout "
        "(600 s); the bench then relaunches nodes 0 and 1 at once, the next launch id with the same config, as "
        "the ladder would, with no control plane between. Fault → launch end → the relaunch's first completed "
        "step (`restart_end`, layer `relaunch`). Breakdown (medians): detect = the second loss → node 0's "
        "`waiting_for_nodes`, shut down → its `final` (ft_launcher stops its workers, then, as the rendezvous' "
        "store host, lingers before it exits: NVRx 0.4.1's until the rendezvous has dropped the lost node, when "
        "its keep-alive expires, 5 s × 3 after the loss; 0.7's a fixed 3 s, `Store host waiting 3.0 seconds "
        "before exit`), exit → the relaunch started, launcher start → its `launch_begin`, rendezvous + "
        "start + restore → rank 0's `train_begin`, first step → `restart_end`. The relaunch resumed from the "
        "newest checkpoint committed before the launch ended, and no drill fired again, in every trial unless "
        "the last column says otherwise.",
        "",
    ]
    rows = []
    for tp in lanes:
        used = tp["spares_used_up"]
        combined = with_relaunch_rung(used, relaunch)
        n = used["total_s"]["n"]
        resumed = sum(1 for t in used.get("trials") or [] if t.get("resumed_newest"))
        rows.append(
            (
                lane_label(tp),
                f"{used['nodes']} × {used['procs_per_node']} ranks + {used['spare_nodes']}",
                n,
                fmt_stat(used["loss_to_end_s"]),
                fmt_stat(used["end_to_first_step_s"]),
                fmt_stat(used["total_s"]),
                fmt_s(combined),
                used_up_parts_text(used.get("parts_median_s") or {}),
                f"{resumed} of {n}"
                + ("" if used.get("all_ended_in_seconds") else "; **not every launch ended as restarts_exhausted**"),
            )
        )
    lines += md_table(
        (
            "lane",
            "nodes",
            "n",
            "fault → launch end",
            "launch end → first step (relaunched at once)",
            "fault → first step",
            "with the relaunch rung",
            "breakdown (median)",
            "resumed from the newest checkpoint",
        ),
        rows,
    )
    loads = []
    for tp in lanes:
        measured = (tp.get("measured") or {}).get("spares_used_up") or {}
        load = fmt_load({"load": measured["load"]}) if measured.get("load") else fmt_load(tp)
        loads.append(f"{lane_label(tp)}: {load}")
    lines += ["; ".join(loads) + ".", ""]
    if row is not None:
        own = control_plane_own_s(row)
        lines += [
            "Through the control plane the ladder relaunches instead of the bench, and that takes time of its "
            f"own: the column with the relaunch rung is fault → launch end plus the rung's {row['kind']} median "
            f"above ({fmt_s(row['total_s']['median'])}, failed launch → first step on the local backend, NVRx "
            "0.4.1), which stands for the direct relaunch's part"
            + (
                f"; of it the control plane's own part (detect, diagnose + replace, capacity + submit) is "
                f"{fmt_s(own)}, the rest is the relaunch's start"
                if own is not None
                else ""
            )
            + ".",
            "",
        ]
    return lines
