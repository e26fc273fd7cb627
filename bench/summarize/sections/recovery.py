"""docs/benchmarks.md, section 2: recovery per rung (in-process, in-job, relaunch, a hot spare)."""

from __future__ import annotations

from typing import Any

from bench.summarize.formats import fmt_load, fmt_met, fmt_s, fmt_stat, md_table
from bench.summarize.lanes import SPARE_TARGET_S_NVRX07, is_nvrx07, lane_label, spare_parts_text
from bench.summarize.sections.spares_used_up import relaunch_rung, spares_used_up_section, with_relaunch_rung

#: NVRx 0.7's promotion of a hot spare, measured by the rendezvous experiment of issue 15 (a gloo
#: all-reduce loop, nodes=2:3, SIGKILL of a node -> the new round closed; 5 kills), not by make bench.
NVRX07_PROMOTION_S = (4.6, 4.8)


def _spare_section(
    spare: dict[str, Any],
    relaunch: dict[str, Any] | None,
    cp: dict[str, Any],
    spare07: dict[str, Any] | None = None,
    used_up: dict[str, Any] | None = None,
) -> list[str]:
    """Node loss with a hot spare, next to the relaunch rung for the same loss and the loss no
    spare is left for (``used_up``: the .venv lane's, whose launch ends before the rung relaunches)."""
    same = next((r for r in (relaunch or {}).get("rows") or [] if r["kind"] == "node_loss"), None)
    measured = (cp.get("measured") or {}).get("spare") or {}
    load = fmt_load({"load": measured.get("load")}) if measured.get("load") else fmt_load(cp)
    by = sorted({t["recovered_by"] for t in spare["trials"] if t.get("recovered_by")})
    lines = [
        f"Node loss with a hot spare (local backend, {spare['nodes']} nodes × {spare['procs_per_node']} ranks + "
        f"{spare['spare_nodes']} spare, NVRx {spare.get('nvrx') or '?'}): node 1's launcher and ranks SIGKILLed "
        "(node 0 hosts the rendezvous store, which no spare covers), a run per trial, driven like the DAG: the "
        "watch watches on while the job stays running, and the pool keeper (`spare_refill.keep_spare_pool`) "
        "quarantines the lost slot and starts a new spare meanwhile. No relaunch: "
        + (
            "every loss was covered in-job."
            if spare["all_covered_in_job"]
            else "**not every loss was covered in-job** (see `trials`)."
        )
        + f" {load}.",
        "",
    ]
    rows = [
        (
            "node_loss, a spare takes its place",
            ", ".join(by) or "—",
            spare["recovery_s"].get("n", 0),
            fmt_stat(spare["recovery_s"]),
            fmt_stat(spare["promoted_s"]),
            fmt_stat(spare["refill_s"]),
        )
    ]
    if same:
        rows.append(
            (
                "node_loss, no spare: the relaunch rung (above)",
                "relaunch",
                same["total_s"]["n"],
                fmt_stat(same["total_s"]),
                "—",
                "—",
            )
        )
    combined = with_relaunch_rung(used_up or {}, relaunch)
    if combined is not None:
        rows.append(
            (
                "node_loss, spares used up: the launch ends, then the relaunch rung (both above)",
                "relaunch",
                used_up["loss_to_end_s"]["n"],
                f"{fmt_s(combined)} (fault → launch end {fmt_s(used_up['loss_to_end_s']['median'])} + the rung "
                f"{fmt_s(relaunch_rung(relaunch)['total_s']['median'])}; medians)",
                "—",
                "—",
            )
        )
    lines += md_table(
        (
            "fault",
            "recovered by",
            "n",
            "fault → first step",
            "fault → spare trains (`spare_promoted`)",
            "fault → pool whole again (`spare_added`)",
        ),
        rows,
    )
    if spare07 and (spare07.get("recovery_s") or {}).get("n"):
        on07 = (
            f"On NVRx 0.7 (the training-plane rows above, the lane's root) the spare trains "
            f"{fmt_s(spare07['promoted_s'].get('median'))} after the fault and the first step comes after "
            f"{fmt_s(spare07['recovery_s']['median'])}."
        )
    else:
        on07 = (
            f"NVRx 0.7's barrier rendezvous promotes in {NVRX07_PROMOTION_S[0]}–{NVRX07_PROMOTION_S[1]} s (kill → "
            "new round closed, 5 kills with a gloo all-reduce loop; measured by the issue-15 rendezvous "
            "experiment, not by this benchmark); the trainer's restart and resume come on top."
        )
    lines += [
        "The spare's promotion waits for the rendezvous to drop the lost node. NVRx 0.4.1 (this lane) does so "
        "when its keep-alive expires, hard-coded at 5 s × 3 (≈ 14–15 s), and the in-process layer tries first. " + on07
    ]
    if same and spare["recovery_s"].get("n") and same["total_s"]["median"] < spare["recovery_s"]["median"]:
        lines[-1] += (
            " Here the relaunch is faster: a local slot starts in seconds, while the spare waits for the "
            "rendezvous to drop the lost node. What a spare saves is the node's replacement where that "
            "takes minutes: a new instance's boot and join on EKS, or a wait for capacity that may not "
            "come; and it keeps the pool whole without holding up training."
        )
    return lines + [""]


