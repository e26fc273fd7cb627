"""The benchmarks (bench/): the fault-schedule and interval model they are built on, a quick smoke
run of the training-plane benchmark (real ranks, real NVRx writer, real saves), and the committed
table matching the committed results."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.common import (
    LLAMA3_INTERRUPTIONS,
    apportion,
    assign_attempts,
    drill_weights,
    ettr_model,
    spread_schedule,
    young_interval,
)

from training.support import REPO


def test_llama3_mix_is_apportioned_to_drills():
    assert sum(count for _, count, *_ in LLAMA3_INTERRUPTIONS) == 419
    weights = drill_weights()
    assert list(weights)[:2] == ["sigkill", "oom"]  # GPU faults dominate, then memory errors
    assert weights["sigkill"] + weights["oom"] == pytest.approx((148 + 17 + 6 + 72 + 19) / 419)
    counts = apportion(10, weights)
    assert sum(counts.values()) == 10
    assert counts["sigkill"] >= counts["oom"] >= counts.get("hang", 0)
    assert apportion(419, weights) == {k: round(w * 419) for k, w in weights.items()}  # exact at the source size


def test_schedule_is_seeded_spread_and_fires_each_fault_once():
    kinds = ["sigkill", "exception", "node_loss", "checkpoint_crash", "oom", "hang"]
    first = spread_schedule(kinds, first_step=20, last_step=400, min_gap=16, interval=7, world_size=2, seed=5)
    assert first == spread_schedule(kinds, first_step=20, last_step=400, min_gap=16, interval=7, world_size=2, seed=5)
    steps = [d["step"] for d in first]
    assert steps == sorted(steps) and all(b - a >= 16 for a, b in zip(steps, steps[1:]))
    assert next(d for d in first if d["kind"] == "checkpoint_crash")["step"] % 7 == 0  # fires after a save
    drills = assign_attempts(first, "layered", slot_prefix="slot-")
    # the launcher round moves on after each fault ft_launcher recovers; a node loss starts a new
    # launch on the next slot, counting rounds from 0 again
    assert [(d["kind"], d["attempt"], d["node_id"]) for d in drills] == [
        ("sigkill", 0, "slot-0"),
        ("exception", 1, "slot-0"),
        ("node_loss", 1, "slot-0"),
        ("checkpoint_crash", 0, "slot-1"),
        ("oom", 0, "slot-1"),
        ("hang", 1, "slot-1"),
    ]
    with pytest.raises(ValueError, match="train more steps"):
        spread_schedule(kinds, first_step=20, last_step=60, min_gap=16, interval=7, world_size=2, seed=5)


def test_schedule_with_spares_aims_node_losses_past_node_0_and_counts_them_as_in_job_restarts():
    kinds = ["sigkill", "node_loss", "oom", "node_loss", "exception"]
    drills = spread_schedule(kinds, first_step=20, last_step=400, min_gap=16, interval=7, world_size=2, seed=5)
    # two nodes of one rank each and one spare: a node loss is an in-job restart (the launch
    # stays); which rounds come and which nodes train is the rendezvous's choice with spares, so
    # every drill fires once, on whatever round reaches it, and a loss takes whichever training
    # node holds the highest rank off node 0 (node null)
    spared = assign_attempts(drills, "layered", nodes=2, procs_per_node=1, spare_nodes=1)
    assert [(d["kind"], d["attempt"], d.get("node", "-"), d["once"]) for d in spared] == [
        ("sigkill", None, "-", True),
        ("node_loss", None, None, True),
        ("oom", None, "-", True),
        ("node_loss", None, None, True),
        ("exception", None, "-", True),
    ]
    assert all("node_id" not in d for d in spared)
    with pytest.raises(ValueError, match="node 0 hosts the rendezvous store"):
        assign_attempts(drills, "layered", nodes=1, procs_per_node=2, spare_nodes=1)
    # without spares the loss of node 1 relaunches on the next free slot: node 0 stays on slot-0
    plain = assign_attempts(drills, "layered", slot_prefix="slot-", nodes=2, procs_per_node=1)
    assert [(d["kind"], d["attempt"], d.get("node"), d["node_id"]) for d in plain] == [
        ("sigkill", 0, None, f"slot-{drills[0]['rank']}"),
        ("node_loss", 1, 1, "slot-1"),
        ("oom", 0, None, "slot-0" if drills[2]["rank"] == 0 else "slot-2"),
        ("node_loss", 1, 1, "slot-2"),
        ("exception", 0, None, "slot-0" if drills[4]["rank"] == 0 else "slot-3"),
    ]


def test_young_daly_interval_is_where_the_modeled_ettr_peaks():
    save, mtbf = 0.08, 600.0
    tau = young_interval(save, mtbf)
    assert tau == pytest.approx((2 * save * mtbf) ** 0.5)

    def ettr(interval: float) -> float:
        return ettr_model(interval, save_cost_s=save, mtbf_s=mtbf, restart_s=6.0, commit_s=0.5, loop_overhead=0.02)

    assert ettr(tau) > ettr(tau / 2) and ettr(tau) > ettr(2 * tau)
    assert ettr(tau) < 1 - 0.02  # never better than the fault-free loop


@pytest.mark.slow
def test_quick_training_plane_bench_measures_every_method(tmp_path):
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "bench.training_plane", "--quick", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=420,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    result = json.loads((tmp_path / "training_plane.quick.json").read_text())
    assert result["load"]["cores"] >= 1 and result["load"]["loadavg_1m_during"]["n"] >= 1
    (size,) = result["stall"]["sizes"]
    methods = size["methods"]
    assert set(methods) == {
        "memcpy",
        "nvrx_async",
        "nvrx_async_no_checksum",
        "torch_async_save_thread",
        "torch_async_save_process",
        "dcp_save",
        "torch_save",
    }
    # torch's baseline is the better of its two checkpointers, each with a persistent stager
    best = size["torch_async_save_best"]
    assert best in ("torch_async_save_thread", "torch_async_save_process")
    assert methods[best]["blocking_s"]["median"] == min(
        methods[m]["blocking_s"]["median"] for m in ("torch_async_save_thread", "torch_async_save_process")
    )
    assert methods[best]["staging_options"]["use_shared_memory"] is True
    # every method's stall includes the state-dict collection the loop does (not the memcpy floor)
    assert all(m["state_dict_s"]["n"] == 2 for k, m in methods.items() if k != "memcpy")
    # writer interference: steps with a save in flight over steps without, per async method
    for name in ("nvrx_async", "torch_async_save_thread", "torch_async_save_process"):
        m = methods[name]
        assert m["step_s_save_in_flight"]["n"] >= 2 and m["step_s_idle"]["n"] >= 2, name
        assert m["interference"] == pytest.approx(
            m["step_s_save_in_flight"]["median"] / size["step_s_idle"]["median"], rel=0.01
        )
    # what checksums cost: measured side by side, in the writer (per save) and on the stall
    assert methods["nvrx_async"]["checksum_s_per_save"]["n"] == 2
    assert methods["nvrx_async"]["checksum_s_per_save"]["min"] > 0
    assert size["ratios"]["checksum_stall_overhead"] == pytest.approx(
        methods["nvrx_async"]["blocking_s"]["median"] / methods["nvrx_async_no_checksum"]["blocking_s"]["median"] - 1,
        abs=0.002,
    )
    for name, m in methods.items():
        b = m["blocking_s"]
        assert b["n"] == 2 and 0 < b["min"] <= b["median"] <= b["max"], name
        assert m["complete_s"]["median"] >= b["median"], name  # an async save finishes after it returns
    assert methods["memcpy"]["blocking_s"]["median"] < methods["dcp_save"]["blocking_s"]["median"]
    # the first save waits for the writer process to start: recorded apart, not in the figures
    assert methods["nvrx_async"]["warmup_blocking_s"][0] > methods["nvrx_async"]["blocking_s"]["max"]
    ratio = methods["nvrx_async"]["blocking_s"]["median"] / methods["memcpy"]["blocking_s"]["median"]
    assert size["ratios"]["nvrx_async_over_memcpy"] == pytest.approx(ratio, rel=0.01)
    assert size["targets"]["nvrx_async <= 1.5x memcpy"] == (size["ratios"]["nvrx_async_over_memcpy"] <= 1.5)
    evaluation = result["eval_load"]
    assert evaluation["saved_world_size"] == 2 and evaluation["model_mb"] < evaluation["file_mb"]
    seconds = evaluation["seconds"]
    # Both measured (which is larger is the benchmark's finding, not something a loaded machine keeps).
    assert seconds["load_model"]["median"] > 0 and seconds["build_model_only"]["median"] > 0
    assert seconds["verify_checksums"]["median"] > 0 and evaluation["ratios"]["verify_gib_per_s"] > 0
    assert evaluation["ratios"]["load_over_raw_read_model_bytes"] == pytest.approx(
        seconds["load_model"]["median"] / seconds["raw_read_model_bytes"]["median"], rel=0.01
    )


def test_committed_table_matches_the_committed_results():
    latest = REPO / "bench" / "results" / "latest.json"
    if not latest.exists():
        pytest.skip("no committed benchmark results (make bench writes bench/results/latest.json)")
    from bench.summarize.benchmarks_md import render_markdown

    summary = json.loads(latest.read_text())
    assert (REPO / "docs" / "benchmarks.md").read_text() == render_markdown(summary)
    from bench.summarize.readme import readme_block

    assert readme_block(summary) in (REPO / "README.md").read_text()  # the README's table too
