"""Goodput under chaos: one training run of at least 10 minutes with a seeded fault schedule whose
mix follows the causes of Llama 3's unexpected interruptions, driven end to end like the
fsdp_training DAG (local backend; node losses climb the escalation ladder and relaunch).

    .venv-airflow/bin/python -m bench.chaos [--duration-s 600] [--mtbf-s 60] [--seed 1234] [--spare-nodes N]

Reports ETTR (productive time / wall time) and the badput breakdown with the run report's own
accounting (``fsdp_resilience.control.report.goodput``), the time lost per fault, and the checkpoint
interval the Young/Daly rule picks from the measured save cost for a given MTBF, with the ETTR
at that interval, 2x and 1/2x. Those three ETTRs come from a first-order model fed with the
costs this run measured (three more 10-minute runs do not fit the 30-minute budget of `make
bench`); the model is checked against the measured ETTR of this run.

The fault rate is one per ``--mtbf-s`` (60 s: ten faults in ten minutes, enough to follow the
mix); the target "ETTR >= 0.97 at one fault per 10 minutes" is evaluated with the model. The run
is stopped (its launch cancelled, as a user would) once it has lasted ``--duration-s`` and
recovered from every fault; the final shutdown is left out of the steady-state figures.
Step time and save cost come from a short fault-free run just before (restart costs, used only to
size the run, from bench/results/training_plane.json when it exists).

With ``--spare-nodes N`` (N >= 1; 2 nodes x 1 process unless --nodes/--procs-per-node say
otherwise) the run keeps N hot spares: node losses hit the last training node, never node 0
(it hosts the rendezvous store, which no spare covers), a spare takes its place in an in-job
restart, and the spare pool is refilled while training goes on (``spare_refill.keep_spare_pool``, run
by ``bench.drive`` next to the watch as the DAG's keep_spare_pool task; each refill spends one of
max_node_replacements). Results go to chaos_spares.json (plots chaos_spares-*.png), so a run
with and one without spares sit side by side. Which launchers train after an in-job restart is
the rendezvous's choice: on NVRx 0.4.1 a spare was seen taking a healthy node's place after a
rank's fault, and the restart round (which a rank's drill is keyed on) then does not advance as
predicted, so some scheduled faults may not fire: ``faults_injected`` against
``faults_scheduled`` says so.
Torch-free: runs in the control-plane venv; the training processes use the training venv.
"""

from __future__ import annotations

import argparse
import math
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from bench.common import (
    LLAMA3_INTERRUPTIONS,
    REPO,
    RESULTS,
    RUN_SETTINGS,
    TRAINING_PYTHON,
    LoadMonitor,
    apportion,
    assign_attempts,
    daly_interval,
    drill_weights,
    ensure_dataset,
    ettr_model,
    free_port,
    log,
    machine,
    nvrx_version,
    read_json,
    spread_schedule,
    summarize,
    write_json,
    young_interval,
)
from bench.drive import drive, relaunch_trials, spare_trials  # noqa: E402
from bench.restarts import injected_faults, launcher_marks, restart_trials, step_cadence  # noqa: E402
from fsdp_resilience.control.report.build import build_report  # noqa: E402
from fsdp_resilience.control.report.goodput import goodput  # noqa: E402
from fsdp_resilience.control.report.records import save_windows, step_executions, steps_during_saves  # noqa: E402
from fsdp_resilience.control.task_data import Run  # noqa: E402
from fsdp_resilience.training.contract import RunConfig, read_events  # noqa: E402

#: Job-level MTBF of Llama 3 405B pre-training: 54 days, 419 unexpected interruptions.
LLAMA3_MTBF_S = 54 * 86400 / 419
#: Seconds a fault of each kind costs on this machine when no calibration is at hand (restart,
#: without lost progress): used only to size the run so it lasts the requested duration.
DEFAULT_COST_S = {
    "exception": 5.0,
    "hang": 6.0,
    "checkpoint_crash": 4.0,
    "sigkill": 14.0,
    "oom": 14.0,
    "sigstop": 35.0,
    "node_loss": 35.0,
}
STARTUP_S = 25.0


