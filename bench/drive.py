"""Run training the way the fsdp_training DAG does, minus Airflow's scheduler, and time the control
plane's part of each relaunch.

``drive`` submits launch 0 to a backend, watches it with the deferrable sensor's own trigger
(``fsdp_resilience.control.triggers.training_progress.TrainingProgressTrigger``, run with asyncio as
the triggerer runs it: a full check every ``poll_s``, 5 s like the sensor, and a look for the
launch's end every 0.2 s in between), and when a launch fails with a retryable class climbs the
escalation ladder with the DAG's own functions (``fsdp_resilience.control.ladder``): diagnose and
replace the node, wait for capacity (the check the DAG's ``wait_for_capacity`` trigger makes, first
at once, then every 10 s), relaunch from the newest committed checkpoint. With hot spares
(``spare_nodes``) the pool keeper runs next to the watch, as the DAG's ``keep_spare_pool`` task
does: the spare pool trigger (``fsdp_resilience.control.triggers.spare_pool.SparePoolTrigger``)
fires when a node of the running launch is out of the job (a spare takes its place in-job; the job
stays running), and ``spare_refill.keep_spare_pool`` quarantines that node and adds a new spare, then the
trigger is started again.
What this leaves out of a real deployment: the scheduler starting each task (seconds per task in
a busy Airflow) and the triggerer's own loop. Torch-free: runs in the control-plane venv.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

from bench.common import log
from bench.restarts import injected_faults
from fsdp_resilience.control import ladder, spare_refill  # noqa: E402
from fsdp_resilience.control.backends import JobHandle, get_backend  # noqa: E402
from fsdp_resilience.control.task_data import Launch, Outcome, Run  # noqa: E402
from fsdp_resilience.control.triggers.base import LAUNCH_ENDED  # noqa: E402
from fsdp_resilience.control.triggers.spare_pool import SparePoolTrigger  # noqa: E402
from fsdp_resilience.control.triggers.training_progress import TrainingProgressTrigger  # noqa: E402
from fsdp_resilience.training.contract import RunConfig, read_events  # noqa: E402

CAPACITY_POLL_S = 10.0  # the DAG's wait_for_capacity (NodeCapacitySensor) poll interval


def has_capacity(run: Run) -> bool:
    """What the DAG's wait_for_capacity asks: can the backend place the run's nodes now?"""
    return get_backend(**run.backend).capacity().fits(run.config["nodes"])


async def _first_event(trigger: Any) -> dict[str, Any]:
    async for event in trigger.run():
        return event.payload
    raise RuntimeError(f"{type(trigger).__name__} ended without an event")


async def keep_spare_pool(run: Run, launch: Launch, since: float, poll_s: float, refills: list[dict[str, Any]]) -> None:
    """The DAG's keep_spare_pool task for one launch, minus Airflow: wait on the spare pool
    trigger, make up for the nodes it names with ``spare_refill.keep_spare_pool`` (``since``: the run's
    first launch, which bounds the replacements counted), and wait again, until the launch ends.
    Appends each node's result, with when the pool keeper saw it and when it was done, to
    ``refills``."""
    handled = spare_refill.handled_nodes(run, launch)
    while True:
        trigger = SparePoolTrigger(
            backend=launch.backend,
            handle=launch.handle,
            run_dir=launch.run_dir,
            handled=handled,
            poll_interval_s=poll_s,
            checkpoints_s3=launch.checkpoints_s3,
        )
        event = await _first_event(trigger)
        if event["status"] == LAUNCH_ENDED:
            return
        seen_at = time.time()
        results = await asyncio.to_thread(spare_refill.keep_spare_pool, run, launch, event["nodes"], since, log)
        done_at = time.time()
        refills += [{**r, "launch_id": launch.launch_id, "seen_at": seen_at, "done_at": done_at} for r in results]
        # As the DAG's task: a node not refilled (budget spent, no capacity) is not retried.
        handled = sorted(set(handled) | {r["key"] for r in results})


def watch(
    launch: Launch,
    poll_s: float,
    deadline: float,
    stop: Callable[[], bool] | None = None,
    pool: dict[str, Any] | None = None,
) -> tuple[Outcome | None, float]:
    """Run the sensor's trigger on one launch until it fires (succeeded, failed or stalled):
    (its Outcome, when it fired); or until ``stop()``, asked every ``poll_s``, says the benchmark
    has what it needs: (None, when). With ``pool`` (``{"run", "since", "refills"}``: a run with
    spares) the spare pool keeper runs alongside until then."""
    trigger = TrainingProgressTrigger(**launch.to_dict(), poll_interval_s=poll_s)

    async def first_event() -> tuple[Outcome | None, float]:
        task = asyncio.ensure_future(_first_event(trigger))
        keeper = (
            asyncio.ensure_future(keep_spare_pool(pool["run"], launch, pool["since"], poll_s, pool["refills"]))
            if pool is not None
            else None
        )
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=poll_s)
                if done:
                    event = task.result()
                    return Outcome.from_dict({k: v for k, v in event.items() if k != "status"}), time.time()
                if keeper is not None and keeper.done() and keeper.exception() is not None:
                    raise keeper.exception()  # a bug in the pool keeper fails the benchmark loudly
                if stop is not None and stop():
                    return None, time.time()
                if time.time() > deadline:
                    raise TimeoutError(
                        f"launch {launch.launch_id} of {launch.handle['run_id']} was still running at the deadline"
                    )
        finally:
            task.cancel()
            if keeper is not None:
                keeper.cancel()

    return asyncio.run(first_event())


def drive(
    run: Run, *, poll_s: float = 5.0, timeout_s: float = 1800.0, stop: Callable[[], bool] | None = None
) -> dict[str, Any]:
    """Launch, watch, and escalate until the run succeeds or the ladder stops, or until ``stop()``
    (asked at every poll) is true: the running launch is then cancelled, as a user would. ``run``
    is what the DAG's ``validate_config`` returns (``Run``: config, backend, max_node_replacements).
    With spares (``spare_nodes`` in the config) the spare pool is kept whole next to each watch.
    Returns the outcome of every launch, the control plane's timestamps of every rung, and the
    pool keeper's result for every node it made up for (``refills``)."""
    deadline = time.time() + timeout_s
    launches: list[dict[str, Any]] = []
    rungs: list[dict[str, Any]] = []
    refills: list[dict[str, Any]] = []
    launch = ladder.launch(run, launch_no=0)
    pool = (
        {"run": run, "since": float(launch.launched_at), "refills": refills}
        if int(run.config.get("spare_nodes") or 0)
        else None
    )
    try:
        while True:
            outcome, seen_at = watch(launch, poll_s, deadline, stop, pool)
            if outcome is None:
                get_backend(**launch.backend).cancel(JobHandle.from_dict(launch.handle))
                launches.append(
                    {
                        "launch_id": launch.launch_id,
                        "outcome": "stopped",
                        "failure_class": None,
                        "message": "stopped by the benchmark",
                        "seen_at": seen_at,
                        "node_ids": launch.handle["extra"].get("node_ids"),
                    }
                )
                log(f"launch {launch.launch_id}: stopped by the benchmark")
                return {
                    "launches": launches,
                    "rungs": rungs,
                    "refills": refills,
                    "stopped_because": "stop condition",
                    "stopped_at": seen_at,
                }
            launches.append(
                {
                    "launch_id": outcome.launch_id,
                    "outcome": outcome.outcome,
                    "failure_class": outcome.failure_class,
                    "message": outcome.message,
                    "seen_at": seen_at,
                    "node_ids": launch.handle["extra"].get("node_ids"),
                }
            )
            log(f"launch {outcome.launch_id}: {outcome.outcome} ({outcome.failure_class}) {outcome.message[:120]}")
            rung = len(rungs) + 1
            climb, why = ladder.should_escalate(outcome, rung, run.max_node_replacements)
            if not climb:
                return {"launches": launches, "rungs": rungs, "refills": refills, "stopped_because": why}
            began = time.time()
            replaced = ladder.diagnose_and_replace(run, outcome, rung)
            replaced_at = time.time()
            while not has_capacity(run):
                if time.time() > deadline:
                    raise TimeoutError("no capacity for a relaunch before the deadline")
                time.sleep(CAPACITY_POLL_S)
            capacity_at = time.time()
            launch = ladder.launch(run, launch_no=ladder.next_launch_no(outcome))
            rungs.append(
                {
                    "rung": rung,
                    "from_launch": outcome.launch_id,
                    "to_launch": launch.launch_id,
                    "failure_seen_at": seen_at,
                    "began": began,
                    "replaced_at": replaced_at,
                    "capacity_at": capacity_at,
                    "submitted_at": time.time(),
                    "replaced": replaced["replaced"],
                    "failure_class": replaced["failure_class"],
                }
            )
    finally:
        get_backend(**launch.backend).cancel(JobHandle.from_dict(launch.handle))  # no-op when done


