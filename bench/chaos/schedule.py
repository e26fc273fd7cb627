"""The chaos run's plan (checkpoint interval, seeded fault schedule by the Llama 3 mix) and when to stop it."""

from __future__ import annotations

import argparse
import math
import random
import time
from typing import Any, Callable

from bench.chaos.calibration import DEFAULT_COST_S, STARTUP_S
from bench.common import apportion, assign_attempts, drill_weights, spread_schedule, young_interval
from bench.restarts import injected_faults
from fsdp_resilience.training.contract import RunConfig, read_events


def plan(args: argparse.Namespace, cal: dict[str, Any]) -> dict[str, Any]:
    """The run: checkpoint interval (Young/Daly at the run's fault rate), fault kinds by the Llama 3
    mix, and the seeded schedule spread over the steps expected in ``duration_s``. The step count
    is a ceiling (twice that): the benchmark stops the run once it has lasted ``duration_s`` and
    recovered from every fault, so a faster or slower machine than calibrated still gets a run
    of the requested length with every fault in it."""
    n_faults = max(1, round(args.duration_s / args.mtbf_s))
    counts = apportion(n_faults, drill_weights())
    kinds = [k for k, c in counts.items() for _ in range(c)]
    random.Random(args.seed).shuffle(kinds)
    interval_s = young_interval(cal["save_cost_s"], args.mtbf_s)
    interval = max(1, round(interval_s / cal["step_time_s"]))
    lost_s = n_faults * (interval * cal["step_time_s"] / 2)
    fault_s = sum(cal["cost_s"].get(k, DEFAULT_COST_S[k]) for k in kinds)
    expected = max(40 * n_faults, math.ceil((args.duration_s - STARTUP_S - fault_s - lost_s) / cal["step_time_s"]))
    gap = max(3 * interval + 4, 12)
    drills = spread_schedule(
        kinds,
        first_step=max(2 * interval + 5, 20),
        last_step=int(0.95 * expected),
        min_gap=gap,
        interval=interval,
        world_size=args.nodes * args.procs_per_node,
        seed=args.seed,
    )
    # Without spares each drill is tied to its launch's slot (a relaunch replays steps); with
    # spares a node loss fires on any round, at node 1 and then at the spares (assign_attempts).
    return {
        "n_faults": n_faults,
        "counts": counts,
        "interval_steps": interval,
        "interval_s_target": interval_s,
        "expected_steps": expected,
        "steps": 2 * expected,
        "drills": assign_attempts(
            drills,
            "layered",
            slot_prefix=None if args.spare_nodes else "slot-",
            nodes=args.nodes,
            procs_per_node=args.procs_per_node,
            spare_nodes=args.spare_nodes,
        ),
    }


def stop_when_done(cfg: RunConfig, duration_s: float, n_faults: int, limit_s: float) -> Callable[[], bool]:
    """True once the run has lasted ``duration_s`` (from its first launch) and every scheduled
    fault fired and was recovered from (a step completed after the last one); or at ``limit_s``."""

    def stop() -> bool:
        events = read_events(cfg.layout.events)
        begins = [r["ts"] for r in events if r.get("event") == "launch_begin"]
        if not begins:
            return False
        lasted = time.time() - min(begins)
        if lasted >= limit_s:
            return True
        if lasted < duration_s:
            return False
        faults = injected_faults(events)
        return len(faults) >= n_faults and any(
            r.get("event") == "restart_end" and r["ts"] > faults[-1]["ts"] for r in events
        )

    return stop
