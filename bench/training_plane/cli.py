"""Main: parse the command line, run the parts asked for, write DIR/training_plane.json."""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from pathlib import Path
from typing import Any

from bench import training_plane as package
from bench.common import RESULTS, LoadMonitor, log, machine, write_json
from bench.training_plane.eval_load import bench_eval_load
from bench.training_plane.recovery import bench_recovery
from bench.training_plane.stall import bench_stall


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.training_plane", description=package.__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: one small size, two trials, tiny model; recovery only if asked for",
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder (default bench/results)")
    parser.add_argument(
        "--only",
        default=None,
        help="comma-separated parts: stall,eval_load,recovery (default all; quick: stall,eval_load)",
    )
    parser.add_argument(
        "--sizes-mb",
        type=lambda s: [int(x) for x in s.split(",")],
        default=None,
        help="checkpoint state sizes, total over ranks (default 50,200,1000; quick 16)",
    )
    parser.add_argument("--trials", type=int, default=None, help="timed trials per method (default 5; quick 2)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks for the stall bench (default 2)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--eval-model", default=None, help="model preset evaluated (default small; quick tiny)")
    parser.add_argument("--scratch", default=None, help="where checkpoints are written (default: the temp dir)")
    parser.add_argument("--seed", type=int, default=1234, help="seeds fault steps and ranks")
    parser.add_argument("--stall-timeout-s", type=float, default=900.0)
    parser.add_argument("--run-timeout-s", type=float, default=600.0)
    args = parser.parse_args(argv)
    args.out = args.out.resolve()  # absolute: subprocesses (and an SQLite URL) must not depend on the cwd
    args.only = [
        p.strip()
        for p in (args.only or ("stall,eval_load" if args.quick else "stall,eval_load,recovery")).split(",")
        if p.strip()
    ]
    args.sizes_mb = args.sizes_mb or ([16] if args.quick else [50, 200, 1000])
    args.trials = args.trials or (2 if args.quick else 5)
    args.eval_model = args.eval_model or ("tiny" if args.quick else "small")

    out: dict[str, Any] = {
        "bench": "training_plane",
        "quick": args.quick,
        "machine": machine(),
        "versions": {p: importlib.metadata.version(p) for p in ("torch", "nvidia-resiliency-ext")},
        "command": "python -m bench.training_plane " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    work = args.out / ("quick" if args.quick else "work")
    work.mkdir(parents=True, exist_ok=True)
    with LoadMonitor() as load:
        if "stall" in args.only or "eval_load" in args.only:
            log(f"stall: {args.nproc} ranks, sizes {args.sizes_mb} MB, {args.trials} trials")
            out["stall"] = bench_stall(args, work)
        if "eval_load" in args.only:
            log(f"eval_load: {args.eval_model}")
            out["eval_load"] = bench_eval_load(args, work)
        if "recovery" in args.only:
            out["recovery"] = bench_recovery(args, work)
    out["load"] = load.result()
    if "stall" not in args.only:
        out.pop("stall", None)
    path = write_json(args.out / ("training_plane.quick.json" if args.quick else "training_plane.json"), out)
    log(f"wrote {path}")
    return 0