def relaunch_trials(cfg: RunConfig, driven: dict[str, Any]) -> list[dict[str, Any]]:
    """Per relaunch: seconds from the failed launch giving up (its launcher's ``final`` event, or
    the node loss that left no launcher to write one) to the first step of the relaunch, split
    into detect (the watch sees it), diagnose + replace, capacity + submit (-> the new launcher
    starts), start + restore (-> ``train_begin``) and first step (-> ``restart_end``)."""
    events = sorted(read_events(cfg.layout.events), key=lambda r: r["ts"])

    def first(launch_id: str, **match: Any) -> dict[str, Any] | None:
        return next(
            (
                r
                for r in events
                if str(r.get("launch_id", "")) == launch_id and all(r.get(k) == v for k, v in match.items())
            ),
            None,
        )

    trials = []
    for rung in driven["rungs"]:
        old, new = str(rung["from_launch"]), str(rung["to_launch"])
        final = first(old, event="final")
        faults = [r for r in events if r.get("event") == "fault_injected" and str(r.get("launch_id", "")) == old]
        fault = faults[-1] if faults else None
        gave_up = final["ts"] if final else (fault["ts"] if fault else None)
        begin = first(new, event="launch_begin")
        start = first(new, event="train_begin", rank=0)
        end = first(new, event="restart_end", layer="relaunch")
        if gave_up is None or end is None:
            trials.append({"rung": rung["rung"], "note": "relaunch did not complete a step", "total_s": None})
            continue
        marks = [
            ("detect", gave_up, rung["failure_seen_at"]),
            ("diagnose_replace", rung["failure_seen_at"], rung["replaced_at"]),
            ("capacity_submit", rung["replaced_at"], begin["ts"] if begin else None),
            ("start_restore", begin["ts"] if begin else None, start["ts"] if start else None),
            ("first_step", start["ts"] if start else None, end["ts"]),
        ]
        trials.append(
            {
                "rung": rung["rung"],
                "kind": fault.get("kind") if fault else None,
                "failure_class": rung["failure_class"],
                "replaced": rung["replaced"],
                "launch_failed_by": "final event" if final else "node lost (no final event)",
                "data_plane_s": round(gave_up - fault["ts"], 3) if (fault and final) else None,
                "total_s": round(end["ts"] - gave_up, 3),
                "parts": {
                    name: (round(b - a, 3) if (a is not None and b is not None) else None) for name, a, b in marks
                },
                "restart_end_latency_s": end.get("latency_s"),
            }
        )
    return trials


