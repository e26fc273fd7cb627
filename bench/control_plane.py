"""Control-plane benchmarks, run with the control-plane venv (Airflow; torch is never imported):

    .venv-airflow/bin/python -m bench.control_plane [--quick] [--out DIR] [--only parse,watch,slots,relaunch,spare]

parse     DAG parse time of dags/ (torch blocked): with the plugin modules imported fresh for
          each parse, and with them already imported (Airflow's DAG processor pre-imports a DAG
          file's imports before it forks the parser).
watch     Checkpoint commit -> the watch sees it: ``TrainingProgressTrigger`` driven with asyncio,
          as the triggerer runs it, against a run dir where checkpoints are committed with the
          contract's ``CheckpointCatalog``; and commit of the final step -> the trigger fires.
slots     Worker slots held while training runs: ``fsdp_training`` under ``dag.test()`` with
          real training; seconds of task execution (worker slots) against seconds of the
          deferred sensor's trigger, inside the training window. dag.test() runs every task and
          the trigger in one process, one at a time: it shows where the time is spent (task code
          or trigger), not how a real scheduler packs slots.
relaunch  The relaunch rung on the local backend, control-plane time only: from the failed launch
          giving up to the first step of the relaunch on a replaced node, per fault kind. Each
          launch is watched by the sensor's own trigger (a check every --poll-s, and a look for
          the launch's end every 0.2 s in between).
spare     Node loss with a hot spare on the local backend: nodes=2 + spare_nodes=1, the relaunch
          part's procs_per_node, a node_loss drill on node 1 (node 0 hosts the rendezvous store:
          no spare covers it), a run per trial, driven like the DAG (the watch watches on while
          the job stays running; the pool keeper quarantines the lost slot and adds a new spare).
          Per trial: fault -> the first step after it (no relaunch), and fault -> the pool whole
          again (spare_added).

Writes DIR/control_plane.json (default DIR: bench/results); with --merge, the parts measured
replace theirs in the existing file and the others stay. ``measured`` records when each part was
measured, with the load average of the run that measured it.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import os
import random
import shutil
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.common import (
    PLUGINS,
    REPO,
    RESULTS,
    RUN_SETTINGS,
    TRAINING_PYTHON,
    LoadMonitor,
    ensure_dataset,
    log,
    machine,
    nvrx_version,
    read_json,
    summarize,
    write_json,
)
from fsdp_resilience.control.backends import JobStatus, TrainingBackend  # noqa: E402
from fsdp_resilience.control.task_data import Run  # noqa: E402


def airflow_env(work: Path) -> dict[str, str]:
    """A private Airflow home (SQLite) with this repo's DAGs and plugins."""
    home = work / "airflow-home"
    return {
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(PLUGINS),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}",
        "FSDP_RUNS_ROOT": str(work / "runs"),
        "FSDP_DATA_ROOT": str(work / "data"),
        "TRAINING_PYTHON": str(TRAINING_PYTHON),
    }


# --------------------------------------------------------------------------------------------
# DAG parse time
# --------------------------------------------------------------------------------------------


def bench_parse(trials: int) -> dict[str, Any]:
    sys.modules.setdefault("torch", None)  # any import of torch now fails: the control plane must not need it
    t0 = time.perf_counter()
    from airflow.dag_processing.dagbag import DagBag

    airflow_import = time.perf_counter() - t0
    ours = ("fsdp_resilience", "training")

    def parse(fresh: bool) -> tuple[float, dict[str, float], DagBag]:
        if fresh:
            for name in [m for m in sys.modules if m.split(".")[0] in ours]:
                del sys.modules[name]
        t = time.perf_counter()
        bag = DagBag(dag_folder=str(REPO / "dags"))
        elapsed = time.perf_counter() - t
        if bag.import_errors:
            raise RuntimeError(f"DAG import errors: {bag.import_errors}")
        per_file = {Path(s.file).name: s.duration.total_seconds() for s in bag.dagbag_stats}
        return elapsed, per_file, bag

    parse(fresh=True)  # warm-up: Airflow's own lazy imports
    runs: dict[str, list[tuple[float, dict[str, float]]]] = {"fresh_imports": [], "pre_imported": []}
    for _ in range(trials):
        for mode in runs:
            elapsed, per_file, bag = parse(fresh=mode == "fresh_imports")
            runs[mode].append((elapsed, per_file))
    files = sorted(runs["fresh_imports"][0][1])
    return {
        "dags": sorted(bag.dag_ids),
        "trials": trials,
        "airflow_import_s": round(airflow_import, 3),
        "torch_blocked": True,
        **{
            mode: {
                "dagbag_s": summarize(r[0] for r in rs),
                "per_file_s": {f: summarize(r[1].get(f) for r in rs) for f in files},
            }
            for mode, rs in runs.items()
        },
    }


