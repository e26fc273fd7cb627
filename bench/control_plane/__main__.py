"""Control-plane benchmarks, run with the control-plane venv (Airflow; torch is never imported):

    .venv-airflow/bin/python -m bench.control_plane [--quick] [--out DIR] [--only PART,...]

(the parts: parse, watch, slots, relaunch, spare, scale)

parse     DAG parse time of dags/ (torch blocked): with the plugin modules imported fresh for
          each parse, and with them already imported (Airflow's DAG processor pre-imports a DAG
          file's imports before it forks the parser).
watch     Checkpoint commit -> the watch sees it: ``TrainingProgressTrigger`` driven with asyncio,
          as the triggerer runs it, against a run dir where checkpoints are committed with the
          contract's ``CheckpointCatalog``; and commit of the final step -> the trigger fires.
slots     Worker slots held while training runs: ``fsdp_training`` under ``dag.test()`` with
          real training; seconds of task execution (worker slots) against seconds of the
          deferred sensor's trigger, inside the training window. dag.test() runs every task and
          the trigger in one process, one at a time: it shows where the time is spent (task code
          or trigger), not how a real scheduler packs slots.
relaunch  The relaunch rung on the local backend, control-plane time only: from the failed launch
          giving up to the first step of the relaunch on a replaced node, per fault kind. Each
          launch is watched by the sensor's own trigger (a check every --poll-s, and a look for
          the launch's end every 0.2 s in between).
spare     Node loss with a hot spare on the local backend: nodes=2 + spare_nodes=1, the relaunch
          part's procs_per_node, a node_loss drill on node 1 (node 0 hosts the rendezvous store:
          no spare covers it), a run per trial, driven like the DAG (the watch watches on while
          the job stays running; the pool keeper quarantines the lost slot and adds a new spare).
          Per trial: fault -> the first step after it (no relaunch), and fault -> the pool whole
          again (spare_added).
scale     The EKS backend at 16 to 1,024 kwok nodes shaped like p5.48xlarge on the real control
          plane of the tests (eks_scale.py; quick: 32 and 128): a run on half the nodes with 2
          spares; per poll of the deferred watch, its API requests, bytes and CPU; diagnose and
          replace_nodes of 1, then 8, failed nodes (NotReady, a GPU condition False, pods exit 75).

Writes DIR/control_plane.json (default DIR: bench/results); with --merge, the parts measured
replace theirs in the existing file and the others stay. ``measured`` records when each part was
measured, with the load average of the run that measured it.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import shutil
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.common import PLUGINS, REPO, RESULTS, TRAINING_PYTHON, LoadMonitor, log, machine, read_json, write_json
from bench.control_plane.eks_scale import bench_scale
from bench.control_plane.hot_spare import bench_spare
from bench.control_plane.parse_time import bench_parse
from bench.control_plane.relaunch import RELAUNCH_FAULTS, bench_relaunch
from bench.control_plane.watch_latency import bench_watch
from bench.control_plane.worker_slots import bench_slots

#: The parts, in the order they run.
PARTS = ("parse", "watch", "slots", "relaunch", "spare", "scale")


def airflow_env(work: Path) -> dict[str, str]:
    """A private Airflow home (SQLite) with this repo's DAGs and plugins."""
    home = work / "airflow-home"
    return {
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(PLUGINS),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}",
        "FSDP_RUNS_ROOT": str(work / "runs"),
        "FSDP_DATA_ROOT": str(work / "data"),
        "TRAINING_PYTHON": str(TRAINING_PYTHON),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.control_plane", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: parse and watch only, few trials")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--only", default=None, help="comma-separated parts (default all; quick: parse,watch)")
    parser.add_argument("--parse-trials", type=int, default=None, help="default 7; quick 2")
    parser.add_argument("--commits", type=int, default=None, help="watch trials (default 8; quick 3)")
    parser.add_argument(
        "--poll-s", type=float, default=None, help="the watch's poll interval (default 5, the sensor's)"
    )
    parser.add_argument("--slots-steps", type=int, default=12)
    parser.add_argument("--relaunch-faults", default=",".join(RELAUNCH_FAULTS))
    parser.add_argument(
        "--spare-trials", type=int, default=None, help="spare part trials, a run each (default 2; quick 1)"
    )
    parser.add_argument(
        "--scale-sizes", default=None, help="scale part's cluster sizes (default 16,64,256,1024; quick 32,128)"
    )
    parser.add_argument("--scale-polls", type=int, default=None, help="watch polls per size (default 20; quick 10)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument(
        "--merge",
        action="store_true",
        help="merge the parts measured into the existing results file instead of replacing it",
    )
    args = parser.parse_args(argv)
    args.out = args.out.resolve()  # absolute: subprocesses (and an SQLite URL) must not depend on the cwd
    only = [p.strip() for p in (args.only or ("parse,watch,scale" if args.quick else ",".join(PARTS))).split(",")]
    unknown = sorted(set(only) - set(PARTS))
    if unknown:
        parser.error(f"--only: unknown part(s) {', '.join(unknown)}; the parts are {', '.join(PARTS)}")
    work = args.out / ("quick" if args.quick else "work") / "control"
    shutil.rmtree(work / "airflow-home", ignore_errors=True)
    (work / "airflow-home").mkdir(parents=True, exist_ok=True)
    os.environ.update(airflow_env(work))  # before Airflow is imported
    out: dict[str, Any] = {
        "bench": "control_plane",
        "quick": args.quick,
        "machine": machine(),
        "versions": {p: importlib.metadata.version(p) for p in ("apache-airflow",)},
        "command": "python -m bench.control_plane " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    began: dict[str, float] = {}
    with LoadMonitor() as load:
        if "parse" in only:
            began["parse"] = time.time()
            log("parse: DAG parse time")
            out["parse"] = bench_parse(args.parse_trials or (2 if args.quick else 7))
        if "watch" in only:
            poll = args.poll_s or (0.5 if args.quick else 5.0)
            log(f"watch: commit -> trigger sees it, poll {poll}s")
            began["watch"] = time.time()
            out["watch"] = bench_watch(work, args.commits or (3 if args.quick else 8), poll, args.seed)
        if "slots" in only:
            log("slots: fsdp_training under dag.test()")
            began["slots"] = time.time()
            out["slots"] = bench_slots(work, args.slots_steps)
        if "relaunch" in only:
            kinds = tuple(k for k in args.relaunch_faults.split(",") if k)
            log(f"relaunch: {kinds}")
            began["relaunch"] = time.time()
            out["relaunch"] = bench_relaunch(work, kinds, args.poll_s or 5.0)
        if "spare" in only:
            trials = args.spare_trials or (1 if args.quick else 2)
            log(f"spare: node loss with a hot spare, {trials} trial(s)")
            began["spare"] = time.time()
            out["spare"] = bench_spare(work, trials, args.poll_s or 5.0, out.get("relaunch"))
        if "scale" in only:
            sizes = [int(n) for n in (args.scale_sizes or ("32,128" if args.quick else "16,64,256,1024")).split(",")]
            log(f"scale: the EKS backend at {sizes} nodes on the real control plane")
            began["scale"] = time.time()
            out["scale"] = bench_scale(
                work, sizes, args.scale_polls or (10 if args.quick else 20), eks_heartbeat=max(sizes) > 256
            )
    out["load"] = load.result()
    out["measured"] = {
        part: {
            "at": datetime.fromtimestamp(began[part]).astimezone().isoformat(timespec="seconds"),
            "command": out["command"],
            "load": out["load"],
        }
        for part in only
    }
    path = args.out / ("control_plane.quick.json" if args.quick else "control_plane.json")
    if args.merge and path.exists():
        previous = read_json(path)
        measured = previous.get("measured") or {
            part: {
                "at": (previous.get("load") or {}).get("started_at"),
                "command": previous.get("command"),
                "load": previous.get("load"),
            }
            for part in PARTS
            if part in previous
        }
        # The file's own load and command stay those of the run that measured most of it.
        out = {**previous, **{part: out[part] for part in only}, "measured": {**measured, **out["measured"]}}
    path = write_json(path, out)
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
