"""`make demo`: the whole pipeline on this machine, with Airflow and real training.

1. an Airflow home under runs/airflow-home (SQLite), this repo's dags/ and plugins/;
2. stage_dataset: the Python standard library's sources -> byte-level token shards;
3. fsdp_training on the local backend (2 ranks on a "node" = a local slot) with drills that
   exercise every rung of the ladder:
     - an exception in rank 1 at step 8            -> in-process restart (same processes)
     - SIGKILL of rank 0 at step 15               -> in-job restart (ft_launcher)
     - rank 1 dies at step 25 on every attempt while on slot-0 (a bad node)
                                                  -> in-job restarts run out -> the DAG
                                                     diagnoses slot-0, replaces it, relaunches
                                                     on slot-1 from the newest checkpoint
4. evaluation, the run report, and the published Assets; then where everything is.

Run with the control-plane environment: .venv-airflow/bin/python -m fsdp_resilience.control.demo
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]  # src/fsdp_resilience/control/<this> -> the checkout

DRILLS = [
    {"kind": "exception", "step": 8, "rank": 1},
    {"kind": "sigkill", "step": 15, "rank": 0, "attempt": 0},
    {"kind": "sigkill", "step": 25, "rank": 1, "attempt": None, "node_id": "slot-0"},
]
#: Short timeouts so faults resolve in seconds on a laptop CPU (see docs/reference/run-config.md).
FAST = {
    "seq_len": 64,
    "batch_size": 4,
    "collective_timeout_s": 3.0,
    "heartbeat_timeout_s": 30.0,
    "initial_heartbeat_timeout_s": 90.0,
    "hang_timeout_s": 15.0,
    "device": "cpu",
    "faults": DRILLS,
}


def airflow_env(root: Path) -> dict[str, str]:
    home = root / "airflow-home"
    home.mkdir(parents=True, exist_ok=True)
    return {
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}",
        "FSDP_RUNS_ROOT": str(root),
        "FSDP_DATA_ROOT": str(root / "data"),
        "TRAINING_PYTHON": str(REPO / ".venv" / "bin" / "python"),
    }


def run_dag(dag_id: str, conf: dict) -> tuple[str, dict[str, str]]:
    from airflow.dag_processing.dagbag import DagBag

    dag = DagBag(dag_folder=str(REPO / "dags")).dags[dag_id]
    dag_run = dag.test(run_conf=conf)
    return str(dag_run.state), {ti.task_id: str(ti.state) for ti in dag_run.get_task_instances()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fsdp_resilience.control.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=str(REPO / "runs"), help="runs, data and the Airflow home (default ./runs)")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args(argv)
    root = Path(args.root).resolve()
    os.environ.update(airflow_env(root))
    # A fresh local backend each demo: the last demo's quarantined slot should not linger.
    backend_state = root / ".local-backend"
    if backend_state.exists():
        subprocess.run(["rm", "-rf", str(backend_state)], check=True)
    subprocess.run(
        [str(Path(sys.executable).with_name("airflow")), "db", "migrate"],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    t0 = time.time()
    print("[demo] 1/2 stage_dataset: the Python standard library -> token shards", flush=True)
    state, _ = run_dag("stage_dataset", {"source": "stdlib", "dataset": "python-stdlib"})
    if state != "success":
        print(f"[demo] stage_dataset ended {state}", file=sys.stderr)
        return 1

    run_name = time.strftime("demo-%Y%m%d-%H%M%S")
    print(
        f"[demo] 2/2 fsdp_training {run_name}: 2 ranks, {args.steps} steps, drills: "
        + ", ".join(f"{d['kind']}@{d['step']}" for d in DRILLS),
        flush=True,
    )
    state, tasks = run_dag(
        "fsdp_training",
        {
            "run_name": run_name,
            "dataset": "python-stdlib",
            "steps": args.steps,
            "checkpoint_interval": 5,
            "max_restarts": 2,
            "max_node_replacements": 1,
            "run_config": FAST,
        },
    )

    run_dir = root / run_name
    from fsdp_resilience.training.contract import read_events

    events = read_events(run_dir / "events.jsonl")
    print(f"\n[demo] fsdp_training ended {state} in {time.time() - t0:.0f}s (both DAGs)")
    for task_id in (
        "watch_checkpoints",
        "escalation_1.diagnose_and_replace",
        "escalation_1.watch",
        "resolve_outcome",
        "evaluate",
        "build_report",
        "publish",
    ):
        print(f"  {task_id:38s} {tasks.get(task_id)}")
    print("\n[demo] the ladder, from events.jsonl")
    for r in events:
        if r["event"] == "restart_end":
            print(
                f"  restart   {r['layer']:9s} {r['latency_s']:6.1f}s  (resumed at step {r['step']}, {r.get('node_id')})"
            )
        elif r["event"] == "escalation":
            print(
                f"  escalation rung {r['rung']}: {r['failure_class']} -> replaced {r['nodes']}, "
                f"launch {r['from_launch']} -> {r['to_launch']}"
            )
    evaluation = run_dir / "eval.json"
    if evaluation.exists():
        e = json.loads(evaluation.read_text())
        print(f"  evaluation: {e['checkpoint_id']}: val_loss {e['val_loss']:.3f}, perplexity {e['perplexity']:.2f}")
    print("\n[demo] where things are")
    print(f"  run dir:  {run_dir}")
    print(f"  report:   {run_dir / 'report' / 'report.md'}")
    print(f"  events:   {run_dir / 'events.jsonl'}")
    print(f"  Airflow:  AIRFLOW_HOME={root / 'airflow-home'} (see docs/airflow-deployment.md)")
    return 0 if state == "success" else 1


if __name__ == "__main__":
    sys.exit(main())
