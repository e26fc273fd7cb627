"""`make bench`: every benchmark, each with the environment of its plane, then the summary.

    python -m bench.run [--quick] [--out bench/results] [--skip chaos,...] [--only PART[,PART]]

  1. training plane  (.venv: torch, NVRx 0.4.1)   python -m bench.training_plane
  1b. the training plane's recovery rows, spare takeover and spares used up on NVRx 0.7 (the
     production version), in the NVRx 0.7 test lane's Debian testing root:
        bash tests/nvrx07/lane.sh --bench bench.training_plane --lane nvrx07 --only recovery,spare,... ...
  2. goodput under chaos (.venv-airflow)         python -m bench.chaos --duration-s 480   (full run only)
  3. the same with a hot spare (.venv-airflow)   python -m bench.chaos --duration-s 480 --spare-nodes 1
  4. control plane   (.venv-airflow: Airflow)    python -m bench.control_plane
  5. summary, plots, docs/benchmarks.md           python -m bench.summarize

The chaos runs calibrate their step time and save cost from a short run of their own, and their
restart costs from step 1's results. Each lasts 480 s (8 faults at one per minute, one of them a
node loss) rather than 600 s, so the two of them side by side keep `make bench` within 30
minutes on 2 cores.

The NVRx 0.7 part needs what the lane needs (root, zstd, a cached or buildable root); where the
lane cannot run it says so and the part is reported skipped, not failed. Its results go to
--out through the root's /repo mount, so --out must be inside the repository for it.

``--only`` runs just the named parts and merges their results into those already in --out, so
a few figures can be measured again while the others stay: the parts are training_plane,
training_plane_nvrx07, chaos, chaos_spares, control_plane, the .venv training plane's
spare_takeover alone (merged into training_plane.json), spares_used_up (a node loss when the spares
are used up, and the relaunch, on both lanes: merged into training_plane.json and
training_plane_nvrx07.json), and the control plane's own parts parse, watch, slots, relaunch,
spare and scale (the EKS backend at 16 to 1,024 kwok nodes; run with ``bench.control_plane
--only ... --merge``). run.json records when each part was measured. A part that fails is
reported and the others still run; the exit code says whether all succeeded. Standard library
only: any python3 can run this driver.
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
#: The NVRx 0.7 lane: ``lane.sh --bench MODULE ARGS`` runs ``python -m MODULE ARGS`` in its root.
NVRX07_LANE = REPO / "tests" / "nvrx07" / "lane.sh"
#: lane.sh --bench's exit code when the lane cannot run here (no root, no zstd, ...).
LANE_SKIPPED = 3
#: (part, python, module, arguments); full runs only for the chaos parts. ``NVRX07_LANE`` as the
#: python: the module runs in the NVRx 0.7 lane's root.
PARTS = (
    ("training_plane", TRAINING_PYTHON, "bench.training_plane", []),
    (
        "training_plane_nvrx07",
        NVRX07_LANE,
        "bench.training_plane",
        ["--lane", "nvrx07", "--name", "training_plane_nvrx07", "--only", "recovery,spare,spares_used_up"],
    ),
    ("chaos", AIRFLOW_PYTHON, "bench.chaos", ["--duration-s", str(CHAOS_DURATION_S)]),
    ("chaos_spares", AIRFLOW_PYTHON, "bench.chaos", ["--duration-s", str(CHAOS_DURATION_S), "--spare-nodes", "1"]),
    ("control_plane", AIRFLOW_PYTHON, "bench.control_plane", []),
)
FULL_RUN_ONLY = {"chaos", "chaos_spares"}
#: The control plane's own parts, which --only may name one by one.
CONTROL_PLANE_PARTS = ("parse", "watch", "slots", "relaunch", "spare", "scale")
#: The .venv training plane's parts --only may name alone (merged into training_plane.json):
#: name -> its bench.training_plane part. spare_takeover: the training-plane spare takeover on
#: NVRx 0.4.1, the same measurement as the NVRx 0.7 part's. spares_used_up: a node loss no spare
#: is left for (the launch ends) and the relaunch after it.
TRAINING_PLANE_PARTS = {"spare_takeover": "spare", "spares_used_up": "spares_used_up"}
#: Those of them --only runs on the NVRx 0.7 lane as well (merged into training_plane_nvrx07.json).
BOTH_LANES = ("spares_used_up",)


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


def _without_only(extra: list[str]) -> list[str]:
    """A part's arguments less its ``--only PARTS``."""
    i = extra.index("--only") if "--only" in extra else len(extra)
    return extra[:i] + extra[i + 2 :]


