"""Step cadence, save cost and restart costs for sizing the chaos run, from a short fault-free run."""

from __future__ import annotations

import argparse
import statistics
import subprocess
from pathlib import Path
from typing import Any

from bench.chaos.analysis import save_costs
from bench.common import REPO, RUN_SETTINGS, TRAINING_PYTHON, free_port, nvrx_version, read_json
from bench.restarts import step_cadence
from fsdp_resilience.control.report.goodput import goodput
from fsdp_resilience.training.contract import RunConfig, read_events

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
