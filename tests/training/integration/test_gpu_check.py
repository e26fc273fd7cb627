"""`make gpu-check` (bench/gpu_check/), dry: its wiring holds without a GPU. With --dry-run it
runs dry on a GPU machine too, so this test means the same everywhere."""

from __future__ import annotations

import subprocess
import sys

from bench.gpu_check import CHECKS, DOC, JSON_OUT, LAUNCH_SCENARIOS, WORKERS

from training.support import REPO


def _stamp(path):
    return path.stat().st_mtime_ns if path.exists() else None


def test_dry_run_wires_every_scenario_and_writes_nothing_in_the_repo():
    before = (_stamp(DOC), _stamp(JSON_OUT))
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu_check", "--dry-run"], cwd=REPO, capture_output=True, text=True, timeout=180
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("gpu-check dry run:"), output
    assert "found no GPU" in last or "--dry-run given" in last, last
    for check in CHECKS:
        assert check.key in last, f"{check.key} missing from: {last}"
    for scenario in LAUNCH_SCENARIOS:  # fsdp_resilience.training.launch --dry-run printed a launcher command for each
        line = next((x for x in proc.stdout.splitlines() if x.startswith(f"[dry-run] {scenario}:")), "")
        assert "ft_launcher" in line and "fsdp_resilience.training.train" in line, output
    for worker in WORKERS:
        assert any(
            x.startswith(f"[dry-run] {worker}:") and "torch.distributed.run" in x for x in proc.stdout.splitlines()
        ), output
    assert (_stamp(DOC), _stamp(JSON_OUT)) == before, "a dry run must not write docs/gpu.md or bench/results/gpu.json"
