"""`make gpu-check` (bench/gpu_check/) without a GPU: its wiring holds (the dry run; with --dry-run it
runs dry on a GPU machine too, so this test means the same everywhere), what judges a GPU run's
figures, and the wheels `make gpu-wheels` carries to a GPU machine without a registry."""

from __future__ import annotations

import subprocess
import sys

import pytest

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
        assert "ft_launcher" in line and "worker_client.py --config" in line, output
    for worker in WORKERS:
        assert any(
            x.startswith(f"[dry-run] {worker}:") and "torch.distributed.run" in x for x in proc.stdout.splitlines()
        ), output
    assert (_stamp(DOC), _stamp(JSON_OUT)) == before, "a dry run must not write docs/gpu.md or bench/results/gpu.json"


# The judging, without a GPU: what turns a GPU run's figures into pass or fail.


def test_the_stall_target_is_a_pass_condition():
    from bench.gpu_check.configs import STALL_TARGET
    from bench.gpu_check.worker_checks import stall_problems

    assert stall_problems({"stall_over_memcpy": STALL_TARGET}) == []
    [problem] = stall_problems({"stall_over_memcpy": STALL_TARGET + 0.5})
    assert f"{STALL_TARGET:g}× target" in problem


def test_memory_is_compared_with_the_estimate_for_the_same_gpu_count(tmp_path):
    from bench.gpu_check.worker_checks import memory_estimate, memory_problems
    from fsdp_resilience.training.contract import RunConfig

    where = {"run_id": "memory", "run_dir": str(tmp_path), "dataset_dir": str(tmp_path)}
    cfg = RunConfig(**where, model="1b", device="cuda", batch_size=4, seq_len=4096)
    one, eight = memory_estimate(cfg, 1), memory_estimate(cfg, 8)
    assert one["sharded_state"] == pytest.approx(8 * eight["sharded_state"], rel=0.01)
    expected = one["total"] - one["overhead"]  # max_memory_allocated sees no CUDA context or NCCL buffers
    assert memory_problems(expected, one) == (pytest.approx(1.0), [])
    ratio, [problem] = memory_problems(1.5 * expected, one)
    assert ratio == pytest.approx(1.5) and "understates" in problem
    assert "overstates" in memory_problems(0.5 * expected, one)[1][0]


def test_the_while_saving_drill_fires_the_step_after_a_checkpoint_and_is_judged_by_the_pending_save():
    from bench.gpu_check.launched_checks import pending_save_at_fault
    from fsdp_resilience.training.contract import FaultDrill

    scenario = LAUNCH_SCENARIOS["while_saving"]
    [fault] = scenario["faults"]
    assert fault["while_saving"] and fault["step"] % scenario["checkpoint_interval"] == 1
    drill = FaultDrill(**fault)
    begun = {"event": "checkpoint_begin", "step": 5, "ts": 1.0}
    fired = {"event": "fault_injected", "kind": "exception", "step": 6, "ts": 2.0}
    later = {"event": "checkpoint_commit", "step": 5, "ts": 3.0}
    pending = {"pending_save_step": 5, "pending_at_fault": True}
    assert pending_save_at_fault([begun, fired, later], drill) == ([], pending)
    problems, figures = pending_save_at_fault([begun, {**later, "ts": 1.5}, fired], drill)
    assert figures["pending_at_fault"] is False and "committed before the drill" in problems[0]
    assert "nothing was pending" in pending_save_at_fault([fired], drill)[0][0]


def test_a_check_left_without_time_fails_without_running(tmp_path):
    import time

    from bench.gpu_check.checks import Check, Context, run_check

    ran = []
    check = Check("train", "a check", 600, lambda ctx, chk: ran.append(chk))
    result = run_check(Context(tmp_path, 1, {}, {}, deadline=time.monotonic() + 5), check)
    assert result.passed is False and "time limit" in result.problems[0] and not ran