def _recovery_table(tp: dict[str, Any], recovery: dict[str, Any], lanes: int) -> list[str]:
    """One lane's recovery rows (fault -> next completed step per rung, and its torchrun baseline)."""
    s = recovery["settings"]
    lines = []
    if lanes > 1:
        lines += [f"**{lane_label(tp)}**", ""]
    lines += [
        f"Seconds from the fault to the next completed step (`restart_end.latency_s`), 2 ranks, "
        f"`{s['model']}` model, collective timeout {s['collective_timeout_s']:.0f} s, heartbeat timeout "
        f"{s['heartbeat_timeout_s']:.0f} s (the ceiling: once warm, each attempt derives its own from the "
        "measured steps "
        f"and saves, see `timeouts_derived`), hang timeout {s['hang_timeout_s']:.0f} s. Rows `torchrun`: the "
        "baseline, the same trainer without NVRx under plain `torchrun --standalone --max-restarts`. Rows "
        "`injob_no_zygote`: the same crashes in a layered run with `FSDP_WORKER_ZYGOTE=off`, its ranks started "
        "as fresh interpreters (what the worker zygote saves). "
        "Breakdown: medians, "
        "from the events log and ft_launcher's log. {}.".format(fmt_load(tp)),
        "",
    ]
    rows = []
    for row in recovery["rows"]:
        p = row["parts_median_s"]
        if row["layer"] == "inprocess":
            detail = (
                f"detect {fmt_s(p.get('detect'))} · tear down {fmt_s(p.get('tear_down'))} · rendezvous + restore "
                f"{fmt_s(p.get('rendezvous_restore'))} · first step {fmt_s(p.get('first_step'))}"
            )
        else:
            detail = (
                f"detect {fmt_s(p.get('detect'))} · tear down {fmt_s(p.get('tear_down'))} · rendezvous "
                f"{fmt_s(p.get('rendezvous'))} · start + restore {fmt_s(p.get('start_restore'))} · first step "
                f"{fmt_s(p.get('first_step'))}"
            )
        rows.append(
            (
                row["kind"],
                row["restart_mode"],
                row["layer"],
                row["latency_s"]["n"],
                fmt_stat(row["latency_s"]),
                detail,
                f"≤ {row['target_s']:g} s: {fmt_met(row['target_met'])}" if "target_s" in row else "—",
            )
        )
    return lines + md_table(
        ("fault", "restart mode", "recovered by", "n", "latency", "breakdown (median)", "target"), rows
    )


def _spare_lanes_section(lanes: list[dict[str, Any]], cp_spare: dict[str, Any] | None) -> list[str]:
    """The spare takeover measured the same way on each lane (training plane only), side by side,
    and the control plane's spare row beside them."""
    lines = [
        "Hot-spare takeover on the training plane, each lane measured the same way: 2 training nodes + 1 "
        "spare (one `fsdp_resilience.training.launch` per node, as pods run them), `tiny` model, `layered` "
        "restarts, node 1's launcher and ranks SIGKILLed by the `node_loss` drill; fault → the first completed "
        "step (`restart_end.latency_s`), a run per trial. Breakdown (medians): detect = fault → node 0's "
        "ft_launcher sees its workers fail (the in-process layer tries first and gives up), tear down → it "
        "joins the next rendezvous round, rendezvous → the round with the spare closes (the lost node must be "
        "dropped first), start + restore → rank 0's `train_begin`, first step → `restart_end`.",
        "",
    ]
    rows = []
    for tp in lanes:
        spare = tp["spare"]
        target = f"≤ {SPARE_TARGET_S_NVRX07:g} s" if is_nvrx07(tp) else "no relaunch"
        median = (spare.get("recovery_s") or {}).get("median")
        met = spare["all_covered_in_job"] and (
            not is_nvrx07(tp) or (median is not None and median <= SPARE_TARGET_S_NVRX07)
        )
        rows.append(
            (
                lane_label(tp),
                f"{spare['nodes']} × {spare['procs_per_node']} ranks + {spare['spare_nodes']}",
                spare["recovery_s"].get("n", 0),
                fmt_stat(spare["recovery_s"]),
                fmt_stat(spare["promoted_s"]),
                spare_parts_text(spare.get("parts_median_s") or {}, fmt_s),
                f"{target}: {fmt_met(met)}",
            )
        )
    if cp_spare:
        rows.append(
            (
                f"NVRx {cp_spare.get('nvrx') or '?'}, driven through the control plane (below)",
                f"{cp_spare['nodes']} × {cp_spare['procs_per_node']} ranks + {cp_spare['spare_nodes']}",
                cp_spare["recovery_s"].get("n", 0),
                fmt_stat(cp_spare["recovery_s"]),
                fmt_stat(cp_spare["promoted_s"]),
                "—",
                "—",
            )
        )
    lines += md_table(
        (
            "lane",
            "nodes",
            "n",
            "fault → first step",
            "fault → spare trains (`spare_promoted`)",
            "breakdown (median)",
            "target",
        ),
        rows,
    )
    loads = []
    for tp in lanes:
        measured = (tp.get("measured") or {}).get("spare") or {}
        load = fmt_load({"load": measured["load"]}) if measured.get("load") else fmt_load(tp)
        loads.append(f"{lane_label(tp)}: {load}")
    lines += ["; ".join(loads) + ".", ""]
    lines += [
        "Why: NVRx 0.4.1's rendezvous drops a lost node only when its keep-alive expires, hard-coded in "
        "`FtRendezvousHandler.from_backend` at 5 s × 3 (not configurable: the benchmark leaves NVRx as "
        "shipped). NVRx 0.7's barrier rendezvous closes the next round as soon as enough nodes are there, "
        "after a `last_call_timeout_seconds` grace (1 s) for the previously active nodes. On both, the "
        "surviving node first waits for its in-process layer to give up on the lost ranks (the Wrapper's "
        "heartbeat timeout, max(5 s, hang timeout)), and the new workers' start (a fresh interpreter importing "
        "torch and NVRx, the model built, the checkpoint loaded, on 2 shared cores) comes on top. What NVRx "
        "0.7.0 adds to every in-job restart, read from its sources: tear down ≈ 1 s is a fixed "
        "`time.sleep(1.0)` between SIGTERM and SIGKILL of the workers' process groups "
        "(`fault_tolerance/utils.py: terminate_mp_processes`), and its rendezvous polls for the next round "
        "once a second (`ft_rendezvous_barrier.py`, Step 0); neither is configurable. Its one knob here, "
        "`last_call_timeout` (`--rdzv-conf`, whole seconds), would save at most that 1 s of the spare's "
        "rendezvous, and 0 would let a waiting spare close a round before a healthy node rejoins after a rank "
        "fault, so the product keeps the default.",
        "",
    ]
    return lines


