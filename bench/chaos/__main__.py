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
import shutil
import sys
import time
from pathlib import Path

from bench.chaos.analysis import analyse
from bench.chaos.calibration import calibration
from bench.chaos.schedule import plan, stop_when_done
from bench.common import (
    LLAMA3_INTERRUPTIONS,
    RESULTS,
    RUN_SETTINGS,
    TRAINING_PYTHON,
    LoadMonitor,
    drill_weights,
    ensure_dataset,
    free_port,
    log,
    machine,
    write_json,
)
from bench.drive import drive
from fsdp_resilience.control.report.build import build_report
from fsdp_resilience.control.task_data import Run
from fsdp_resilience.training.contract import RunConfig


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
