"""The relaunch rung on the local backend, control-plane time only, per fault kind."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from bench.common import RUN_SETTINGS, TRAINING_PYTHON, ensure_dataset, summarize
from fsdp_resilience.control.task_data import Run

#: Bad nodes, one per launch: a rank killed on every attempt (restarts run out), a lost node.
RELAUNCH_FAULTS = ("sigkill", "node_loss", "sigkill")


#: Issue 14: the relaunch after a node replacement, failed launch -> the relaunch's first step.
RELAUNCH_TARGET_S = 10.0


def bench_relaunch(work: Path, kinds: tuple[str, ...], poll_s: float) -> dict[str, Any]:
    from bench.common import free_port
    from bench.drive import drive, relaunch_trials
    from fsdp_resilience.control.progress import CHANGE_TICK_S
    from fsdp_resilience.training.contract import RunConfig

    root = work / "relaunch"
    shutil.rmtree(root, ignore_errors=True)
    dataset = ensure_dataset(work / "data" / "python-stdlib")
    every = 5
    faults = []
    for i, kind in enumerate(kinds):
        # A bad node: the fault comes back on every attempt while the run is on slot-i, so in-job
        # restarts cannot help (max_restarts=0 gives up at once) and the ladder must replace it.
        drill = {"kind": kind, "step": every * (i + 1), "attempt": None, "node_id": f"slot-{i}"}
        drill.update({"node": 0} if kind == "node_loss" else {"rank": i % 2})
        faults.append(drill)
    cfg = RunConfig(
        **{
            **RUN_SETTINGS,
            "run_id": "relaunch",
            "run_dir": str(root / "relaunch"),
            "dataset_dir": str(dataset),
            "nodes": 1,
            "procs_per_node": 2,
            "steps": every * (len(kinds) + 1),
            "checkpoint_interval": 2,
            "restart_mode": "layered",
            "max_restarts": 0,
            "rdzv_port": free_port(),
            "faults": faults,
        }
    )
    backend = {
        "name": "local",
        "state_dir": str(root / ".local-backend"),
        "slots": len(kinds) + 1,
        "training_python": str(TRAINING_PYTHON),
    }
    run = Run(config=cfg.to_dict(), backend=backend, max_node_replacements=len(kinds))
    t0 = time.time()
    driven = drive(run, poll_s=poll_s, timeout_s=900)
    trials = relaunch_trials(cfg, driven)
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for t in trials:
        if t.get("total_s") is not None:
            by_kind.setdefault(t["kind"], []).append(t)
    rows = [
        {
            "kind": kind,
            "launch_failed_by": ts[0]["launch_failed_by"],
            "total_s": summarize(t["total_s"] for t in ts),
            "parts_median_s": {p: summarize(t["parts"][p] for t in ts).get("median") for p in ts[0]["parts"]},
            "data_plane_s": summarize(t["data_plane_s"] for t in ts),
            "target_s": RELAUNCH_TARGET_S,
            "target_met": summarize(t["total_s"] for t in ts)["median"] <= RELAUNCH_TARGET_S,
        }
        for kind, ts in by_kind.items()
    ]
    return {
        "wall_s": round(time.time() - t0, 1),
        "poll_interval_s": poll_s,
        "change_tick_s": CHANGE_TICK_S,
        "faults": faults,
        "outcome": driven["launches"][-1]["outcome"],
        "trials": trials,
        "rows": rows,
        "note": "control-plane time only: from the failed launch giving up (its final event; for a lost node "
        "the loss itself) to the relaunch's first step; the ladder's functions run without Airflow's "
        "scheduler (no task start-up time); each launch watched by TrainingProgressTrigger, which "
        "checks every poll_interval_s and looks for the launch's end (its final event, the local "
        "backend's job record) every change_tick_s in between",
    }
