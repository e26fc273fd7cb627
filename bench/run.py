"""`make bench`: every benchmark, each with the environment of its plane, then the summary.

    python -m bench.run [--quick] [--out bench/results] [--skip chaos,...]

  1. training plane  (.venv: torch, NVRx)        python -m bench.training_plane
  2. goodput under chaos (.venv-airflow)        python -m bench.chaos        (full run only)
  3. control plane   (.venv-airflow: Airflow)   python -m bench.control_plane
  4. summary, plots, docs/benchmarks.md          python -m bench.summarize

The chaos run calibrates its step time and save cost from step 1's results. A part that fails
is reported and the others still run; the exit code says whether all succeeded. Standard
library only: any python3 can run this driver.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

from bench.common import AIRFLOW_PYTHON, REPO, RESULTS, TRAINING_PYTHON, log, machine, write_json

PARTS = (
    ("training_plane", TRAINING_PYTHON, "bench.training_plane"),
    ("chaos", AIRFLOW_PYTHON, "bench.chaos"),
    ("control_plane", AIRFLOW_PYTHON, "bench.control_plane"),
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run of the same scripts (about a minute)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder (default bench/results)")
    parser.add_argument("--skip", default="", help="comma-separated parts to leave out: training_plane,chaos,control_plane")
    args = parser.parse_args(argv)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    for python in (TRAINING_PYTHON, AIRFLOW_PYTHON):
        if not Path(python).exists():
            print(f"error: {python} is missing; run `make setup` first", file=sys.stderr)
            return 2
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    record = {"command": "make bench-quick" if args.quick else "make bench", "started_at":
              datetime.fromtimestamp(started).astimezone().isoformat(timespec="seconds"), "machine": machine(),
              "parts": {}}
    failed = []
    out = str(args.out.resolve().relative_to(REPO)) if args.out.resolve().is_relative_to(REPO) else str(args.out)
    for name, python, module in PARTS:
        if name in skip or (args.quick and name == "chaos"):
            continue
        command = [str(python), "-W", "ignore", "-m", module, "--out", out] + (["--quick"] if args.quick else [])
        log(f"{name}: {' '.join(command[3:])}")
        t0 = time.time()
        rc = subprocess.run(command, cwd=REPO).returncode
        record["parts"][name] = {"exit_code": rc, "wall_s": round(time.time() - t0, 1)}
        if rc != 0:
            failed.append(name)
            log(f"{name} failed (exit {rc}); going on with the rest")
    record["wall_s"] = round(time.time() - started, 1)
    write_json(args.out / ("run.quick.json" if args.quick else "run.json"), record)
    summary = [str(AIRFLOW_PYTHON), "-m", "bench.summarize", "--out", out] + (["--quick"] if args.quick else [])
    if subprocess.run(summary, cwd=REPO).returncode != 0:
        failed.append("summarize")
    log(f"done in {record['wall_s'] / 60:.1f} min" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