# The wheels `make gpu-wheels` carries to a GPU machine without a registry (bench/gpu_check/wheels.py).


def test_the_carried_wheels_are_the_image_s_versions_and_never_torch_or_cuda(tmp_path):
    import re

    from bench.gpu_check import wheels

    pins = wheels.read_list()
    dockerfile = (REPO / "images" / "training" / "Dockerfile").read_text()
    image = dict(re.findall(r"^ARG (NVRX_VERSION|CRC32C_VERSION)=(\S+)$", dockerfile, re.M))
    assert pins["nvidia-resiliency-ext"] == image["NVRX_VERSION"] and pins["crc32c"] == image["CRC32C_VERSION"]
    assert {"numpy", "pyyaml", "grpcio", "psutil", "pip"} <= set(pins)
    for name in ("torch", "triton", "nvidia-cuda-runtime-cu13", "nvidia-nccl-cu13"):
        bad = tmp_path / f"{name}.txt"
        bad.write_text(f"{name}==1.0\n")
        with pytest.raises(SystemExit, match="never carried"):
            wheels.read_list(bad)


def test_only_what_the_machine_lacks_is_installed_but_nvrx_is_the_version_under_test():
    from bench.gpu_check import wheels

    pins = {"nvidia-resiliency-ext": "0.7.0", "numpy": "2.5.5", "grpcio": "1.85.3", "pip": "26.3"}
    machine = {"nvidia-resiliency-ext": "0.4.1", "numpy": "1.26.4", "grpcio": None, "pip": "24.0"}
    assert wheels.to_install(pins, machine) == ["nvidia-resiliency-ext==0.7.0", "grpcio==1.85.3"]
    assert wheels.to_install(pins, {**machine, "nvidia-resiliency-ext": "0.7.0", "grpcio": "1.70.0"}) == []


def test_the_platforms_asked_for_cover_every_older_manylinux():
    from bench.gpu_check import wheels

    tags = wheels.platforms("2.39", "x86_64")
    assert tags[0] == "manylinux_2_39_x86_64" and "manylinux_2_28_x86_64" in tags  # numpy's
    assert "manylinux2014_x86_64" in tags and tags[-1] == "manylinux1_x86_64"


def test_a_gpu_run_prints_a_line_per_check_and_writes_only_the_block_of_the_page(tmp_path, monkeypatch, capsys):
    """run_on_gpus end to end with stand-in checks: what a GPU machine would print and write."""
    from bench.gpu_check import cli
    from bench.gpu_check.arguments import parse_args
    from bench.gpu_check.checks import Check, CheckResult
    from bench.gpu_check.report import BEGIN, END

    monkeypatch.setattr(cli, "ensure_dataset", lambda dst, python: dst)
    monkeypatch.setattr(cli, "probe_versions", lambda work, timeout_s: {"torch": "2.11.0+cu130", "gpu": "H200"})
    passing = Check("train", "training", 60, lambda ctx, c: CheckResult(c.key, c.title, True, summary="1 s/step"))
    failing = Check("memory", "memory", 60, lambda ctx, c: CheckResult(c.key, c.title, False, problems=["too big"]))
    page = tmp_path / "gpu.md"
    page.write_text(f"# GPU check\n\nby hand\n\n{BEGIN}\nold run\n{END}\n\nafter\n")
    args = parse_args(["--work", str(tmp_path / "work"), "--doc", str(page), "--json", str(tmp_path / "gpu.json")])
    assert cli.run_on_gpus(args, 1, (passing, failing)) == 1
    lines = capsys.readouterr().out.splitlines()
    assert "PASS train: 1 s/step" in lines and "FAIL memory: too big" in lines
    text = page.read_text()
    assert text.startswith("# GPU check\n\nby hand\n\n") and text.endswith(f"{END}\n\nafter\n")
    assert "old run" not in text and "**1 of 2 checks passed**" in text and "2.11.0+cu130" in text
