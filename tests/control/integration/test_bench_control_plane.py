"""A quick smoke run of the control-plane benchmark (bench/control_plane/): DAG parse time with
torch blocked, and the deferrable trigger seeing a checkpoint commit; then the summary renders.
The scale part (eks_scale.py) at a tiny size, on the session's control plane."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from control.support import REPO

pytestmark = pytest.mark.slow


def test_quick_control_plane_bench_and_summary(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-W",
            "ignore",
            "-m",
            "bench.control_plane",
            "--quick",
            "--only",
            "parse,watch",
            "--out",
            str(tmp_path),
        ],  # fmt: skip
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    result = json.loads((tmp_path / "control_plane.quick.json").read_text())
    parse = result["parse"]
    assert parse["dags"] == ["fsdp_training", "node_maintenance", "stage_dataset"] and parse["torch_blocked"]
    for mode in ("fresh_imports", "pre_imported"):
        stats = parse[mode]["dagbag_s"]
        assert stats["n"] == 2 and 0 < stats["min"] <= stats["median"] <= stats["max"]
        assert set(parse[mode]["per_file_s"]) == {"fsdp_training.py", "node_maintenance.py", "stage_dataset.py"}
    watch = result["watch"]
    seen = watch["commit_to_trigger_event_s"]
    assert seen["n"] == watch["trials"] == 3
    # the trigger sees a commit at its next poll: never before the commit, at most a poll plus
    # the check later (generous slack for a loaded machine)
    assert 0 <= seen["min"] and seen["max"] < watch["poll_interval_s"] + 5

    summary = subprocess.run(
        [sys.executable, "-m", "bench.summarize", "--quick", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert summary.returncode == 0, summary.stderr[-3000:]
    table = (tmp_path / "quick" / "benchmarks.md").read_text()
    assert "### 4. Control-plane overhead" in table and "DAG parse of dags/" in table
    assert json.loads((tmp_path / "quick" / "latest.json").read_text())["control_plane"]["parse"] == parse


def test_the_scale_part_measures_a_launch_its_watch_and_a_failed_nodes_diagnosis_and_replacement(
    cluster, tmp_path, monkeypatch
):
    from bench.control_plane.eks_scale import scale_row
    from bench.summarize.sections.scale import scale_section, scale_targets

    row = scale_row(cluster, tmp_path, 6, monkeypatch, polls=3, lose_timeout=60, many=0)
    assert (row["nodes"], row["run_nodes"], row["spare_nodes"]) == (6, 3, 2)
    watch = row["watch"]
    assert watch["polls"] == 3 and watch["states"] == {"running": 3}
    assert watch["api_calls_by_kind"] == {"get jobs": 1.0, "list pods": 1.0} and watch["bytes_per_poll"] > 0
    one = row["fail_1"]  # blamed and replaced the node it failed (scale_row checks), through the Stubber
    assert one["diagnose"]["api_calls_by_kind"]["get jobs"] == 1 and one["replace"]["api_calls"] >= 2
    assert one["diagnose_and_replace_s"] > 0
    scale = {"rows": [row], "polls": 3, "node_lease_s": 12, "node_monitor_grace_s": 10}
    page = "\n".join(scale_section({"scale": scale}))
    assert "### 6. The EKS backend at scale" in page and "| 6 | 5 | 2 |" in page
    assert scale_targets(scale)[0][-1] is True
