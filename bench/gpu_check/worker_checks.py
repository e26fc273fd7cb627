"""The checks that run a worker on every GPU (workers.py): the async checkpoint's stall and the
``1b`` preset's memory, each judged against a target or an estimate."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from bench.gpu_check.check_types import Check, CheckResult, Context, check_result, finite
from bench.gpu_check.configs import (
    CHECKPOINT_MODEL,
    CHECKPOINT_SAVES,
    MEMORY_TOLERANCE,
    STALL_TARGET,
    worker_command,
)
from bench.gpu_check.processes import run_bounded
from fsdp_resilience.training.contract import RunConfig
from fsdp_resilience.training.contract.model_sizes import (
    CHECKPOINT_BYTES_PER_PARAM,
    PRESETS,
    PresetRun,
    memory_per_gpu,
    param_count,
)


def _run_worker(ctx: Context, check: Check) -> tuple[list[str], int | None, float, dict[str, Any]]:
    """Run worker ``check.key`` on every GPU; rank 0's result (empty if it wrote none)."""
    result_path = ctx.work / "results" / f"{check.key}.json"
    result_path.unlink(missing_ok=True)
    shutil.rmtree(ctx.configs[check.key].run_dir, ignore_errors=True)
    command = worker_command(check.key, ctx.config_paths[check.key], result_path, ctx.gpus)
    rc, wall = run_bounded(command, ctx.logs(check.key), check.timeout_s)
    try:
        return command, rc, wall, json.loads(result_path.read_text())
    except (OSError, ValueError):
        return command, rc, wall, {}


def checkpoint_space(work: Path, gpus: int) -> tuple[int, list[str]]:
    """The bytes a save of CHECKPOINT_MODEL's state takes on this machine (every rank's shard), and
    why /dev/shm or the disk cannot hold it: the snapshot lives in /dev/shm (64 MB by default in a
    container), and the disk holds the committed save and the next one (keep_checkpoints=1)."""
    state = CHECKPOINT_BYTES_PER_PARAM * param_count(PRESETS[CHECKPOINT_MODEL])
    shm_free = shutil.disk_usage("/dev/shm").free
    work.mkdir(parents=True, exist_ok=True)
    disk_free = shutil.disk_usage(work).free
    problems = []
    if shm_free < 1.1 * state:
        problems.append(
            f"/dev/shm has {shm_free / 1e9:.1f} GB free; a save of the {CHECKPOINT_MODEL} preset's state on "
            f"{gpus} GPU(s) snapshots {state / 1e9:.1f} GB there (docker run: --ipc=host or --shm-size)"
        )
    if disk_free < 2.2 * state:
        problems.append(f"{work} has {disk_free / 1e9:.1f} GB free; two saves take {2 * state / 1e9:.1f} GB")
    return state, problems


def stall_problems(result: dict[str, Any]) -> list[str]:
    """The stall ÷ pinned-memcpy target, as a pass condition."""
    ratio = result["stall_over_memcpy"]
    if ratio <= STALL_TARGET:
        return []
    return [
        f"a save stalls training {ratio:.2f}× as long as a pinned memcpy of the same bytes, above the "
        f"{STALL_TARGET:g}× target (breakdown on rank 0: {result.get('stall_breakdown_rank0_s')})"
    ]


def check_checkpoint(ctx: Context, check: Check) -> CheckResult:
    state, space = checkpoint_space(ctx.work, ctx.gpus)
    if space:
        return CheckResult(check.key, check.title, passed=False, summary="not run: no room", problems=space)
    command, rc, wall, result = _run_worker(ctx, check)
    problems = [] if result else ["the worker wrote no result (see the log)"]
    if result:
        if result["committed_step"] != CHECKPOINT_SAVES:
            problems.append(f"newest committed checkpoint is step {result['committed_step']}, not {CHECKPOINT_SAVES}")
        if result["writer_has_cuda_context"]:
            problems.append(
                f"a checkpoint writer process holds a CUDA context ({result['writer_cuda_evidence']}): "
                "every rank's writer costs GPU memory and can block on the device"
            )
        problems += stall_problems(result)
        result["stall_target"] = STALL_TARGET
    shm = result.get("shm", {})
    summary = (
        f"stall {result['stall_s'] * 1e3:.0f} ms = {result['stall_over_memcpy']:.2f}× pinned memcpy "
        f"(target ≤ {STALL_TARGET:g}×; {result['state_mb']:,.0f} MB/rank, {CHECKPOINT_MODEL}); "
        f"/dev/shm +{shm.get('peak_growth_mb', 0):,.0f} MB; "
        f"writer CUDA context: {'yes' if result['writer_has_cuda_context'] else 'none'}"
        if result
        else "no result"
    )
    return check_result(check, ctx, command, rc, wall, problems, result, summary)


def memory_estimate(cfg: RunConfig, gpus: int) -> dict[str, float]:
    """model_sizes.memory_per_gpu for the run the memory check makes: its model, tokens per rank per
    step, and this machine's GPU count (not the preset's default world size)."""
    run = PresetRun(nodes=1, gpus_per_node=gpus, batch_size=cfg.batch_size, seq_len=cfg.seq_len)
    return memory_per_gpu(PRESETS[cfg.model], run)


def memory_problems(peak_allocated_gib: float, estimate: dict[str, float]) -> tuple[float, list[str]]:
    """The measured peak beside the estimate less its overhead allowance (CUDA context, NCCL, slack:
    max_memory_allocated sees none of it); off by more than MEMORY_TOLERANCE either way fails."""
    expected = estimate["total"] - estimate["overhead"]
    ratio = peak_allocated_gib / expected
    if abs(ratio - 1) <= MEMORY_TOLERANCE:
        return ratio, []
    side = "under" if ratio > 1 else "over"
    return ratio, [
        f"peak allocated {peak_allocated_gib:.1f} GiB is {ratio:.2f}× the estimate's {expected:.1f} GiB "
        f"(memory_per_gpu less its {estimate['overhead']} GiB overhead): the estimate {side}states it by more "
        f"than {MEMORY_TOLERANCE:.0%} (src/fsdp_resilience/training/contract/model_sizes.py)"
    ]


def check_memory(ctx: Context, check: Check) -> CheckResult:
    cfg = ctx.configs[check.key]
    command, rc, wall, result = _run_worker(ctx, check)
    problems = [] if result else ["the worker wrote no result (see the log)"]
    if result and not all(finite(x) for x in result["losses"]):
        problems.append(f"losses are not finite: {result['losses']}")
    per_gpu = result.get("max_allocated_gib", [])
    summary = "no result"
    if per_gpu:
        estimate = memory_estimate(cfg, ctx.gpus)
        ratio, off = memory_problems(max(per_gpu), estimate)
        problems += off
        result.update(estimate_gib=estimate, measured_over_estimate=round(ratio, 2))
        summary = (
            f"{max(per_gpu):.1f} GiB peak allocated per GPU (max of {len(per_gpu)}), seq {cfg.seq_len} × batch "
            f"{cfg.batch_size}: {ratio:.2f}× the estimate for {ctx.gpus} GPU(s) "
            f"({estimate['total'] - estimate['overhead']:.1f} GiB + {estimate['overhead']} GiB overhead)"
        )
    return check_result(check, ctx, command, rc, wall, problems, result, summary)
