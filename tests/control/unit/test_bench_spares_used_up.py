"""The node loss when the spares are used up (bench/training_plane/spares_used_up.py): its breakdown
from a synthetic events log of both launches, its rows on docs/benchmarks.md and in the README's
block, and the bench driver's wiring of the part on both lanes. No timing is asserted."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from bench.summarize.readme import readme_block
from bench.summarize.sections.recovery import recovery_section
from bench.summarize.sections.spares_used_up import spares_used_up_section, with_relaunch_rung
from bench.training_plane.spares_used_up import PARTS, used_up_breakdown

T0 = 1_800_000_000.0


def _used_up_events() -> list[dict]:
    """Launch 1: node 1 lost at T0 + 1, the spare (node 2) promoted; node 2 lost at T0 + 20, node 0
    waits for nothing at T0 + 25 and ends the launch at T0 + 35. Launch 2 (nodes 0 and 1) resumes
    from step 15, the newest checkpoint committed before that, and completes a step at T0 + 41."""
    one, two = {"launch_id": "1"}, {"launch_id": "2"}
    return [
        {"event": "launch_begin", "ts": T0 - 20, "node_rank": 0, **one},
        {"event": "checkpoint_commit", "ts": T0 - 5, "step": 5, "checkpoint_id": "step_00000005", "rank": 0, **one},
        {"event": "fault_injected", "ts": T0 + 1, "kind": "node_loss", "step": 10, "node_rank": 1, "rank": 3, **one},
        {"event": "fault_injected", "ts": T0 + 1.01, "kind": "node_loss", "step": 10, "node_rank": 1, "rank": 2, **one},
        {"event": "spare_promoted", "ts": T0 + 10, "node_rank": 2, "replaced_node_ranks": [1], **one},
        {"event": "checkpoint_commit", "ts": T0 + 18, "step": 15, "checkpoint_id": "step_00000015", "rank": 0, **one},
        {"event": "fault_injected", "ts": T0 + 20, "kind": "node_loss", "step": 20, "node_rank": 2, "rank": 3, **one},
        {
            "event": "waiting_for_nodes",
            "ts": T0 + 25,
            "node_rank": 0,
            "missing_node_ranks": [2],
            "until": None,
            "why": "no spare left and no replacement announced",
            **one,
        },
        {
            "event": "final",
            "ts": T0 + 35,
            "node_rank": 0,
            "failure_class": "restarts_exhausted",
            "message": "node(s) vm (node 2) lost and no spare left to take their place",
            "step": 15,
            "checkpoint_id": "step_00000015",
            **one,
        },
        {"event": "launch_begin", "ts": T0 + 35.5, "node_rank": 0, **two},
        {"event": "launch_begin", "ts": T0 + 35.6, "node_rank": 1, **two},
        {"event": "train_begin", "ts": T0 + 40, "rank": 1, "resumed_from": "step_00000015", **two},
        {"event": "train_begin", "ts": T0 + 40, "rank": 0, "start_step": 15, "resumed_from": "step_00000015", **two},
        {"event": "restart_end", "ts": T0 + 41, "rank": 0, "layer": "relaunch", "latency_s": 21.0, "step": 16, **two},
        # the relaunch's own commits are not what it resumed from
        {"event": "checkpoint_commit", "ts": T0 + 45, "step": 20, "checkpoint_id": "step_00000020", "rank": 0, **two},
    ]


def test_the_breakdown_runs_from_the_second_loss_to_the_launch_end_and_the_relaunchs_first_step():
    trial = used_up_breakdown(_used_up_events(), relaunch_started=T0 + 35.2)
    assert trial["loss_steps"] == [10, 20] and trial["lost_node_ranks"] == [1, 2]
    assert trial["promoted_node_rank"] == 2 and trial["fault_ts"] == T0 + 20
    assert trial["waiting"] == {
        "missing_node_ranks": [2],
        "until": None,
        "why": "no spare left and no replacement announced",
    }
    assert trial["final"]["failure_class"] == "restarts_exhausted" and trial["ended_in_seconds"] is True
    assert trial["loss_to_end_s"] == pytest.approx(15.0)
    assert trial["end_to_first_step_s"] == pytest.approx(6.0)
    assert trial["total_s"] == pytest.approx(21.0)
    assert trial["restart_end"] == {"layer": "relaunch", "latency_s": 21.0}
    assert list(trial["parts"]) == list(PARTS)
    assert trial["parts"] == pytest.approx(
        {"detect": 5.0, "shut_down": 10.0, "exit": 0.2, "launcher_start": 0.3, "start_restore": 4.5, "first_step": 1.0},
        abs=0.002,
    )
    assert sum(trial["parts"].values()) == pytest.approx(trial["total_s"], abs=0.002)
    assert trial["newest_committed"] == trial["resumed_from"] == "step_00000015" and trial["resumed_step"] == 15
    assert trial["resumed_newest"] is True and trial["faults_in_relaunch"] == 0


def test_without_the_relaunch_start_the_exit_is_part_of_the_launchers_start():
    trial = used_up_breakdown(_used_up_events())
    assert "exit" not in trial["parts"] and trial["parts"]["launcher_start"] == pytest.approx(0.5)
    # a start recorded before the launch ended is not believed either
    assert "exit" not in used_up_breakdown(_used_up_events(), relaunch_started=T0 + 30)["parts"]


def test_what_the_breakdown_says_when_a_run_went_otherwise():
    events = _used_up_events()
    # one loss only (the spare covered it): no trial
    assert used_up_breakdown([e for e in events if e.get("step") != 20 or e["event"] != "fault_injected"]) is None
    # the relaunch resumed from an older checkpoint, and a drill fired again in it
    older = [{**e, "resumed_from": "step_00000005"} if e["event"] == "train_begin" else e for e in events] + [
        {"event": "fault_injected", "ts": T0 + 42, "kind": "node_loss", "step": 20, "node_rank": 1, "launch_id": "2"}
    ]
    trial = used_up_breakdown(older)
    assert trial["resumed_newest"] is False and trial["faults_in_relaunch"] == 1
    # the launch never ended (it waited out the join timeout): no end, no relaunch figures
    endless = [e for e in events if e["event"] != "final" and e.get("launch_id") == "1"]
    trial = used_up_breakdown(endless)
    assert trial["ended_in_seconds"] is False and trial["loss_to_end_s"] is None and trial["total_s"] is None
    assert trial["parts"]["detect"] == pytest.approx(5.0) and trial["resumed_newest"] is False


def _stat(values: list[float]) -> dict:
    ordered = sorted(values)
    return {"n": len(values), "min": ordered[0], "median": ordered[len(ordered) // 2], "max": ordered[-1]}


def _lane(version: str, label: str, end: float, relaunch: float) -> dict:
    """A lane's results as bench.training_plane writes them (the spares-used-up part only)."""
    trials = [{"resumed_newest": True}, {"resumed_newest": True}]
    return {
        "versions": {"torch": "2.13.0", "nvidia-resiliency-ext": version},
        "lane": {"name": "x", "label": label},
        "spares_used_up": {
            "nodes": 2,
            "spare_nodes": 1,
            "procs_per_node": 2,
            "fault_steps": [10, 20],
            "trials": trials,
            "loss_to_end_s": _stat([end, end]),
            "end_to_first_step_s": _stat([relaunch, relaunch]),
            "total_s": _stat([end + relaunch, end + relaunch]),
            "parts_median_s": {"detect": 5.0, "shut_down": end - 5.0, "exit": 0.05, "first_step": 0.5},
            "all_ended_in_seconds": True,
        },
    }