# --------------------------------------------------------------------------------------------
# Commit -> the watch sees it
# --------------------------------------------------------------------------------------------


def _stand_in_status(self: Any, handle: Any) -> JobStatus:
    path = Path(self.state_dir) / "state"
    state = path.read_text().strip() if path.exists() else "running"
    return JobStatus(state=state, failure_class="success" if state == "succeeded" else None)


def _not_here(self: Any, *args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("the watch benchmark's stand-in job only answers status()")


#: A stand-in job for timing the watch alone: its state is what the benchmark writes to
#: ``<state_dir>/state`` ("running" until then). The watch only asks for ``status``; every other
#: method of the interface (whatever it holds by now) says it is not used here.
RunDirJob = type(
    "RunDirJob",
    (TrainingBackend,),
    {
        **{name: _not_here for name in TrainingBackend.__abstractmethods__},
        "__module__": __name__,
        "__doc__": "Stand-in job whose state the watch benchmark sets.",
        "name": "bench-rundir",
        "__init__": lambda self, state_dir: setattr(self, "state_dir", state_dir),
        "status": _stand_in_status,
        "to_config": lambda self: {"name": "bench-rundir", "state_dir": self.state_dir},
    },
)


def bench_watch(work: Path, trials: int, poll_s: float, seed: int) -> dict[str, Any]:
    """Commit the final checkpoint at a random phase of the trigger's poll loop (and mark the job
    succeeded) and time until the trigger fires: how long a commit waits to be seen."""
    from fsdp_resilience.control.backends import JobHandle, register_backend
    from fsdp_resilience.control.triggers.training_progress import TrainingProgressTrigger
    from fsdp_resilience.training.contract import CheckpointCatalog, RunDir, write_rank_sums

    register_backend(RunDirJob.name, RunDirJob)
    rng = random.Random(seed)
    final = 10

    async def trial(root: Path) -> tuple[float, dict[str, Any]]:
        layout = RunDir(root / "run")
        layout.create()
        trigger = TrainingProgressTrigger(
            backend={"name": RunDirJob.name, "state_dir": str(root)},
            handle=JobHandle(backend=RunDirJob.name, run_id="watch", launch_id="0", job_name="watch-0").to_dict(),
            run_dir=str(layout.root),
            final_step=final,
            stall_timeout_s=3600.0,
            launched_at=time.time(),
            poll_interval_s=poll_s,
        )
        fired: asyncio.Future = asyncio.get_running_loop().create_future()

        async def run_trigger() -> None:
            async for event in trigger.run():
                fired.set_result((time.time(), event.payload))
                return

        task = asyncio.ensure_future(run_trigger())
        try:
            await asyncio.sleep(poll_s * rng.uniform(0.02, 1.0))  # at a random phase of the poll loop

            def commit() -> float:
                # What the ranks leave before rank 0 commits: their shards with checksum records
                # (commit() refuses a checkpoint without them) and DCP's .metadata.
                path = layout.checkpoint_dir(final)
                path.mkdir(parents=True)
                for rank in range(2):
                    (path / f"__{rank}_0.distcp").write_bytes(b"bench")
                    write_rank_sums(path, rank, [f"__{rank}_0.distcp"])
                (path / ".metadata").write_bytes(b"bench")
                committed_at = CheckpointCatalog(layout).commit(final, world_size=2).committed_at
                (root / "state").write_text("succeeded")  # the job ends after its last commit
                return committed_at

            committed = await asyncio.to_thread(commit)
            fired_at, payload = await asyncio.wait_for(fired, timeout=4 * poll_s + 30)
            return fired_at - committed, payload
        finally:
            task.cancel()

    latencies = []
    for i in range(trials):
        root = work / "watch" / f"trial-{i}"
        shutil.rmtree(root, ignore_errors=True)
        latency, payload = asyncio.run(trial(root))
        if payload.get("outcome") != "success" or payload.get("step") != final:
            raise RuntimeError(f"the trigger fired {payload}, expected success at step {final}")
        latencies.append(latency)
    return {
        "poll_interval_s": poll_s,
        "trials": trials,
        "commit_to_trigger_event_s": summarize(latencies),
        "note": "TrainingProgressTrigger run with asyncio as the triggerer runs it; the final checkpoint is "
        "committed with CheckpointCatalog at a random phase of its poll loop; latency = the "
        "TriggerEvent - the commit marker's committed_at. The poll interval bounds it (the "
        "sensor's default is 5 s).",
    }


# --------------------------------------------------------------------------------------------
# Worker slots held while training runs (dag.test)
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# The relaunch rung
# --------------------------------------------------------------------------------------------

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


# --------------------------------------------------------------------------------------------
# Node loss with a hot spare
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.control_plane", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: parse and watch only, few trials")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--only", default=None, help="comma-separated parts (default all; quick: parse,watch)")
    parser.add_argument("--parse-trials", type=int, default=None, help="default 7; quick 2")
    parser.add_argument("--commits", type=int, default=None, help="watch trials (default 8; quick 3)")
    parser.add_argument(
        "--poll-s", type=float, default=None, help="the watch's poll interval (default 5, the sensor's)"
    )
    parser.add_argument("--slots-steps", type=int, default=12)
    parser.add_argument("--relaunch-faults", default=",".join(RELAUNCH_FAULTS))
    parser.add_argument(
        "--spare-trials", type=int, default=None, help="spare part trials, a run each (default 2; quick 1)"
    )
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument(
        "--merge",
        action="store_true",
        help="merge the parts measured into the existing results file instead of replacing it",
    )
    args = parser.parse_args(argv)
    args.out = args.out.resolve()  # absolute: subprocesses (and an SQLite URL) must not depend on the cwd
    only = [
        p.strip()
        for p in (args.only or ("parse,watch" if args.quick else "parse,watch,slots,relaunch,spare")).split(",")
    ]
    unknown = sorted(set(only) - {"parse", "watch", "slots", "relaunch", "spare"})
    if unknown:
        parser.error(
            f"--only: unknown part(s) {', '.join(unknown)}; the parts are parse, watch, slots, relaunch, spare"
        )
    work = args.out / ("quick" if args.quick else "work") / "control"
    shutil.rmtree(work / "airflow-home", ignore_errors=True)
    (work / "airflow-home").mkdir(parents=True, exist_ok=True)
    os.environ.update(airflow_env(work))  # before Airflow is imported
    out: dict[str, Any] = {
        "bench": "control_plane",
        "quick": args.quick,
        "machine": machine(),
        "versions": {p: importlib.metadata.version(p) for p in ("apache-airflow",)},
        "command": "python -m bench.control_plane " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    began: dict[str, float] = {}
    with LoadMonitor() as load:
        if "parse" in only:
            began["parse"] = time.time()
            log("parse: DAG parse time")
            out["parse"] = bench_parse(args.parse_trials or (2 if args.quick else 7))
        if "watch" in only:
            poll = args.poll_s or (0.5 if args.quick else 5.0)
            log(f"watch: commit -> trigger sees it, poll {poll}s")
            began["watch"] = time.time()
            out["watch"] = bench_watch(work, args.commits or (3 if args.quick else 8), poll, args.seed)
        if "slots" in only:
            log("slots: fsdp_training under dag.test()")
            began["slots"] = time.time()
            out["slots"] = bench_slots(work, args.slots_steps)
        if "relaunch" in only:
            kinds = tuple(k for k in args.relaunch_faults.split(",") if k)
            log(f"relaunch: {kinds}")
            began["relaunch"] = time.time()
            out["relaunch"] = bench_relaunch(work, kinds, args.poll_s or 5.0)
        if "spare" in only:
            trials = args.spare_trials or (1 if args.quick else 2)
            log(f"spare: node loss with a hot spare, {trials} trial(s)")
            began["spare"] = time.time()
            out["spare"] = bench_spare(work, trials, args.poll_s or 5.0, out.get("relaunch"))
    out["load"] = load.result()
    out["measured"] = {
        part: {
            "at": datetime.fromtimestamp(began[part]).astimezone().isoformat(timespec="seconds"),
            "command": out["command"],
            "load": out["load"],
        }
        for part in only
    }
    path = args.out / ("control_plane.quick.json" if args.quick else "control_plane.json")
    if args.merge and path.exists():
        previous = read_json(path)
        measured = previous.get("measured") or {
            part: {
                "at": (previous.get("load") or {}).get("started_at"),
                "command": previous.get("command"),
                "load": previous.get("load"),
            }
            for part in ("parse", "watch", "slots", "relaunch", "spare")
            if part in previous
        }
        # The file's own load and command stay those of the run that measured most of it.
        out = {**previous, **{part: out[part] for part in only}, "measured": {**measured, **out["measured"]}}
    path = write_json(path, out)
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