CALIBRATION_STEPS = 60


def calibration(args: argparse.Namespace, work: Path, dataset: Path) -> dict[str, Any]:
    """Step cadence and save cost from a short fault-free run of the same model and settings,
    just before the chaos run (the load on a shared machine changes by the minute; an older
    measurement would misplace the faults in time), unless both are given on the command line;
    and each fault kind's restart cost from the recovery bench (only used to size the run)."""
    cal: dict[str, Any] = {"cost_s": dict(DEFAULT_COST_S), "nvrx": nvrx_version()}
    recovery_json = args.calibration or args.out / "training_plane.json"
    if recovery_json.exists():
        for row in (read_json(recovery_json).get("recovery") or {}).get("rows") or []:
            if row.get("restart_mode") == "layered" and row["latency_s"].get("n"):
                cal["cost_s"][row["kind"]] = row["latency_s"]["median"]
        cal["cost_source"] = str(
            recovery_json.relative_to(REPO) if recovery_json.is_relative_to(REPO) else recovery_json
        )
    if args.step_time_s and args.save_cost_s:
        return {**cal, "source": "command line", "step_time_s": args.step_time_s, "save_cost_s": args.save_cost_s}
    run_dir = work / "calibration"
    cfg = RunConfig(
        **{
            **RUN_SETTINGS,
            "model": args.model,
            "run_id": "chaos-calibration",
            "run_dir": str(run_dir),
            "dataset_dir": str(dataset),
            "nodes": args.nodes,
            "procs_per_node": args.procs_per_node,
            "steps": CALIBRATION_STEPS,
            "checkpoint_interval": 10,
            "restart_mode": "layered",
            "rdzv_port": free_port(),
        }
    )
    cfg_path = work / "calibration.json"
    cfg_path.write_text(cfg.to_json())
    # Every node of the calibration run: one fsdp_resilience.training.launch each, as the local backend starts them.
    logs = [open(work / f"calibration-node{i}.log", "w") for i in range(cfg.nodes)]
    nodes: list[subprocess.Popen] = []
    try:
        nodes += [
            subprocess.Popen(
                [
                    str(TRAINING_PYTHON),
                    "-m",
                    "fsdp_resilience.training.launch",
                    "--config",
                    str(cfg_path),
                    "--node-rank",
                    str(i),
                    "--rdzv-host",
                    "127.0.0.1",
                ],
                cwd=REPO,
                stdout=log_file,
                stderr=subprocess.STDOUT,
            )
            for i, log_file in enumerate(logs)
        ]
        rc = max(node.wait(timeout=600) for node in nodes)
    finally:
        for node in nodes:
            if node.poll() is None:  # timed out: leave no launcher behind
                node.kill()
        for log_file in logs:
            log_file.close()
    events = read_events(cfg.layout.events)
    blocking = [r["blocking_s"] for r in events if r.get("event") == "checkpoint_begin"][1:]  # not the writer's boot
    cadence = step_cadence(events)
    if rc != 0 or cadence is None or not blocking:
        raise RuntimeError(f"the calibration run failed (exit {rc}); see {work}/calibration-node*.log")
    # A save costs the loop its blocking time and its writer's interference with the steps.
    costs = save_costs(events, goodput(events))
    save_cost = statistics.median(blocking) + costs["interference_per_save_s"]
    return {
        **cal,
        "source": f"calibration run ({CALIBRATION_STEPS} steps, no faults)",
        "step_time_s": args.step_time_s or cadence,
        "save_cost_s": args.save_cost_s or save_cost,
        "calibration_save_costs": costs,
    }


