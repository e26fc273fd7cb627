"""A node loss when the hot spares are used up, on the training plane alone: 2 training nodes + 1
spare, ``layered`` restarts, two ``node_loss`` drills (``node`` null, ``once``). The first loss is
covered by the spare; the second finds no spare left, and node 0's launcher ends the launch in
seconds (``waiting_for_nodes`` with nothing coming, then its ``final``: ``restarts_exhausted``, "lost
and no spare left") instead of waiting out the rendezvous' join timeout. Then the bench relaunches
as the control plane's ladder would, the next launch id (``TRAINING_LAUNCH_ID`` 1, then 2) with
the same config file, nodes 0 and 1 only (no spare needed to train): the relaunch resumes from the
newest committed checkpoint, and the drills do not fire again (``once``: the events log says they
already did). As ``bench.training_plane.spare``, one ``python -m fsdp_resilience.training.launch``
per node, so both lanes (NVRx 0.4.1 in .venv, 0.7 in the lane's root) measure it the same way.

Breakdown (``used_up_breakdown``), from the events log, the second loss's ``fault_injected`` on:
detect (-> node 0's ``waiting_for_nodes``: no spare, nothing announced), shut down (-> node 0's
``final``: ft_launcher stopped its workers and exited; as the rendezvous' store host, NVRx 0.4.1's
waits until the rendezvous has dropped the lost node, when its keep-alive expires, 0.7's 3 s), exit (->
the relaunch started: the launcher exits, and the bench starts the next launch at once, where the
control plane's relaunch rung takes its own time), launcher start (-> node 0's ``launch_begin`` of
the relaunch), rendezvous + start + restore (-> rank 0's ``train_begin``: ft_launcher, the
rendezvous, new workers, the checkpoint loaded), first step (-> the relaunch's ``restart_end``,
layer ``relaunch``). Headline figures: fault -> launch end (``loss_to_end_s``), launch end -> the
relaunch's first step (``end_to_first_step_s``), and the two together (``total_s``).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import ensure_dataset, log, summarize
from bench.restarts import injected_faults
from bench.training_plane.spare import run_nodes, spare_config_fields

#: The two losses: the first is covered by the spare (an in-job restart onto it), the second finds
#: none left. Each fires once, on the training node that holds the highest rank off node 0.
FAULT_STEPS = (10, 20)
STEPS_AFTER = 10
NODES, SPARES = 2, 1
#: The launch ids: the first launch, and the relaunch the ladder would submit after it.
FIRST_LAUNCH, RELAUNCH = "1", "2"
#: The breakdown's parts in time order.
PARTS = ("detect", "shut_down", "exit", "launcher_start", "start_restore", "first_step")


def used_up_config_fields(run_id: str, run_dir: Path, dataset: Path, procs_per_node: int) -> dict[str, Any]:
    """The run config of one trial (the relaunch uses the same): the takeover trial's, with the
    two losses."""
    return {
        **spare_config_fields(run_id, run_dir, dataset, procs_per_node),
        "steps": FAULT_STEPS[-1] + STEPS_AFTER,
        "faults": [
            {"kind": "node_loss", "step": step, "node": None, "attempt": None, "once": True} for step in FAULT_STEPS
        ],
    }


def _launch(record: dict[str, Any]) -> str:
    return str(record.get("launch_id", ""))


def _first(records: list[dict[str, Any]], after: float, launch: str, event: str, **match: Any) -> dict[str, Any] | None:
    return next(
        (
            r
            for r in records
            if r.get("event") == event
            and r["ts"] >= after
            and _launch(r) == launch
            and all(r.get(k) == v for k, v in match.items())
        ),
        None,
    )


def used_up_breakdown(
    events: list[dict[str, Any]],
    relaunch_started: float | None = None,
    first_launch: str = FIRST_LAUNCH,
    relaunch: str = RELAUNCH,
) -> dict[str, Any] | None:
    """One trial, from its events log (both launches) and when the relaunch was started (unix
    seconds; None: the exit and the launcher's start are one part): the second loss -> the launch's
    end -> the relaunch's first step, the breakdown (module docstring), what node 0 said
    (``waiting_for_nodes``, ``final``), and whether the relaunch resumed from the newest checkpoint
    committed before the launch ended. None when fewer than two node losses fired in the first
    launch; figures the log lacks (the launch did not end, or the relaunch did not train) are None."""
    records = sorted((r for r in events if isinstance(r.get("ts"), (int, float))), key=lambda r: r["ts"])
    losses = [r for r in injected_faults(records) if r.get("kind") == "node_loss" and _launch(r) == first_launch]
    if len(losses) < 2:
        return None
    first, loss = losses[0], losses[-1]
    f = loss["ts"]
    promoted = next(
        (r for r in records if r.get("event") == "spare_promoted" and first["ts"] < r["ts"] < f),
        None,
    )
    waiting = _first(records, f, first_launch, "waiting_for_nodes", node_rank=0)
    final = _first(records, f, first_launch, "final", node_rank=0)
    trial: dict[str, Any] = {
        "loss_steps": [r.get("step") for r in losses],
        "lost_node_ranks": [r.get("node_rank") for r in losses],
        "promoted_node_rank": promoted.get("node_rank") if promoted else None,
        "fault_ts": f,
        "waiting": {k: waiting.get(k) for k in ("missing_node_ranks", "until", "why")} if waiting else None,
        "final": {k: final.get(k) for k in ("failure_class", "message", "step", "checkpoint_id")} if final else None,
        "ended_in_seconds": bool(
            final
            and final.get("failure_class") == "restarts_exhausted"
            and "no spare left" in (final.get("message") or "")
        ),
    }
    end = final["ts"] if final else None
    committed = [
        r
        for r in records
        if r.get("event") == "checkpoint_commit" and _launch(r) == first_launch and r["ts"] <= (end or f)
    ]
    newest = max(committed, key=lambda r: (r.get("step") or 0, r["ts"]), default=None)
    after = end if end is not None else f
    began = _first(records, after, relaunch, "launch_begin", node_rank=0)
    start = _first(records, after, relaunch, "train_begin", rank=0)
    done = _first(records, after, relaunch, "restart_end", rank=0) or _first(records, after, relaunch, "step")
    started = relaunch_started if relaunch_started is not None and end is not None and relaunch_started >= end else None

    def gap(a: float | None, b: float | None) -> float | None:
        return round(b - a, 4) if a is not None and b is not None else None

    ts = lambda r: r["ts"] if r else None  # noqa: E731
    trial.update(
        loss_to_end_s=gap(f, end),
        end_to_first_step_s=gap(end, ts(done)),
        total_s=gap(f, ts(done)),
        restart_end={"layer": done.get("layer"), "latency_s": done.get("latency_s")} if done else None,
        resumed_step=(start or {}).get("start_step"),
        newest_committed=newest.get("checkpoint_id") if newest else None,
        resumed_from=(start or {}).get("resumed_from"),
        faults_in_relaunch=sum(1 for r in records if r.get("event") == "fault_injected" and _launch(r) == relaunch),
        parts={
            "detect": gap(f, ts(waiting)),
            "shut_down": gap(ts(waiting), end),
            "exit": gap(end, started),
            "launcher_start": gap(started if started is not None else end, ts(began)),
            "start_restore": gap(ts(began), ts(start)),
            "first_step": gap(ts(start), ts(done)),
        },
    )
    trial["resumed_newest"] = start is not None and trial["resumed_from"] == trial["newest_committed"]
    if started is None:
        del trial["parts"]["exit"]  # launcher_start then counts from the launch's end
    return trial


def bench_spares_used_up(args: argparse.Namespace, work: Path, trials: int, procs_per_node: int = 2) -> dict[str, Any]:
    """``trials`` runs of their own, each a launch that uses its spare up and ends, and the
    relaunch after it; statistics over them."""
    from fsdp_resilience.training.contract import RunConfig, read_events

    dataset = ensure_dataset(work / "data" / "stdlib-text", python=sys.executable)
    root = work / "runs" / "spares_used_up"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    results, runs = [], []
    t0 = time.time()
    for i in range(trials):
        cfg = RunConfig(**used_up_config_fields(f"usedup-{i}", root / f"usedup-{i}", dataset, procs_per_node))
        cfg_path = root / f"usedup-{i}.json"
        cfg_path.write_text(cfg.to_json())
        codes, _, wall = run_nodes(cfg_path, cfg.launch_nodes, args.run_timeout_s, {"TRAINING_LAUNCH_ID": FIRST_LAUNCH})
        relaunch_started = time.time()
        codes2, _, wall2 = run_nodes(cfg_path, NODES, args.run_timeout_s, {"TRAINING_LAUNCH_ID": RELAUNCH}, "relaunch.")
        trial = used_up_breakdown(read_events(cfg.layout.events), relaunch_started)
        runs.append(
            {
                "trial": i,
                "exit_codes": codes,
                "relaunch_exit_codes": codes2,
                "wall_s": round(wall, 1),
                "relaunch_wall_s": round(wall2, 1),
                "run_dir": str(cfg.layout.root),
            }
        )
        if trial is not None:
            results.append({**trial, "trial": i, "relaunch_succeeded": codes2 == [0] * NODES})
        log(
            f"spares used up, trial {i}: exit codes {codes}, relaunch {codes2}; "
            + (
                f"loss -> end {trial['loss_to_end_s']} s, end -> first step {trial['end_to_first_step_s']} s, "
                f"resumed from {trial['resumed_from']} (newest {trial['newest_committed']}); {trial['parts']}"
                if trial
                else "fewer than two node losses fired"
            )
        )
    done = [t for t in results if t["total_s"] is not None]
    return {
        "wall_s": round(time.time() - t0, 1),
        "nodes": NODES,
        "spare_nodes": SPARES,
        "procs_per_node": procs_per_node,
        "fault_steps": list(FAULT_STEPS),
        "restart_mode": "layered",
        "trials": results,
        "runs": runs,
        "loss_to_end_s": summarize(t["loss_to_end_s"] for t in done),
        "end_to_first_step_s": summarize(t["end_to_first_step_s"] for t in done),
        "total_s": summarize(t["total_s"] for t in done),
        "parts_median_s": {p: summarize(t["parts"].get(p) for t in done).get("median") for p in PARTS},
        "all_ended_in_seconds": len(results) == trials and all(t["ended_in_seconds"] for t in results),
        "all_resumed_newest": len(done) == trials and all(t["resumed_newest"] for t in done),
        "all_relaunched": len(done) == trials and all(t["relaunch_succeeded"] for t in done),
        "note": "training plane only: one fsdp_resilience.training.launch per node (2 training nodes, 1 spare), "
        f"node_loss drills at steps {FAULT_STEPS[0]} (the spare takes the lost node's place) and {FAULT_STEPS[1]} "
        "(no spare left: node 0 ends the launch); then the bench relaunches nodes 0 and 1 at once (launch id "
        f"{RELAUNCH}, the same config), with no control plane between: its relaunch rung's time comes on top. "
        "Second loss -> node 0's final (loss_to_end_s) -> the relaunch's first completed step "
        "(end_to_first_step_s, restart_end of layer relaunch)",
    }
