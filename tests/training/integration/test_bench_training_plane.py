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
    assert size["targets"]["nvrx_async <= 0.2x memcpy"] == (size["ratios"]["nvrx_async_over_memcpy"] <= 0.2)
    # Every method's save is followed by the model's next forward and backward; the project's
    # snapshot copy ran during it, and what was left of the copy is part of its blocking.
    assert all(m["next_step_s"]["median"] > 0 for m in methods.values())
    assert methods["nvrx_async"]["breakdown_median_s"]["snapshot_wait_s"] >= 0
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


# ---------------------------------------------------------------------------------------------
# The NVRx 0.7 lane's part: its spare takeover breakdown, its results in the summary, and the
# lane's bench mode. Synthetic logs and results: no timing is asserted.
# ---------------------------------------------------------------------------------------------

T0 = 1_800_000_000.0  # a unix time; the launcher lines below are written in local time from it


def _ft07(ts: float, message: str) -> str:
    """A line of NVRx 0.7's ft_launcher log (local time, milliseconds)."""
    from datetime import datetime

    stamp = datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S,%f")[:-3]
    return f"{stamp} [INFO] [host] [workload:?(?) infra:?(?)] launcher.py:636 {message}"


def _spare_run_events() -> list[dict]:
    """Node 1 lost at T0 + 1; node 0's in-process layer tries, the spare (node 2) is promoted, and
    the first step after the restart completes at T0 + 12."""
    return [
        {"event": "step", "ts": T0, "step": 19, "rank": 0, "node_rank": 0, "step_s": 0.1, "pid": 1, "attempt": 0},
        {"event": "fault_injected", "ts": T0 + 1, "kind": "node_loss", "step": 20, "node_rank": 1, "rank": 3},
        {"event": "fault_injected", "ts": T0 + 1.001, "kind": "node_loss", "step": 20, "node_rank": 1, "rank": 2},
        {"event": "restart_begin", "ts": T0 + 1.3, "layer": "inprocess", "rank": 0, "node_rank": 0},
        {"event": "spare_promoted", "ts": T0 + 9.5, "node_rank": 2, "replaced_node_ranks": [1]},
        {"event": "train_begin", "ts": T0 + 11, "rank": 0, "node_rank": 0, "attempt": 1},
        {"event": "restart_end", "ts": T0 + 12, "layer": "injob", "latency_s": 11.0, "step": 16, "rank": 0},
    ]


def test_spare_takeover_is_broken_down_from_the_events_and_node_0s_ft_launcher_log():
    from bench.restarts import launcher_marks
    from bench.training_plane.spare import spare_breakdown

    log07 = "\n".join(
        [
            "E1205 08:13:19.548000 35 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1)",
            _ft07(T0 + 6, "[default] Worker group FAILED. 4/4 attempts left; will restart worker group"),
            _ft07(T0 + 7, "The node 'localhost_35_0' attempts to join the next round of the rendezvous 'x'."),
            _ft07(T0 + 9, "The node 'localhost_35_0' has joined the rendezvous 'x' as rank 0 in a world of size 2."),
        ]
    )
    assert [m for _, m in launcher_marks(log07)] == ["worker_failed", "rdzv_join", "rdzv_joined"]
    # 0.4.1's format still parses
    old = "[2026-12-02 02:18:03,123] [INFO] [ft_launcher@host] [default] Worker group FAILED. 3/4 attempts left"
    assert [m for _, m in launcher_marks(old)] == ["worker_failed"]

    trial = spare_breakdown(_spare_run_events(), [log07, "node 2's log: not read"])
    assert trial["kind"] == "node_loss" and trial["layer"] == "injob" and trial["latency_s"] == 11.0
    assert trial["lost_node_rank"] == 1 and trial["promoted_node_rank"] == 2
    assert trial["promoted_s"] == pytest.approx(8.5)
    assert trial["parts"] == pytest.approx(
        {"detect": 5.0, "tear_down": 1.0, "rendezvous": 2.0, "start_restore": 2.0, "first_step": 1.0}, abs=0.002
    )
    # No launcher log (or it never restarted): one bucket from the fault to the new workers.
    bare = spare_breakdown(_spare_run_events(), [])
    assert bare["parts"]["detect_to_new_workers"] == pytest.approx(10.0) and bare["parts"]["first_step"] == 1.0
    # A run where the loss never fired gives no trial.
    assert spare_breakdown([e for e in _spare_run_events() if e["event"] != "fault_injected"], [log07]) is None


