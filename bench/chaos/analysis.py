"""The chaos run's figures: ETTR and badput (steady state), time lost per fault, save costs, and the
Young/Daly model fed with the costs the run measured."""

from __future__ import annotations

import argparse
import math
import statistics
from typing import Any

from bench.common import daly_interval, ettr_model, summarize, young_interval
from bench.drive import relaunch_trials, spare_trials
from bench.restarts import injected_faults, launcher_marks, restart_trials, step_cadence
from fsdp_resilience.control.report.goodput import goodput
from fsdp_resilience.control.report.records import save_windows, step_executions, steps_during_saves
from fsdp_resilience.training.contract import RunConfig, read_events

#: Job-level MTBF of Llama 3 405B pre-training: 54 days, 419 unexpected interruptions.
LLAMA3_MTBF_S = 54 * 86400 / 419


def save_costs(events: list[dict[str, Any]], accounting: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint costs, measured in this run: the blocking time per save (the loop stops),
    the interference per save (steps slower than usual while the background writer shares the
    CPU: the report's ``checkpoint_interference``, badput like the blocking time), and the commit
    latency (save begins -> committed)."""
    windows = save_windows(events)
    blocking = [
        r["blocking_s"] for r in events if r.get("event") == "checkpoint_begin" and r.get("blocking_s") is not None
    ]
    commits = [r for r in events if r.get("event") == "checkpoint_commit"]
    _, slowed = steps_during_saves(step_executions(events), windows)
    during = [e.end - e.start for e in slowed]
    interference = accounting["badput_s"].get("checkpoint_interference", 0.0) / max(1, len(windows))
    block = statistics.median(blocking) if blocking else 0.0
    usual = accounting.get("usual_step_s")
    return {
        "blocking_s": summarize(blocking),
        "commit_s": summarize(c.get("save_s") for c in commits),
        "saves_committed": len(windows),
        "steps_during_a_save": len(during),
        "step_s_during_a_save": summarize(during),
        "step_s_otherwise_median": usual,
        "interference_ratio": round(statistics.median(during) / usual, 3) if during and usual else None,
        "interference_per_save_s": round(interference, 4),
        "blocking_median_s": round(block, 4),
        "blocking_plus_interference_s": round(block + interference, 4),
    }


def analyse(
    cfg: RunConfig, driven: dict[str, Any], planned: dict[str, Any], args: argparse.Namespace
) -> dict[str, Any]:
    events = read_events(cfg.layout.events)
    whole = goodput(events)
    # Steady state, as a multi-day run sees it: without the first start-up (launch -> the first
    # train_begin, all of it in the report's startup_restore) and the final shutdown (train_end ->
    # the launcher's final event, in its "other"), which such a run amortises.
    first_train = min(r["ts"] for r in events if r.get("event") == "train_begin")
    initial = max(0.0, first_train - whole["start_ts"])
    train_ends = [r["ts"] for r in events if r.get("event") == "train_end"]
    ended = driven.get("stopped_at") or (max(train_ends) if train_ends else whole["end_ts"])
    shutdown = max(0.0, whole["end_ts"] - ended)
    steady_b = dict(
        whole["badput_s"],
        startup_restore=whole["badput_s"].get("startup_restore", 0.0) - initial,
        other=max(0.0, whole["badput_s"].get("other", 0.0) - shutdown),
    )
    steady_wall = whole["wall_s"] - initial - shutdown
    steady = {
        "wall_s": steady_wall,
        "badput_s": steady_b,
        "ettr": whole["productive_s"] / steady_wall if steady_wall > 0 else None,
    }
    faults = injected_faults(events)
    marks = []
    for log_file in sorted(cfg.layout.logs.glob("*-node*.log")):
        marks += launcher_marks(log_file.read_text(errors="replace"))
    trials = restart_trials(events, sorted(marks))
    rungs = relaunch_trials(cfg, driven)
    n = len(faults)
    b = steady["badput_s"]
    restart_s = sum(v for k, v in b.items() if k.startswith("restart_")) + b.get("startup_restore", 0.0)
    lost = b.get("lost_progress", 0.0)
    per_fault = (restart_s + lost) / n if n else None
    costs = save_costs(events, whole)
    cadence = step_cadence(events) or planned["interval_s_target"] / planned["interval_steps"]
    interval_s = planned["interval_steps"] * cadence
    loop_overhead = b.get("other", 0.0) / steady["wall_s"] if steady["wall_s"] else 0.0
    restart_per_fault = restart_s / n if n else 0.0
    # What a save costs the training loop: its blocking time and the interference of its writer.
    delta = costs["blocking_median_s"]
    interference = costs["interference_per_save_s"]
    commit = costs["commit_s"].get("median") or 0.0
    realised_mtbf = steady["wall_s"] / n if n else math.inf

    def model(interval: float, mtbf: float) -> float:
        return round(
            ettr_model(
                interval,
                save_cost_s=delta + interference,
                mtbf_s=mtbf,
                restart_s=restart_per_fault,
                commit_s=commit,
                loop_overhead=loop_overhead,
            ),
            4,
        )

    young_daly = []
    for label, mtbf in (
        ("this run (realised)", realised_mtbf),
        ("target: one fault per 10 min", args.target_mtbf_s),
        ("Llama 3 405B job (54 d, 419 faults)", LLAMA3_MTBF_S),
    ):
        tau = young_interval(delta + interference, mtbf)
        young_daly.append(
            {
                "mtbf": label,
                "mtbf_s": round(mtbf, 1),
                "young_interval_s": round(tau, 3),
                "daly_interval_s": round(daly_interval(delta + interference, mtbf), 3),
                "interval_steps": max(1, round(tau / cadence)),
                "ettr": {"half": model(tau / 2, mtbf), "young_daly": model(tau, mtbf), "double": model(2 * tau, mtbf)},
            }
        )
    target_row = young_daly[1]
    # What a node loss cost here: the fault -> the next completed step, by whichever rung
    # recovered it (a relaunch without spares, an in-job restart onto a spare with them).
    node_losses = [t for t in trials if t["kind"] == "node_loss"]
    node_loss = {
        "n": len(node_losses),
        "recovered_by": sorted({t["layer"] for t in node_losses if t.get("layer")}),
        "fault_to_next_step_s": summarize(t.get("measured_s") for t in node_losses),
        "relaunches": len(driven["rungs"]),
    }
    if cfg.spare_nodes:
        spares = spare_trials(cfg, driven)
        node_loss.update(
            spare_nodes=cfg.spare_nodes,
            covered_by_a_spare=sum(1 for t in spares if t["recovery_s"] is not None and not t["relaunched"]),
            refill_s=summarize(t["refill_s"] for t in spares),
            spare_trials=spares,
            refills=driven.get("refills") or [],
            promotions=sum(1 for r in events if r.get("event") == "spare_promoted"),
        )
    by_kind: dict[str, list[float]] = {}
    for t in trials:
        if t.get("latency_s") is not None:
            by_kind.setdefault(f"{t['kind']} → {t['layer']}", []).append(t["latency_s"])
    return {
        "wall_s": round(whole["wall_s"], 1),
        "meets_min_duration": whole["wall_s"] >= args.duration_s,
        "ettr": round(whole["ettr"], 4) if whole["ettr"] is not None else None,
        "ettr_steady": round(steady["ettr"], 4) if steady["ettr"] is not None else None,
        "initial_startup_s": round(initial, 2),
        "final_shutdown_s": round(shutdown, 2),
        "badput_s": {k: round(v, 2) for k, v in whole["badput_s"].items()},
        "badput_steady_s": {k: round(v, 2) for k, v in b.items()},
        "productive_s": round(whole["productive_s"], 1),
        "steps": whole["last_step"],
        "faults_injected": n,
        "faults_by_kind": {
            k: sum(1 for f in faults if f.get("kind") == k) for k in sorted({f.get("kind") for f in faults})
        },
        "faults_scheduled": planned["n_faults"],
        "lost_per_fault_s": round(per_fault, 2) if per_fault is not None else None,
        "lost_per_fault_parts_s": {
            "restart_and_restore": round(restart_per_fault, 2),
            "lost_progress": round(lost / n, 2) if n else None,
        },
        "recovery_by_kind_s": {k: summarize(v) for k, v in sorted(by_kind.items())},
        "relaunches": rungs,
        "launches": driven["launches"],
        "rungs": driven["rungs"],
        "node_loss": node_loss,
        "save_costs": costs,
        "step_cadence_s": round(cadence, 4),
        "interval_s": round(interval_s, 3),
        "model": {
            "formula": "ETTR = (1 - loop_overhead - (C + I)/T) * (1 - (R + T/2 + W)/MTBF)",
            "C_save_cost_s": delta,
            "I_interference_per_save_s": interference,
            "R_restart_per_fault_s": round(restart_per_fault, 3),
            "W_commit_s": commit,
            "loop_overhead": round(loop_overhead, 4),
            "check": {
                "measured_ettr_steady": round(steady["ettr"], 4) if steady["ettr"] else None,
                "model_at_this_run": model(interval_s, realised_mtbf),
            },
        },
        "young_daly": young_daly,
        "targets": {
            "ETTR >= 0.85 at one fault per minute (measured, whole run)": (whole["ettr"] or 0.0) >= 0.85,
            "ETTR >= 0.97 at one fault per 10 min (modeled, Young/Daly interval)": target_row["ettr"]["young_daly"]
            >= 0.97,
            "<= 10 s lost per fault (measured)": per_fault is not None and per_fault <= 10.0,
        },
    }