def part_command(python: Path, module: str, out: str, extra: list[str], quick: bool) -> list[str] | None:
    """The command line of one part; None for a lane part whose --out the lane cannot see (the
    root mounts the repository only)."""
    tail = ["--out", out] + extra + (["--quick"] if quick else [])
    if python == NVRX07_LANE:
        if Path(out).is_absolute():
            return None
        return ["bash", str(NVRX07_LANE.relative_to(REPO)), "--bench", module] + tail
    return [str(python), "-W", "ignore", "-m", module] + tail


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
        "--out: "
        + ",".join(name for name, *_ in PARTS)
        + ", the training plane's "
        + ",".join(TRAINING_PLANE_PARTS)
        + " or the control plane's "
        + ",".join(CONTROL_PLANE_PARTS),
    )
    args = parser.parse_args(argv)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    known = {name for name, *_ in PARTS} | set(CONTROL_PLANE_PARTS) | set(TRAINING_PLANE_PARTS)
    if (skip | only) - known:
        parser.error(
            f"unknown part(s) {', '.join(sorted((skip | only) - known))}; the parts are {', '.join(sorted(known))}"
        )
    if only and skip:
        parser.error("give --only or --skip, not both")
    control_parts = [p for p in CONTROL_PLANE_PARTS if p in only]
    training_parts = [TRAINING_PLANE_PARTS[p] for p in TRAINING_PLANE_PARTS if p in only]
    lane_parts = [TRAINING_PLANE_PARTS[p] for p in BOTH_LANES if p in only and "training_plane_nvrx07" not in only]
    if training_parts and "training_plane" in only:
        parser.error("--only training_plane runs all its parts; name it or some of its parts, not both")
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
        if name in skip or (
            only
            and name not in only
            and not (name == "control_plane" and control_parts)
            and not (name == "training_plane" and training_parts)
            and not (name == "training_plane_nvrx07" and lane_parts)
        ):
            continue
        key = name
        if name == "training_plane_nvrx07" and lane_parts:
            extra = _without_only(extra) + ["--only", ",".join(lane_parts), "--merge"]
            key = name + "." + "+".join(lane_parts)
        command_line = part_command(python, module, out, extra, args.quick)
        if command_line is None:
            log(f"{name}: skipped: the NVRx 0.7 lane sees the repository only, and --out {out} is outside it")
            continue
        if name == "control_plane" and control_parts:
            command_line += ["--only", ",".join(control_parts), "--merge"]
            key = "control_plane." + "+".join(control_parts)
        if name == "training_plane" and training_parts:
            command_line += ["--only", ",".join(training_parts), "--merge"]
            key = "training_plane." + "+".join(training_parts)
        shown = command_line[3:] if python != NVRX07_LANE else command_line[1:]
        log(f"{key}: {' '.join(shown)}")
        t0 = time.time()
        rc = subprocess.run(command_line, cwd=REPO).returncode
        record["parts"][key] = {
            "exit_code": rc,
            "wall_s": round(time.time() - t0, 1),
            "measured_at": _now(t0),
            "command": " ".join(shown),
        }
        if python == NVRX07_LANE and rc == LANE_SKIPPED:
            record["parts"][key]["skipped"] = True
            log(f"{key}: skipped (the NVRx 0.7 lane cannot run here; see its line above)")
            continue
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