def _lane(version: str, label: str, spare_s: float, sigkill_s: float) -> dict:
    """A training-plane lane's results as bench.training_plane writes them (recovery and spare)."""
    stat = lambda v: {"n": 1, "min": v, "median": v, "max": v, "mean": v, "values": [v]}  # noqa: E731
    parts = {"detect": 5.0, "tear_down": 1.0, "rendezvous": 2.0, "start_restore": spare_s - 9.0, "first_step": 1.0}
    return {
        "versions": {"torch": "2.14.1+debian", "nvidia-resiliency-ext": version},
        "lane": {"name": "x", "label": label},
        "recovery": {
            "settings": {
                "model": "tiny",
                "seq_len": 64,
                "batch_size": 4,
                "collective_timeout_s": 3.0,
                "heartbeat_timeout_s": 30.0,
                "hang_timeout_s": 5.0,
            },
            "rows": [
                {
                    "kind": "sigkill",
                    "restart_mode": "layered",
                    "layer": "injob",
                    "latency_s": stat(sigkill_s),
                    "parts_median_s": {"detect": 0.4},
                    "target_s": 5.0,
                    "target_met": sigkill_s <= 5.0,
                },
                {
                    "kind": "sigkill",
                    "restart_mode": "torchrun",
                    "layer": "torchrun",
                    "latency_s": stat(4.0),
                    "parts_median_s": {},
                },
            ],
            "vs_torchrun": {
                "sigkill": {
                    "injob_median_s": sigkill_s,
                    "injob_n": 1,
                    "torchrun_median_s": 4.0,
                    "torchrun_n": 1,
                    "ratio": round(sigkill_s / 4.0, 3),
                    "at_least_as_fast": sigkill_s <= 4.0,
                }
            },
        },
        "spare": {
            "nodes": 2,
            "spare_nodes": 1,
            "procs_per_node": 2,
            "recovery_s": stat(spare_s),
            "promoted_s": stat(spare_s - 2),
            "parts_median_s": parts,
            "all_covered_in_job": True,
            "trials": [],
        },
    }


def test_the_nvrx07_lane_is_summarised_first_with_its_own_targets():
    from bench.summarize.benchmarks_md import render_markdown
    from bench.summarize.readme import readme_block
    from bench.summarize.targets import targets

    label07 = "NVRx 0.7.0 (Debian testing chroot, Python 3.14, Debian CPU torch 2.14.1)"
    label04 = "NVRx 0.4.1 (.venv, Python 3.11, torch 2.13.0+cpu)"
    summary = {
        "training_plane_nvrx07": _lane("0.7.0", label07, spare_s=16.9, sigkill_s=4.5),
        "training_plane": _lane("0.4.1", label04, spare_s=24.0, sigkill_s=5.1),
    }
    rows = targets(summary)
    figures = [f for f, *_ in rows]
    # the 0.7 lane's rows first, each lane's named by its NVRx
    assert figures[0].startswith("recovery on NVRx 0.7.0, sigkill (layered) → injob")
    first04 = next(i for i, f in enumerate(figures) if "NVRx 0.4.1" in f)
    assert all("NVRx 0.7.0" in f for f in figures[:first04])
    spare07 = next(r for r in rows if r[0].startswith("spare takeover on NVRx 0.7.0"))
    # missed (16.9 s > 8 s) and said so, with where the time went
    assert spare07[1] == "≤ 8 s" and spare07[3] is False and "16.9 s" in spare07[2]
    assert "detect (in-process layer gives up) 5.00 s" in spare07[0] and "start + restore 7.90 s" in spare07[0]
    spare04 = next(r for r in rows if r[0].startswith("spare takeover on NVRx 0.4.1"))
    assert spare04[1] == "no relaunch" and spare04[3] is True
    assert sum(1 for r in rows if "torchrun" in r[0]) == 2  # the baseline ratio, per lane
    # a target the 0.7 lane met reads met
    fast = {**summary, "training_plane_nvrx07": _lane("0.7.0", label07, spare_s=7.5, sigkill_s=4.5)}
    assert next(r for r in targets(fast) if r[0].startswith("spare takeover on NVRx 0.7.0"))[3] is True

    page = render_markdown(summary)
    assert page.index(f"**{label07}**") < page.index(f"**{label04}**")
    assert page.index("spare takeover on NVRx 0.7.0") < page.index("spare takeover on NVRx 0.4.1")
    assert f"| {label07} | 2 × 2 ranks + 1 | 1 | 16.9 s (n=1) |" in page
    assert "--only training_plane_nvrx07" in page
    block = readme_block(summary)
    assert block.index(f"Recovery on {label07}") < block.index(f"Recovery on {label04}")
    assert "a hot spare in the lost node's place 16.9 s (training plane)" in block
    # without the 0.7 lane the page and the README are as before: one lane, not labelled
    alone = {"training_plane": summary["training_plane"]}
    assert "**NVRx" not in render_markdown(alone) and "- Recovery, fault" in readme_block(alone)


