"""Main: parse the command line, run the parts asked for, write DIR/training_plane.json."""

from __future__ import annotations

import argparse
import importlib.metadata
import platform
import sys
from pathlib import Path
from typing import Any

from bench import training_plane as package
from bench.common import RESULTS, LoadMonitor, log, machine, read_json, write_json
from bench.training_plane.eval_load import bench_eval_load
from bench.training_plane.recovery import bench_recovery
from bench.training_plane.spare import bench_spare_takeover
from bench.training_plane.spares_used_up import bench_spares_used_up
from bench.training_plane.stall import bench_stall

#: The parts, in the order they run (the default: all of them).
PARTS = ("stall", "eval_load", "recovery", "spare", "spares_used_up")
#: Where the training plane runs: the project's .venv (the NVRx that installs natively here), or
#: the NVRx 0.7 test lane's Debian testing root (tests/nvrx07/lane.sh --bench).
LANES = {
    "venv": ".venv",
    "nvrx07": "Debian testing chroot",
}


def lane_label(lane: str, versions: dict[str, str], python: str) -> str:
    """How the results name their lane, e.g. "NVRx 0.7.0 (Debian testing chroot, Python 3.14,
    Debian CPU torch 2.14.1)" or "NVRx 0.4.1 (.venv, Python 3.11, torch 2.13.0+cpu)"."""
    torch = versions.get("torch", "?")
    if lane == "nvrx07":
        torch = "Debian CPU torch " + torch.split("+")[0]
    else:
        torch = "torch " + torch
    py = ".".join(python.split(".")[:2])
    return f"NVRx {versions.get('nvidia-resiliency-ext', '?')} ({LANES[lane]}, Python {py}, {torch})"


def merge_parts(old: dict[str, Any], new: dict[str, Any], parts: list[str]) -> dict[str, Any]:
    """``old`` results with the ``parts`` measured again from ``new``: the parts not run stay, and
    so does the record of the load they were measured under (``load``); the new parts' load and
    time go to ``measured[part]``, and ``versions``/``lane`` to the new run's."""
    merged = {**old}
    measured = dict(old.get("measured") or {})
    for part in parts:
        if part in new:
            merged[part] = new[part]
            measured[part] = {"load": new.get("load"), "command": new.get("command")}
    merged["measured"] = measured
    for key in ("versions", "lane", "machine"):
        if key in new:
            merged[key] = new[key]
    return merged


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
        help="comma-separated parts: stall,eval_load,recovery,spare,spares_used_up (default all; quick: "
        "stall,eval_load)",
    )
    parser.add_argument(
        "--lane",
        default="venv",
        choices=sorted(LANES),
        help="where this runs, for the results' label (nvrx07: inside tests/nvrx07/lane.sh --bench)",
    )
    parser.add_argument(
        "--name",
        default="training_plane",
        help="results file stem: OUT/NAME.json (quick: NAME.quick.json); runs go to OUT/work/NAME "
        "(OUT/work itself for the default)",
    )
    parser.add_argument(
        "--spare-trials",
        type=int,
        default=None,
        help="runs of each hot-spare part, the takeover and the spares used up (default 2; quick 1)",
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
    parser.add_argument(
        "--recovery-modes",
        type=lambda s: [m.strip() for m in s.split(",") if m.strip()],
        default=None,
        help="only these recovery runs: layered,injob,torchrun (default all; quick: one layered exception)",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="update OUT/NAME.json with the parts run (the others, and the top-level load record, stay; "
        "this run's load goes to measured.PART)",
    )
    args = parser.parse_args(argv)
    args.out = args.out.resolve()  # absolute: subprocesses (and an SQLite URL) must not depend on the cwd
    args.only = [
        p.strip() for p in (args.only or ("stall,eval_load" if args.quick else ",".join(PARTS))).split(",") if p.strip()
    ]
    args.sizes_mb = args.sizes_mb or ([16] if args.quick else [50, 200, 1000])
    args.trials = args.trials or (2 if args.quick else 5)
    args.eval_model = args.eval_model or ("tiny" if args.quick else "small")
    args.spare_trials = args.spare_trials or (1 if args.quick else 2)
    unknown = set(args.only) - set(PARTS)
    if unknown:
        parser.error(f"unknown part(s) {', '.join(sorted(unknown))}: {', '.join(PARTS)}")
    versions = {p: importlib.metadata.version(p) for p in ("torch", "nvidia-resiliency-ext")}

    out: dict[str, Any] = {
        "bench": "training_plane",
        "quick": args.quick,
        "machine": machine(),
        "versions": versions,
        "lane": {"name": args.lane, "label": lane_label(args.lane, versions, platform.python_version())},
        "command": "python -m bench.training_plane " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    work = args.out / ("quick" if args.quick else "work")
    if args.name != "training_plane":
        work = work / args.name
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
        if "spare" in args.only:
            log(f"spare: {args.spare_trials} trial(s), 2 nodes + 1 spare, node 1 lost")
            out["spare"] = bench_spare_takeover(args, work, args.spare_trials)
        if "spares_used_up" in args.only:
            log(f"spares_used_up: {args.spare_trials} trial(s), 2 nodes + 1 spare, two node losses, then a relaunch")
            out["spares_used_up"] = bench_spares_used_up(args, work, args.spare_trials)
    out["load"] = load.result()
    if "stall" not in args.only:
        out.pop("stall", None)
    target = args.out / (f"{args.name}.quick.json" if args.quick else f"{args.name}.json")
    if args.merge and target.exists():
        out = merge_parts(read_json(target), out, args.only)
    path = write_json(target, out)
    log(f"wrote {path}")
    return 0
