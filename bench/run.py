"""`make bench`: every benchmark, each with the environment of its plane, then the summary.

    python -m bench.run [--quick] [--out bench/results] [--skip chaos,...] [--only PART[,PART]]

  1. training plane  (.venv: torch, NVRx)         python -m bench.training_plane
  2. goodput under chaos (.venv-airflow)         python -m bench.chaos --duration-s 480   (full run only)
  3. the same with a hot spare (.venv-airflow)   python -m bench.chaos --duration-s 480 --spare-nodes 1
  4. control plane   (.venv-airflow: Airflow)    python -m bench.control_plane
  5. summary, plots, docs/benchmarks.md           python -m bench.summarize

The chaos runs calibrate their step time and save cost from a short run of their own, and their
restart costs from step 1's results. Each lasts 480 s (8 faults at one per minute, one of them a
node loss) rather than 600 s, so the two of them side by side keep `make bench` within 30
minutes on 2 cores.

``--only`` runs just the named parts and merges their results into those already in --out, so
a few figures can be measured again while the others stay: the parts are training_plane, chaos,
chaos_spares, control_plane, and the control plane's own parts parse, watch, slots, relaunch,
spare and scale (the EKS backend at 16 to 1,024 kwok nodes; run with ``bench.control_plane
--only ... --merge``). run.json records when each part
was measured. A part that fails is reported and the others still run; the exit code says whether
all succeeded. Standard library only: any python3 can run this driver.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

from bench.common import AIRFLOW_PYTHON, REPO, RESULTS, TRAINING_PYTHON, log, machine, read_json, write_json

#: The chaos runs' length in `make bench` (see the docstring).
CHAOS_DURATION_S = 480
#: (part, python, module, arguments); full runs only for the chaos parts.
PARTS = (
    ("training_plane", TRAINING_PYTHON, "bench.training_plane", []),
    ("chaos", AIRFLOW_PYTHON, "bench.chaos", ["--duration-s", str(CHAOS_DURATION_S)]),
    ("chaos_spares", AIRFLOW_PYTHON, "bench.chaos", ["--duration-s", str(CHAOS_DURATION_S), "--spare-nodes", "1"]),
    ("control_plane", AIRFLOW_PYTHON, "bench.control_plane", []),
)
FULL_RUN_ONLY = {"chaos", "chaos_spares"}
#: The control plane's own parts, which --only may name one by one.
CONTROL_PLANE_PARTS = ("parse", "watch", "slots", "relaunch", "spare", "scale")


def _now(t: float) -> str:
    return datetime.fromtimestamp(t).astimezone().isoformat(timespec="seconds")


def seed_from_summary(out: Path) -> None:
    """Only latest.json (the summary) is committed, not the per-part files it was made from: on a
    fresh clone, write those back from it, so that --only merges into the committed figures."""
    from bench.summarize.results import PARTS as PART_FILES
    from bench.summarize.results import SUMMARY

    latest = out / SUMMARY
    if not latest.exists():
        return
    summary = read_json(latest)
    for part, name in {**PART_FILES, "run": "run.json"}.items():
        if not (out / name).exists() and summary.get(part):
            write_json(out / name, summary[part])
            log(f"{name}: taken from {latest.name} (the committed figures) to merge into")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run of the same scripts (about a minute)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder (default bench/results)")
    parser.add_argument(
        "--skip", default="", help="comma-separated parts to leave out: " + ",".join(name for name, *_ in PARTS)
    )
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated parts to run, merged into the results already in "
        "--out: " + ",".join(name for name, *_ in PARTS) + " or the control plane's " + ",".join(CONTROL_PLANE_PARTS),
    )
    args = parser.parse_args(argv)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    known = {name for name, *_ in PARTS} | set(CONTROL_PLANE_PARTS)
    if (skip | only) - known:
        parser.error(
            f"unknown part(s) {', '.join(sorted((skip | only) - known))}; the parts are {', '.join(sorted(known))}"
        )
    if only and skip:
        parser.error("give --only or --skip, not both")
    control_parts = [p for p in CONTROL_PLANE_PARTS if p in only]
    if control_parts and "control_plane" in only:
        parser.error(
            f"--only control_plane runs all its parts; name either it or some of {', '.join(CONTROL_PLANE_PARTS)}"
        )
    for python in (TRAINING_PYTHON, AIRFLOW_PYTHON):
        if not Path(python).exists():
            print(f"error: {python} is missing; run `make setup` first", file=sys.stderr)
            return 2
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    command = (
        ("make bench-quick" if args.quick else "make bench")
        if not argv and not only and not skip
        else "python -m bench.run " + " ".join(argv if argv is not None else sys.argv[1:])
    )
    run_json = args.out / ("run.quick.json" if args.quick else "run.json")
    if only and not args.quick:
        seed_from_summary(args.out)
    if only and run_json.exists():
        # Merge: the figures not measured again keep the record of when they were.
        record = read_json(run_json)
        for part in record.get("parts", {}).values():
            part.setdefault("measured_at", record.get("started_at"))
        update = {"command": command, "started_at": _now(started), "parts": []}
        record.setdefault("updates", []).append(update)
    else:
        record = {"command": command, "started_at": _now(started), "machine": machine(), "parts": {}}
        update = None
    failed = []
    out = str(args.out.resolve().relative_to(REPO)) if args.out.resolve().is_relative_to(REPO) else str(args.out)
    for name, python, module, extra in PARTS:
        if args.quick and name in FULL_RUN_ONLY:
            continue
        if name in skip or (only and name not in only and not (name == "control_plane" and control_parts)):
            continue
        command_line = (
            [str(python), "-W", "ignore", "-m", module, "--out", out] + extra + (["--quick"] if args.quick else [])
        )
        key = name
        if name == "control_plane" and control_parts:
            command_line += ["--only", ",".join(control_parts), "--merge"]
            key = "control_plane." + "+".join(control_parts)
        log(f"{key}: {' '.join(command_line[3:])}")
        t0 = time.time()
        rc = subprocess.run(command_line, cwd=REPO).returncode
        record["parts"][key] = {
            "exit_code": rc,
            "wall_s": round(time.time() - t0, 1),
            "measured_at": _now(t0),
            "command": " ".join(command_line[3:]),
        }
        if update is not None:
            update["parts"].append(key)
        if rc != 0:
            failed.append(key)
            log(f"{key} failed (exit {rc}); going on with the rest")
    wall = round(time.time() - started, 1)
    if update is not None:
        update["wall_s"] = wall
    else:
        record["wall_s"] = wall
    write_json(run_json, record)
    summary = [str(AIRFLOW_PYTHON), "-m", "bench.summarize", "--out", out] + (["--quick"] if args.quick else [])
    if not args.quick and args.out.resolve() != RESULTS.resolve():
        summary += ["--docs", str(args.out / "benchmarks.md")]  # the repo's docs and README show bench/results only
    if subprocess.run(summary, cwd=REPO).returncode != 0:
        failed.append("summarize")
    log(f"done in {wall / 60:.1f} min" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
