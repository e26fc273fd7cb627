"""Worker slots held while training runs: ``fsdp_training`` under ``dag.test()`` with real training."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import REPO, RUN_SETTINGS, ensure_dataset


def _overlap(a: tuple[float, float], b: tuple[float, float]) -> float:
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


def bench_slots(work: Path, steps: int) -> dict[str, Any]:
    import airflow.sdk.definitions.dag as dag_module
    import airflow.sdk.execution_time.supervisor as supervisor
    from airflow.dag_processing.dagbag import DagBag

    from fsdp_resilience.training.contract import read_events

    airflow = Path(sys.executable).with_name("airflow")
    subprocess.run([str(airflow), "db", "migrate"], check=True, capture_output=True, env=os.environ.copy())
    ensure_dataset(Path(os.environ["FSDP_DATA_ROOT"]) / "python-stdlib")
    tasks: list[dict[str, Any]] = []
    triggers: list[tuple[float, float]] = []
    real_run_task, real_trigger = supervisor.run_task_in_process, dag_module._run_inline_trigger

    def run_task(*args: Any, **kwargs: Any):
        ti = kwargs.get("ti") or args[0]
        began = time.time()
        result = real_run_task(*args, **kwargs)
        tasks.append(
            {
                "task_id": ti.task_id,
                "began": began,
                "ended": time.time(),
                "deferred": type(getattr(result, "msg", None)).__name__ == "DeferTask",
            }
        )
        return result

    def inline_trigger(*args: Any, **kwargs: Any):
        began = time.time()
        try:
            return real_trigger(*args, **kwargs)
        finally:
            triggers.append((began, time.time()))

    supervisor.run_task_in_process, dag_module._run_inline_trigger = run_task, inline_trigger
    run_name = "slots"
    conf = {
        "run_name": run_name,
        "steps": steps,
        "checkpoint_interval": 3,
        "max_restarts": 1,
        "max_node_replacements": 1,
        "run_config": {**RUN_SETTINGS, "faults": [{"kind": "exception", "step": max(2, steps // 2), "rank": 1}]},
    }
    try:
        dag = DagBag(dag_folder=str(REPO / "dags")).get_dag("fsdp_training")
        t0 = time.time()
        dag_run = dag.test(run_conf=conf)
        wall = time.time() - t0
    finally:
        supervisor.run_task_in_process, dag_module._run_inline_trigger = real_run_task, real_trigger
    events = read_events(Path(os.environ["FSDP_RUNS_ROOT"]) / run_name / "events.jsonl")
    begins = [r["ts"] for r in events if r.get("event") == "launch_begin"]
    ends = [r["ts"] for r in events if r.get("event") == "final"]
    if not begins or not ends:
        raise RuntimeError(f"dag.test ended {dag_run.state} without a training launch and its final event")
    window = (min(begins), max(ends))
    in_window: dict[str, float] = {}
    for t in tasks:
        held = _overlap((t["began"], t["ended"]), window)
        if held > 0:
            in_window[t["task_id"]] = round(in_window.get(t["task_id"], 0.0) + held, 3)
    slot_s = sum(in_window.values())
    trigger_s = sum(_overlap(t, window) for t in triggers)
    # Task code running while a deferred sensor's trigger waited (in a deployment: slots held
    # while deferred). dag.test() runs one thing at a time, so this shows that the sensor did
    # defer (the wait is in the trigger), not how a scheduler would pack other tasks.
    held_while_deferred = max(
        (sum(1 for t in tasks if _overlap((t["began"], t["ended"]), trig) > 0) for trig in triggers), default=0
    )
    training_s = window[1] - window[0]
    return {
        "dag_run_state": str(dag_run.state),
        "dag_test_wall_s": round(wall, 1),
        "steps": steps,
        "training_window_s": round(training_s, 2),
        "worker_slot_s_during_training": round(slot_s, 3),
        "worker_slot_share_of_training": round(slot_s / training_s, 4),
        "worker_slot_s_by_task": in_window,
        "deferred_trigger_s_during_training": round(trigger_s, 2),
        "slots_held_while_deferred": held_while_deferred,
        "task_runs": len(tasks),
        "deferrals": sum(1 for t in tasks if t["deferred"]),
        "note": "dag.test() runs tasks and the deferred sensor's trigger inline, one at a time, in one "
        "process: 'worker slot' seconds are task code running, 'trigger' seconds are the "
        "deferred sensor's trigger (the triggerer's job in a deployment). A real scheduler adds "
        "queueing; poke mode would hold a slot for the whole training window.",
    }
