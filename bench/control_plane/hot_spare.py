"""Node loss with a hot spare on the local backend: fault -> the first step after it, and fault ->
the pool whole again."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from bench.common import RUN_SETTINGS, TRAINING_PYTHON, ensure_dataset, log, nvrx_version, summarize
from fsdp_resilience.control.task_data import Run


def _recovered_and_refilled(cfg: Any) -> Any:
    """Stop condition of a spare trial: a step completed after the node loss, and the pool keeper
    has added the new spare (or a launch failed: the watch sees that by itself)."""
    from fsdp_resilience.training.contract import read_events

    def stop() -> bool:
        events = read_events(cfg.layout.events)
        faults = [r["ts"] for r in events if r.get("event") == "fault_injected"]
        if not faults:
            return False
        return any(r.get("event") == "restart_end" and r["ts"] > faults[-1] for r in events) and any(
            r.get("event") == "spare_added" and r["ts"] > faults[-1] for r in events
        )

    return stop


def bench_spare(work: Path, trials: int, poll_s: float, relaunch: dict[str, Any] | None) -> dict[str, Any]:
    from bench.common import free_port
    from bench.drive import drive, spare_trials
    from fsdp_resilience.training.contract import RunConfig

    nodes, spare_nodes, procs = 2, 1, 2  # procs_per_node as the relaunch part
    root = work / "spare"
    shutil.rmtree(root, ignore_errors=True)
    dataset = ensure_dataset(work / "data" / "python-stdlib")
    # One loss per run, always node 1: which launcher the rendezvous promotes is its choice (on
    # NVRx 0.4.1 a refilled spare was seen promoted before the one started with the launch), and
    # a drill can name only the launch's own nodes, so a second loss in the same run could miss.
    faults = [{"kind": "node_loss", "step": 20, "node": nodes - 1, "attempt": None}]  # it dies: fires once
    t0 = time.time()
    results, driven_runs = [], []
    for i in range(trials):
        cfg = RunConfig(
            **{
                **RUN_SETTINGS,
                "run_id": f"spare-{i}",
                "run_dir": str(root / f"spare-{i}"),
                "dataset_dir": str(dataset),
                "nodes": nodes,
                "spare_nodes": spare_nodes,
                "procs_per_node": procs,
                "steps": 200,
                "checkpoint_interval": 5,
                "restart_mode": "layered",
                "max_restarts": 4,
                "rdzv_port": free_port(),
                "faults": faults,
            }
        )
        # A slot per launcher, one for the refill, one more (a relaunch, were the spare to fail).
        backend = {
            "name": "local",
            "state_dir": str(root / f".local-backend-{i}"),
            "slots": cfg.launch_nodes + 2,
            "training_python": str(TRAINING_PYTHON),
        }
        run = Run(config=cfg.to_dict(), backend=backend, max_node_replacements=2)
        driven = drive(run, poll_s=poll_s, timeout_s=600, stop=_recovered_and_refilled(cfg))
        trial = spare_trials(cfg, driven)
        results += [{**t, "trial": i} for t in trial]
        driven_runs.append(
            {
                "launches": driven["launches"],
                "relaunches": len(driven["rungs"]),
                "refills": driven["refills"],
                "stopped_because": driven["stopped_because"],
            }
        )
        log(
            f"spare trial {i}: "
            + "; ".join(
                f"node {t['lost_node_rank']} lost -> {t['recovered_by']} in "
                f"{t['recovery_s']} s, pool whole after {t['refill_s']} s"
                for t in trial
            )
        )
    covered = [t for t in results if t["recovery_s"] is not None and not t["relaunched"]]
    same_kind = next((r for r in (relaunch or {}).get("rows") or [] if r["kind"] == "node_loss"), None)
    return {
        "wall_s": round(time.time() - t0, 1),
        "poll_interval_s": poll_s,
        "nodes": nodes,
        "spare_nodes": spare_nodes,
        "procs_per_node": procs,
        "faults": faults,
        "trials": results,
        "runs": driven_runs,
        "recovery_s": summarize(t["recovery_s"] for t in covered),
        "refill_s": summarize(t["refill_s"] for t in covered),
        "promoted_s": summarize((t["promoted"] or {}).get("after_s") for t in covered),
        "all_covered_in_job": len(covered) == trials == len(results),
        "relaunch_s_same_kind": (
            {
                "total_s": same_kind["total_s"],
                "data_plane_s": same_kind["data_plane_s"],
                "note": "the relaunch part's node_loss row, this run: failed launch -> first "
                "step (control plane), after fault -> launch gave up (data plane)",
            }
            if same_kind
            else None
        ),
        "nvrx": nvrx_version(),
        "note": "fault (the node's launcher and ranks SIGKILLed: fault_injected) -> the first completed step "
        "after it (restart_end.latency_s); the spare takes the lost node's place at an in-job restart "
        "(no relaunch). refill: fault -> spare_added (the lost slot quarantined and a new spare started "
        "by spare_refill.keep_spare_pool, run next to the watch as the DAG's keep_spare_pool task runs). "
        "Each trial is a run of its own, stopped once both happened",
    }