def spare_trials(cfg: RunConfig, driven: dict[str, Any]) -> list[dict[str, Any]]:
    """Per node loss of a run with spares: what covered it and how fast, from the events log.

    ``recovery_s``: the fault (``fault_injected``: the node is gone) -> the first completed step
    after it (``restart_end.latency_s``, as for every other rung), with the layer that recovered
    it and whether a relaunch was needed (a ``launch_begin`` of another launch in between);
    ``promoted``: the ``spare_promoted`` record that followed; ``refill_s``: the fault -> the
    control plane's ``spare_added`` for that node (the pool whole again), with when the pool
    keeper saw the node out of the job (``seen_s``) and finished (``done_s``)."""
    events = sorted(
        (r for r in read_events(cfg.layout.events) if isinstance(r.get("ts"), (int, float))), key=lambda r: r["ts"]
    )
    faults = injected_faults(events)
    trials = []
    for i, fault in enumerate(faults):
        if fault.get("kind") != "node_loss":
            continue
        f = fault["ts"]
        horizon = faults[i + 1]["ts"] if i + 1 < len(faults) else float("inf")
        launch_id = str(fault.get("launch_id", ""))
        end = next((r for r in events if r.get("event") == "restart_end" and f < r["ts"] < horizon), None)
        relaunched = any(
            r.get("event") == "launch_begin"
            and str(r.get("launch_id", "")) != launch_id
            and f < r["ts"] <= (end["ts"] if end else horizon)
            for r in events
        )
        promoted = next(
            (
                r
                for r in events
                if r.get("event") == "spare_promoted" and r["ts"] > f and str(r.get("launch_id", "")) == launch_id
            ),
            None,
        )
        added = next(
            (
                r
                for r in events
                if r.get("event") == "spare_added"
                and r["ts"] > f
                and r.get("lost_node_rank") == fault.get("node_rank")
                and str(r.get("launch_id", "")) == launch_id
            ),
            None,
        )
        kept = next(
            (
                r
                for r in driven.get("refills") or []
                if r.get("node_rank") == fault.get("node_rank") and str(r.get("launch_id")) == launch_id
            ),
            None,
        )
        trials.append(
            {
                "step": fault.get("step"),
                "launch_id": launch_id,
                "lost_node_rank": fault.get("node_rank"),
                "lost_node_id": fault.get("node_id"),
                "fault_ts": f,
                "recovered_by": end.get("layer") if end else None,
                "relaunched": relaunched,
                "recovery_s": end.get("latency_s") if end else None,
                "measured_s": round(end["ts"] - f, 3) if end else None,
                "promoted": (
                    {
                        "node_rank": promoted.get("node_rank"),
                        "node_id": promoted.get("node_id"),
                        "replaces": promoted.get("replaces"),
                        "after_s": round(promoted["ts"] - f, 3),
                    }
                    if promoted
                    else None
                ),
                "refill_s": round(added["ts"] - f, 3) if added else None,
                "refill": (
                    {
                        "node_rank": added.get("node_rank"),
                        "node_id": added.get("node_id"),
                        "quarantined": added.get("quarantined"),
                    }
                    if added
                    else None
                ),
                "pool_keeper": (
                    {
                        "seen_s": round(kept["seen_at"] - f, 3),
                        "done_s": round(kept["done_at"] - f, 3),
                        "refilled": kept["refilled"],
                        "why": kept["why"],
                    }
                    if kept
                    else None
                ),
            }
        )
    return trials