def test_bench_run_runs_the_nvrx07_part_through_the_lane_inside_the_repository():
    from bench.run import NVRX07_LANE, PARTS, part_command

    (part,) = [p for p in PARTS if p[0] == "training_plane_nvrx07"]
    _, python, module, extra = part
    assert python == NVRX07_LANE and module == "bench.training_plane"
    assert ["--lane", "nvrx07", "--name", "training_plane_nvrx07"] == extra[:4]
    command = part_command(python, module, "bench/results", extra, quick=True)
    assert command[:4] == ["bash", "tests/nvrx07/lane.sh", "--bench", "bench.training_plane"]
    assert command[4:6] == ["--out", "bench/results"] and command[-1] == "--quick"
    # the root mounts the repository only: an --out outside it cannot be written from there
    assert part_command(python, module, "/tmp/elsewhere", extra, quick=False) is None
    venv = part_command(REPO / ".venv" / "bin" / "python", "bench.training_plane", "bench/results", [], False)
    assert venv[1:4] == ["-W", "ignore", "-m"]


@pytest.mark.parametrize(
    ("args", "env", "code", "says"),
    [
        (["--bench"], {}, 2, "usage: lane.sh --bench MODULE"),
        (["--bench", "--out", "x"], {}, 2, "usage: lane.sh --bench MODULE"),
        (["--bench", "platform"], {"NVRX07_LANE": "skip"}, 3, "skipped: NVRX07_LANE=skip"),
        (["__inside__", "bench", "/nonexistent-root", "/nonexistent-repo"], {}, 2, "bench mode needs a module"),
        (["__inside__", "nonsense", "/nonexistent-root"], {}, 2, "unknown inside mode"),
    ],
)
def test_the_lanes_bench_mode_checks_its_arguments_before_touching_anything(args, env, code, says):
    """lane.sh --bench MODULE [ARGS]: without a module it says how to call it (exit 2); where the
    lane cannot run it exits 3 (bench.run: the part is skipped, not failed), not 0 as the tests'
    mode does, since no figures were written. None of these mounts or enters a root."""
    import os

    out = subprocess.run(
        ["bash", str(REPO / "tests" / "nvrx07" / "lane.sh"), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "CI": "", **env},
    )
    assert out.returncode == code, out.stdout + out.stderr
    assert says in out.stdout + out.stderr


def test_a_training_plane_part_measured_again_is_merged_and_keeps_the_others_load_record():
    from bench.training_plane.cli import lane_label, merge_parts

    old = {"stall": {"sizes": [1]}, "load": {"old": True}, "versions": {"nvidia-resiliency-ext": "0.4.1"}}
    new = {"spare": {"recovery_s": {"n": 1}}, "load": {"new": True}, "versions": {"nvidia-resiliency-ext": "0.4.1"}}
    merged = merge_parts(old, new, ["spare"])
    assert merged["stall"] == old["stall"] and merged["spare"] == new["spare"]
    assert merged["load"] == {"old": True}  # the stall section's load record stays
    assert merged["measured"]["spare"]["load"] == {"new": True}
    versions = {"torch": "2.14.1+debian", "nvidia-resiliency-ext": "0.7.0"}
    assert lane_label("nvrx07", versions, "3.14.8") == (
        "NVRx 0.7.0 (Debian testing chroot, Python 3.14, Debian CPU torch 2.14.1)"
    )
    assert lane_label("venv", {"torch": "2.13.0+cpu", "nvidia-resiliency-ext": "0.4.1"}, "3.11.2") == (
        "NVRx 0.4.1 (.venv, Python 3.11, torch 2.13.0+cpu)"
    )


def test_the_torchrun_comparison_says_what_the_worker_zygote_saves():
    from bench.summarize.targets import targets
    from bench.training_plane.recovery import NO_ZYGOTE_LAYER, versus_torchrun

    trials = [
        {"kind": "sigkill", "layer": "injob", "latency_s": 2.0},
        {"kind": "sigkill", "layer": "torchrun", "latency_s": 4.0},
        {"kind": "sigkill", "layer": NO_ZYGOTE_LAYER, "latency_s": 5.0},
        {"kind": "oom", "layer": "injob", "latency_s": 3.0},
        {"kind": "oom", "layer": "torchrun", "latency_s": 4.0},
    ]
    compared = versus_torchrun([{"trials": trials}])
    # The rows without the zygote are not the project's in-job restarts: only said beside them.
    assert compared["sigkill"]["ratio"] == 0.5 and compared["sigkill"]["injob_n"] == 1
    assert compared["sigkill"]["injob_no_zygote_median_s"] == 5.0 and compared["sigkill"]["zygote_saves_s"] == 3.0
    assert "zygote_saves_s" not in compared["oom"]
    label = "NVRx 0.4.1 (.venv, Python 3.11, torch 2.13.0+cpu)"
    lane = _lane("0.4.1", label, spare_s=20.0, sigkill_s=2.0)
    lane["recovery"]["vs_torchrun"] = compared
    rows = {r[0].split(":")[0]: r for r in targets({"training_plane": lane}) if "torchrun" in r[0]}
    sigkill = rows["recovery on NVRx 0.4.1, sigkill"]
    assert sigkill[1] == "≤ 0.5×" and sigkill[3] is True and "it saves 3.00 s" in sigkill[0]
    assert rows["recovery on NVRx 0.4.1, oom"][3] is False  # 0.75×
