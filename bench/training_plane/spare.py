"""Hot-spare takeover on the training plane alone: 2 training nodes + 1 spare, node 1 lost, fault ->
the first completed step after it. No control plane (it cannot run in the NVRx 0.7 lane's root):
one ``python -m fsdp_resilience.training.launch`` per node, as pods run them, and the node loss
drill of the run config, so both lanes (NVRx 0.4.1 in .venv, 0.7 in the lane's root) measure the
takeover the same way, side by side.

Breakdown (``spare_breakdown``), from the events log and the surviving launchers' logs:
detect (fault -> node 0's launcher sees its workers fail; with ``layered`` restarts the
in-process layer tries first and gives up), tear down (-> it joins the next rendezvous round),
rendezvous (-> the round with the spare in it is joined: the rendezvous must first drop the lost
node), start + restore (-> rank 0's ``train_begin``), first step (-> ``restart_end``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import REPO, RUN_SETTINGS, ensure_dataset, free_port, log, summarize
from bench.restarts import injected_faults, launcher_marks, restart_trials

#: The loss fires at this step, once, on the training node that holds the highest rank off node 0
#: (node 1 here: ``node`` null); the run goes on a few steps past it and ends by itself.
FAULT_STEP = 20
STEPS_AFTER = 10
NODES, SPARES = 2, 1


def spare_config_fields(run_id: str, run_dir: Path, dataset: Path, procs_per_node: int) -> dict[str, Any]:
    """The run config of one takeover trial."""
    return {
        **RUN_SETTINGS,
        "run_id": run_id,
        "run_dir": str(run_dir),
        "dataset_dir": str(dataset),
        "nodes": NODES,
        "spare_nodes": SPARES,
        "procs_per_node": procs_per_node,
        "steps": FAULT_STEP + STEPS_AFTER,
        "checkpoint_interval": 5,
        "restart_mode": "layered",
        "max_restarts": 4,
        "rdzv_port": free_port(),
        "faults": [{"kind": "node_loss", "step": FAULT_STEP, "node": None, "attempt": None, "once": True}],
    }


def _launch_node(cfg_path: Path, node_rank: int, log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    with open(log_path, "w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "fsdp_resilience.training.launch", "--config", str(cfg_path)]
            + ["--node-rank", str(node_rank), "--rdzv-host", "127.0.0.1"],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            start_new_session=True,
        )


def run_nodes(
    cfg_path: Path, count: int, timeout_s: float, env: dict[str, str] | None = None, tag: str = ""
) -> tuple[list[int | None], list[Path], float]:
    """Start nodes 0..count-1 of the run (one launcher each, ``env`` added to its environment, e.g.
    ``TRAINING_LAUNCH_ID``), wait for them all (bounded: past ``timeout_s`` each launcher's session
    is killed); their exit codes and logs (``CONFIG.{tag}node{i}.log``), and the wall time."""
    logs = [cfg_path.with_suffix(f".{tag}node{i}.log") for i in range(count)]
    t0 = time.time()
    procs = [_launch_node(cfg_path, i, logs[i], env) for i in range(count)]
    codes: list[int | None] = []
    try:
        for p in procs:
            try:
                codes.append(p.wait(timeout=max(1.0, timeout_s - (time.time() - t0))))
            except subprocess.TimeoutExpired:
                codes.append(None)
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
    return codes, logs, time.time() - t0


def spare_breakdown(events: list[dict[str, Any]], log_texts: list[str]) -> dict[str, Any] | None:
    """The node loss's trial: ``latency_s`` (``restart_end.latency_s``), the layer that recovered
    it, ``parts`` (see the module docstring; the launcher marks of node 0's log, the rendezvous
    host, whose workers are the ones that fail and restart), ``promoted_s`` (fault ->
    ``spare_promoted``) and which node took the lost one's place. None when no node loss fired."""
    marks = launcher_marks(log_texts[0]) if log_texts else []
    trials = [t for t in restart_trials(events, marks) if t["kind"] == "node_loss"]
    if not trials:
        return None
    trial = trials[0]
    fault = next(r for r in injected_faults(events) if r.get("kind") == "node_loss")
    promoted = next(
        (r for r in events if r.get("event") == "spare_promoted" and r.get("ts", 0) > fault["ts"]),
        None,
    )
    trial["lost_node_rank"] = fault.get("node_rank")
    trial["promoted_s"] = round(promoted["ts"] - fault["ts"], 4) if promoted else None
    trial["promoted_node_rank"] = promoted.get("node_rank") if promoted else None
    trial["relaunched"] = False  # one launch: nothing here relaunches
    return trial


def bench_spare_takeover(args: argparse.Namespace, work: Path, trials: int, procs_per_node: int = 2) -> dict[str, Any]:
    """``trials`` runs of their own, each losing node 1 once; statistics over them."""
    from fsdp_resilience.training.contract import RunConfig, read_events

    dataset = ensure_dataset(work / "data" / "stdlib-text", python=sys.executable)
    root = work / "runs" / "spare"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    results, runs = [], []
    t0 = time.time()
    for i in range(trials):
        cfg = RunConfig(**spare_config_fields(f"spare-{i}", root / f"spare-{i}", dataset, procs_per_node))
        cfg_path = root / f"spare-{i}.json"
        cfg_path.write_text(cfg.to_json())
        codes, logs, wall = run_nodes(cfg_path, cfg.launch_nodes, args.run_timeout_s)
        events = read_events(cfg.layout.events)
        trial = spare_breakdown(events, [p.read_text(errors="replace") for p in logs if p.exists()])
        runs.append({"trial": i, "exit_codes": codes, "wall_s": round(wall, 1), "run_dir": str(cfg.layout.root)})
        if trial is not None:
            results.append({**trial, "trial": i})
        log(
            f"spare trial {i}: exit codes {codes} in {wall:.0f}s; "
            + (
                f"node {trial['lost_node_rank']} lost -> {trial['layer']} in {trial['latency_s']} s "
                f"(promoted after {trial['promoted_s']} s; {trial['parts']})"
                if trial
                else "no node loss fired"
            )
        )
    covered = [t for t in results if t.get("latency_s") is not None and t.get("layer") == "injob"]
    part_names = list(dict.fromkeys(k for t in covered for k in t["parts"]))
    return {
        "wall_s": round(time.time() - t0, 1),
        "nodes": NODES,
        "spare_nodes": SPARES,
        "procs_per_node": procs_per_node,
        "fault_step": FAULT_STEP,
        "restart_mode": "layered",
        "trials": results,
        "runs": runs,
        "recovery_s": summarize(t["latency_s"] for t in covered),
        "promoted_s": summarize(t["promoted_s"] for t in covered),
        "parts_median_s": {p: summarize(t["parts"].get(p) for t in covered).get("median") for p in part_names},
        "all_covered_in_job": len(covered) == trials == len(results),
        "note": "training plane only: one fsdp_resilience.training.launch per node (2 training nodes, 1 spare), "
        "node 1's launcher and ranks SIGKILLed by the node_loss drill at step "
        f"{FAULT_STEP}; fault -> the first completed step after it (restart_end.latency_s)",
    }
