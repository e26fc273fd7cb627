"""The checks, in the order they run, and how one runs: in its own processes, bounded by its own
timeout and by what is left of the whole command's time limit."""

from __future__ import annotations

import shutil
import time
from dataclasses import replace

from bench.common import log
from bench.gpu_check.check_types import Check, CheckResult, Context, nccl_timeouts
from bench.gpu_check.configs import CHECKPOINT_MODEL, GPU_RUN, LAUNCH_SCENARIOS, STOP_GRACE_S
from bench.gpu_check.launched_checks import (
    check_evaluate,
    check_exception,
    check_hang,
    check_sigkill,
    check_train,
    check_while_saving,
)
from bench.gpu_check.worker_checks import check_checkpoint, check_memory

__all__ = ["CHECKS", "LAUNCHED", "WORKERS", "Check", "CheckResult", "Context", "nccl_timeouts", "run_check"]

CHECKS: tuple[Check, ...] = (
    # In this order: if the time limit runs out, the checks of the restart layers have run.
    Check("train", f"bf16 FSDP2 training (`fsdp_resilience.training.launch`, `{GPU_RUN['model']}`)", 240, check_train),
    Check(
        "evaluate", "evaluation of the trained checkpoint (`fsdp_resilience.training.evaluate`)", 120, check_evaluate
    ),
    Check("exception", "exception → in-process restart (NCCL)", 180, check_exception),
    Check("while_saving", "exception while a save is pending → in-process restart (NCCL)", 180, check_while_saving),
    Check("hang", "hang → in-process restart (NCCL)", 180, check_hang),
    Check("sigkill", "SIGKILL → in-job restart (ft_launcher)", 180, check_sigkill),
    Check(
        "checkpoint", f"async checkpoint on CUDA (AsyncCheckpointer, `{CHECKPOINT_MODEL}` state)", 240, check_checkpoint
    ),
    Check("memory", "memory of the `1b` preset (FSDP2 + AdamW) against its estimate", 180, check_memory),
)

#: The checks that run ``python -m fsdp_resilience.training.launch``; the others run a worker (workers.py).
LAUNCHED = tuple(LAUNCH_SCENARIOS)
WORKERS = ("checkpoint", "memory")
#: A check is not started with less time than this left before the deadline: it could not finish.
MIN_CHECK_S = 30.0


def run_check(ctx: Context, check: Check) -> CheckResult:
    """Run ``check`` within what is left of the time limit (its own timeout at most), then delete its
    checkpoints (GBs; train's once evaluate has read them) unless they are to be kept."""
    timeout = check.timeout_s
    if ctx.deadline is not None:  # room to stop its processes (STOP_GRACE_S) inside the limit
        timeout = min(timeout, ctx.deadline - time.monotonic() - STOP_GRACE_S)
    if timeout < MIN_CHECK_S:
        result = CheckResult(
            check.key,
            check.title,
            passed=False,
            summary="not run",
            problems=["not run: the time limit was spent before it (see --time-limit)"],
        )
    else:
        result = _run_check(ctx, replace(check, timeout_s=timeout))
    if not ctx.keep_checkpoints and check.key != "train":
        for key in (check.key, "train") if check.key == "evaluate" else (check.key,):
            if key in ctx.configs:
                shutil.rmtree(ctx.configs[key].layout.checkpoints, ignore_errors=True)
    return result


def _run_check(ctx: Context, check: Check) -> CheckResult:
    log(f"{check.key}: {check.title} (at most {check.timeout_s:.0f} s)")
    t0 = time.monotonic()
    try:
        result = check.run(ctx, check)
    except Exception as e:  # a bug in this script must not hide the other checks' results
        result = CheckResult(
            check.key,
            check.title,
            passed=False,
            seconds=round(time.monotonic() - t0, 1),
            problems=[f"gpu_check itself failed: {type(e).__name__}: {e}"],
        )
    log(
        f"{check.key}: {'passed' if result.passed else 'FAILED'} in {result.seconds:.0f} s: "
        f"{result.summary}{'; ' + '; '.join(result.problems) if result.problems else ''}"
    )
    return result
