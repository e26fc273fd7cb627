"""The chaos run's plan (bench/chaos/schedule.py): a fault per MTBF, kinds by the Llama 3 mix,
seeded, and a step ceiling twice the steps expected in the run's duration."""

from __future__ import annotations

import argparse

from bench.chaos.calibration import DEFAULT_COST_S
from bench.chaos.schedule import plan


def _args(**kw):
    return argparse.Namespace(
        **{"duration_s": 480.0, "mtbf_s": 60.0, "seed": 1234, "nodes": 1, "procs_per_node": 2, "spare_nodes": 0, **kw}
    )


CAL = {"save_cost_s": 0.2, "step_time_s": 0.1, "cost_s": dict(DEFAULT_COST_S)}


def test_the_plan_has_a_fault_per_mtbf_and_is_seeded():
    planned = plan(_args(), CAL)
    assert planned["n_faults"] == 8 and sum(planned["counts"].values()) == 8
    assert len(planned["drills"]) == 8
    assert planned["steps"] == 2 * planned["expected_steps"]
    assert plan(_args(), CAL) == planned
    steps = [d["step"] for d in planned["drills"]]
    assert steps == sorted(steps) and steps[-1] < planned["expected_steps"]


def test_without_spares_each_drill_is_tied_to_its_launch_slot():
    for drill in plan(_args(), CAL)["drills"]:
        assert str(drill.get("node_id", "slot-")).startswith("slot-")