def plan(args: argparse.Namespace, cal: dict[str, Any]) -> dict[str, Any]:
    """The run: checkpoint interval (Young/Daly at the run's fault rate), fault kinds by the Llama 3
    mix, and the seeded schedule spread over the steps expected in ``duration_s``. The step count
    is a ceiling (twice that): the benchmark stops the run once it has lasted ``duration_s`` and
    recovered from every fault, so a faster or slower machine than calibrated still gets a run
    of the requested length with every fault in it."""
    n_faults = max(1, round(args.duration_s / args.mtbf_s))
    counts = apportion(n_faults, drill_weights())
    kinds = [k for k, c in counts.items() for _ in range(c)]
    random.Random(args.seed).shuffle(kinds)
    interval_s = young_interval(cal["save_cost_s"], args.mtbf_s)
    interval = max(1, round(interval_s / cal["step_time_s"]))
    lost_s = n_faults * (interval * cal["step_time_s"] / 2)
    fault_s = sum(cal["cost_s"].get(k, DEFAULT_COST_S[k]) for k in kinds)
    expected = max(40 * n_faults, math.ceil((args.duration_s - STARTUP_S - fault_s - lost_s) / cal["step_time_s"]))
    gap = max(3 * interval + 4, 12)
    drills = spread_schedule(
        kinds,
        first_step=max(2 * interval + 5, 20),
        last_step=int(0.95 * expected),
        min_gap=gap,
        interval=interval,
        world_size=args.nodes * args.procs_per_node,
        seed=args.seed,
    )
    # Without spares each drill is tied to its launch's slot (a relaunch replays steps); with
    # spares a node loss fires on any round, at node 1 and then at the spares (assign_attempts).
    return {
        "n_faults": n_faults,
        "counts": counts,
        "interval_steps": interval,
        "interval_s_target": interval_s,
        "expected_steps": expected,
        "steps": 2 * expected,
        "drills": assign_attempts(
            drills,
            "layered",
            slot_prefix=None if args.spare_nodes else "slot-",
            nodes=args.nodes,
            procs_per_node=args.procs_per_node,
            spare_nodes=args.spare_nodes,
        ),
    }