RELAUNCH = {
    "poll_interval_s": 5.0,
    "rows": [
        {
            "kind": "sigkill",
            "launch_failed_by": "final event",
            "total_s": _stat([7.3]),
            "parts_median_s": dict.fromkeys(("detect", "diagnose_replace", "capacity_submit", "start_restore"), 1.0)
            | {"first_step": 0.2},
            "data_plane_s": {"n": 0},
            "target_met": True,
        },
        {
            "kind": "node_loss",
            "launch_failed_by": "node lost (no final event)",
            "total_s": _stat([7.5]),
            "parts_median_s": {
                "detect": 0.1,
                "diagnose_replace": 0.05,
                "capacity_submit": 0.25,
                "start_restore": 6.9,
                "first_step": 0.2,
            },
            "data_plane_s": {"n": 0},
            "target_met": True,
        },
    ],
}


def test_the_page_shows_each_lane_and_the_figure_through_the_relaunch_rung():
    label07, label04 = "NVRx 0.7.0 (lane)", "NVRx 0.4.1 (.venv)"
    tp07, tp = _lane("0.7.0", label07, 12.0, 8.0), _lane("0.4.1", label04, 15.0, 7.0)
    # fault -> launch end + the node_loss rung's failed launch -> first step
    assert with_relaunch_rung(tp["spares_used_up"], RELAUNCH) == pytest.approx(22.5)
    assert with_relaunch_rung(tp["spares_used_up"], None) is None
    lines = spares_used_up_section([tp07, tp], RELAUNCH)
    page = "\n".join(lines)
    assert page.index(f"| {label07} |") < page.index(f"| {label04} |")
    assert f"| {label04} | 2 × 2 ranks + 1 | 2 | 15.0 s (15.0 s–15.0 s) | 7.00 s (7.00 s–7.00 s) | 22.0 s" in page
    assert "| 22.5 s | detect (→ `waiting_for_nodes`) 5.00 s · shut down (→ `final`) 10.0 s · exit 50 ms" in page
    assert (
        "| 2 of 2 |" in page
        and "control plane's own part (detect, diagnose + replace, capacity + submit) is 400 ms" in page
    )
    assert spares_used_up_section([{"versions": {}}], RELAUNCH) == []
    # in section 2, after the relaunch rung; and in the spare table, next to the rung
    cp = {"relaunch": RELAUNCH, "spare": {**_cp_spare(), "nvrx": "0.4.1"}}
    section = "\n".join(recovery_section(tp, cp, tp07))
    assert section.index("Relaunch after node replacement") < section.index("Node loss with the spares used up")
    assert (
        "| node_loss, spares used up: the launch ends, then the relaunch rung (both above) | relaunch | 2 | 22.5 s"
        in section
    )
    # the README: on each lane, what the launch end and the relaunch took
    block = readme_block({"training_plane": tp, "training_plane_nvrx07": tp07, "control_plane": cp})
    assert "node loss with the spares used up 20.0 s (launch end 12.0 s + relaunch 8.00 s)" in block
    assert (
        "node loss with the spares used up 22.0 s (launch end 15.0 s + relaunch 7.00 s; through the relaunch " in block
    )
    assert "; through the relaunch rung 22.5 s)" in block