def recovery_section(tp: dict[str, Any], cp: dict[str, Any], tp07: dict[str, Any] | None = None) -> list[str]:
    """### 2. Recovery per rung: the training plane's restarts (the NVRx 0.7 lane's first, when
    measured), the hot spare's takeover on each lane, the relaunch rung and the control plane's spare."""
    lines: list[str] = []
    lanes = [t for t in (tp07 or {}, tp) if t.get("recovery") or t.get("spare") or t.get("spares_used_up")]
    recovery = tp.get("recovery")
    relaunch = cp.get("relaunch")
    spare = cp.get("spare")
    if lanes or relaunch or spare:
        lines += ["### 2. Recovery per rung", ""]
    for lane in lanes:
        if lane.get("recovery"):
            lines += _recovery_table(lane, lane["recovery"], len(lanes))
    spare_lanes = [t for t in lanes if (t.get("spare") or {}).get("recovery_s")]
    if spare_lanes:
        lines += _spare_lanes_section(spare_lanes, spare)
    if relaunch:
        lines += [
            f"Relaunch after node replacement (local backend), control-plane time only: from the failed launch "
            f"giving up to the relaunch's first step; the watch (the deferred sensor's trigger) checks fully every "
            f"{relaunch['poll_interval_s']:.0f} s (the sensor's default) and looks for the launch's end (its `final` "
            f"event, or the launcher's exit) every {relaunch.get('change_tick_s', relaunch['poll_interval_s']):g} s "
            "in between. The ladder's functions run without Airflow's scheduler. "
            f"{fmt_load(cp)}.",
            "",
        ]
        rows = []
        for row in relaunch["rows"]:
            p = row["parts_median_s"]
            rows.append(
                (
                    row["kind"],
                    row["launch_failed_by"],
                    row["total_s"]["n"],
                    fmt_stat(row["total_s"]),
                    f"detect {fmt_s(p['detect'])} · diagnose + replace {fmt_s(p['diagnose_replace'])} · capacity + "
                    "submit "
                    f"{fmt_s(p['capacity_submit'])} · start + restore {fmt_s(p['start_restore'])} · first step "
                    f"{fmt_s(p['first_step'])}",
                    fmt_stat(row["data_plane_s"]),
                    f"≤ {row.get('target_s', 60):g} s: {fmt_met(row['target_met'])}",
                )
            )
        lines += md_table(
            (
                "fault (bad node)",
                "launch failed by",
                "n",
                "failed launch → first step",
                "breakdown (median)",
                "before it: fault → launch gave up",
                "target",
            ),
            rows,
        )
    lines += spares_used_up_section(lanes, relaunch)
    if spare:
        lines += _spare_section(spare, relaunch, cp, (tp07 or {}).get("spare"), tp.get("spares_used_up"))
    if recovery or relaunch:
        lines += ["![recovery per rung](/bench/results/recovery.png)", ""]
    return lines