def stop_when_done(cfg: RunConfig, duration_s: float, n_faults: int, limit_s: float) -> Callable[[], bool]:
    """True once the run has lasted ``duration_s`` (from its first launch) and every scheduled
    fault fired and was recovered from (a step completed after the last one); or at ``limit_s``."""

    def stop() -> bool:
        events = read_events(cfg.layout.events)
        begins = [r["ts"] for r in events if r.get("event") == "launch_begin"]
        if not begins:
            return False
        lasted = time.time() - min(begins)
        if lasted >= limit_s:
            return True
        if lasted < duration_s:
            return False
        faults = injected_faults(events)
        return len(faults) >= n_faults and any(
            r.get("event") == "restart_end" and r["ts"] > faults[-1]["ts"] for r in events
        )

    return stop


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--duration-s", type=float, default=600.0, help="minimum wall time of the run (default 600)")
    parser.add_argument("--mtbf-s", type=float, default=60.0, help="one fault per this many seconds (default 60)")
    parser.add_argument("--target-mtbf-s", type=float, default=600.0, help="the MTBF of the ETTR target (default 600)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--model", default=RUN_SETTINGS["model"])
    parser.add_argument("--step-time-s", type=float, default=None, help="override the calibrated step cadence")
    parser.add_argument("--save-cost-s", type=float, default=None, help="override the calibrated save cost")
    parser.add_argument(
        "--calibration",
        type=Path,
        default=None,
        help="training-plane results to calibrate from (default OUT/training_plane.json)",
    )
    parser.add_argument(
        "--spare-nodes",
        type=int,
        default=0,
        help="hot spares the run keeps (default 0); with N > 0 results go to chaos_spares.json",
    )
    parser.add_argument("--nodes", type=int, default=None, help="training nodes (default 1; with spares 2)")
    parser.add_argument(
        "--procs-per-node",
        type=int,
        default=None,
        help="ranks per node (default 2; with spares 1: the same 2 ranks either way)",
    )
    args = parser.parse_args(argv)
    args.nodes = args.nodes or (2 if args.spare_nodes else 1)
    args.procs_per_node = args.procs_per_node or (1 if args.spare_nodes else 2)
    if args.spare_nodes and args.nodes < 2:
        parser.error("--spare-nodes needs --nodes >= 2: node 0 hosts the rendezvous store, so no spare covers it")
    name = "chaos_spares" if args.spare_nodes else "chaos"
    args.out = args.out.resolve()  # absolute: subprocesses (and an SQLite URL) must not depend on the cwd
    work = args.out / "work" / name
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    dataset = ensure_dataset(args.out / "work" / "data" / "stdlib-text")
    log("chaos: calibration run")
    cal = calibration(args, work, dataset)
    planned = plan(args, cal)
    run_id = name.replace("_", "-")  # a run id names Kubernetes objects: no underscores
    cfg = RunConfig(
        **{
            **RUN_SETTINGS,
            "model": args.model,
            "run_id": run_id,
            "run_dir": str(work / run_id),
            "dataset_dir": str(dataset),
            "nodes": args.nodes,
            "spare_nodes": args.spare_nodes,
            "procs_per_node": args.procs_per_node,
            "steps": planned["steps"],
            "checkpoint_interval": planned["interval_steps"],
            "keep_checkpoints": 3,
            "restart_mode": "layered",
            "max_restarts": 50,
            "max_inprocess_restarts": 50,
            "stall_timeout_s": 600.0,
            "rdzv_port": free_port(),
            "faults": planned["drills"],
        }
    )
    # Each node loss spends one node replacement: a relaunch on a new slot without spares, a
    # refill of the spare pool (a new slot) with them; one more for a loss a spare misses.
    losses = planned["counts"].get("node_loss", 0)
    backend = {
        "name": "local",
        "state_dir": str(work / ".local-backend"),
        "slots": max(4, cfg.launch_nodes + losses + 1),
        "training_python": str(TRAINING_PYTHON),
    }
    run = Run(config=cfg.to_dict(), backend=backend, max_node_replacements=losses + 1)
    log(
        f"chaos: {planned['steps']} steps, interval {planned['interval_steps']} steps, {planned['n_faults']} faults "
        f"{planned['counts']}, calibration from {cal['source']}"
    )
    with LoadMonitor() as load:
        t0 = time.time()
        stop = stop_when_done(cfg, args.duration_s, planned["n_faults"], limit_s=1.5 * args.duration_s)
        driven = drive(run, poll_s=5.0, timeout_s=max(3 * args.duration_s, 900), stop=stop)
        wall = time.time() - t0
    result = analyse(cfg, driven, planned, args)
    paths = build_report(cfg.run_dir)  # the run report's own figures, for the README
    for png_name, png in ((f"{name}-timeline.png", paths.timeline_png), (f"{name}-goodput.png", paths.goodput_png)):
        shutil.copyfile(png, args.out / png_name)
    out = {
        "bench": name,
        "machine": machine(),
        "load": load.result(),
        "topology": {
            "nodes": cfg.nodes,
            "procs_per_node": cfg.procs_per_node,
            "spare_nodes": cfg.spare_nodes,
            "world_size": cfg.world_size,
        },
        "command": "python -m bench.chaos " + " ".join(argv if argv is not None else sys.argv[1:]),
        "driver_wall_s": round(wall, 1),
        "run_dir": cfg.run_dir,
        "seed": args.seed,
        "mtbf_s": args.mtbf_s,
        "duration_s": args.duration_s,
        "calibration": cal,
        "plan": planned,
        "mix": [
            {"cause": c, "count": n, "paper_pct": p, "drill": d, "why": w} for c, n, p, d, w in LLAMA3_INTERRUPTIONS
        ],
        "drill_shares": {k: round(v, 4) for k, v in drill_weights().items()},
        "outcome": driven["launches"][-1]["outcome"] if driven["launches"] else None,
        "stopped_because": driven.get("stopped_because"),
        **result,
    }
    path = write_json(args.out / f"{name}.json", out)
    log(
        f"chaos: wall {result['wall_s']}s, ETTR {result['ettr']} (steady {result['ettr_steady']}), "
        f"{result['faults_injected']} faults, {result['lost_per_fault_s']}s lost per fault -> {path}"
    )
    return 0 if out["outcome"] in ("success", "stopped") else 1


if __name__ == "__main__":
    sys.exit(main())