def _cp_spare() -> dict:
    return {
        "nodes": 2,
        "procs_per_node": 2,
        "spare_nodes": 1,
        "trials": [{"recovered_by": "injob"}],
        "recovery_s": _stat([16.9]),
        "promoted_s": _stat([15.0]),
        "refill_s": _stat([15.4]),
        "all_covered_in_job": True,
    }


def test_bench_run_measures_the_part_again_on_both_lanes(monkeypatch, tmp_path):
    import bench.run as run

    (lane,) = [p for p in run.PARTS if p[0] == "training_plane_nvrx07"]
    assert "spares_used_up" in lane[3][lane[3].index("--only") + 1].split(",")  # make bench: on the 0.7 lane too
    assert run._without_only(["--lane", "nvrx07", "--only", "recovery,spare", "--x"]) == ["--lane", "nvrx07", "--x"]
    parts, commands = {}, []

    def part_command(python, module, out, extra, quick):  # records each part's arguments, --out unchecked
        parts[str(python)] = extra
        return ["python", "-W", "ignore", "-m", module, *extra]

    monkeypatch.setattr(run, "part_command", part_command)
    fake = SimpleNamespace(run=lambda cmd, **kw: commands.append(cmd) or SimpleNamespace(returncode=0))
    monkeypatch.setattr(run, "subprocess", fake)  # this module's calls only
    monkeypatch.setattr(run, "seed_from_summary", lambda out: None)
    assert run.main(["--only", "spares_used_up", "--out", str(tmp_path)]) == 0
    assert parts[str(run.TRAINING_PYTHON)] == []  # then --only spares_used_up --merge, as spare_takeover
    assert commands[0][-3:] == ["--only", "spares_used_up", "--merge"]
    assert parts[str(run.NVRX07_LANE)] == ["--lane", "nvrx07", "--name", "training_plane_nvrx07"] + [
        "--only",
        "spares_used_up",
        "--merge",
    ]
    assert len(commands) == 3 and "bench.summarize" in commands[-1]  # the two lanes, then the summary
    record = (tmp_path / "run.json").read_text()
    assert '"training_plane.spares_used_up"' in record and '"training_plane_nvrx07.spares_used_up"' in record
