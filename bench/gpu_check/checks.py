"""The checks: each runs in its own processes, bounded by its own timeout, and yields a CheckResult."""

from __future__ import annotations

import collections
import json
import math
import shlex
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from bench.common import log
from bench.gpu_check.configs import (
    CHECKPOINT_SAVES,
    GPU_RUN,
    LAUNCH_SCENARIOS,
    STALL_TARGET,
    WARMUP_STEPS,
    launch_command,
    worker_command,
)
from bench.gpu_check.processes import log_tail, run_bounded
from fsdp_resilience.training.contract import CheckpointCatalog, Event, RunConfig, final_status, read_events


@dataclass
class CheckResult:
    key: str
    title: str
    passed: bool | None  # None: not run (dry run, or skipped)
    seconds: float = 0.0
    summary: str = ""  # the main figures in one line: the report's table
    figures: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)  # why it failed
    command: str = ""
    log: str = ""
    log_tail: str = ""


@dataclass
class Context:
    work: Path
    gpus: int
    configs: dict[str, RunConfig]
    config_paths: dict[str, Path]

    def logs(self, key: str) -> Path:
        return self.work / "logs" / f"{key}.log"


@dataclass(frozen=True)
class Check:
    key: str
    title: str
    timeout_s: float
    run: Callable[[Context, "Check"], CheckResult]


def _result(
    check: Check,
    ctx: Context,
    command: list[str],
    rc: int | None,
    wall: float,
    problems: list[str],
    figures: dict[str, Any],
    summary: str,
) -> CheckResult:
    """The row of a check that ran one command; a timeout or a non-zero exit is always a problem."""
    if rc is None:
        problems.insert(0, f"timed out after {check.timeout_s:.0f} s and was stopped")
    elif rc != 0:
        problems.insert(0, f"exited {rc}")
    figures = {"exit_code": rc, "wall_s": round(wall, 1), **figures}
    log_path = ctx.logs(check.key)
    return CheckResult(
        check.key,
        check.title,
        passed=not problems,
        seconds=round(wall, 1),
        summary=summary,
        figures=figures,
        problems=problems,
        command=shlex.join(command),
        log=str(log_path),
        log_tail=log_tail(log_path) if problems else "",
    )


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def nccl_timeouts(cfg: RunConfig) -> dict[str, float]:
    """The restart-layer timeouts a run gets on NCCL (the contract derives the collective one)."""
    t = cfg.timeouts("nccl")
    return {
        "hang_timeout_s": t.soft_s,
        "hard_timeout_s": t.hard_s,
        "collective_timeout_s": t.collective_s,
        "heartbeat_timeout_s": t.heartbeat_s,
    }


def launch_run(ctx: Context, check: Check, name: str) -> tuple[list[str], int | None, float, list[dict]]:
    """``python -m fsdp_resilience.training.launch`` for scenario ``name`` in a fresh run dir; its events."""
    cfg = ctx.configs[name]
    shutil.rmtree(cfg.run_dir, ignore_errors=True)
    command = launch_command(ctx.config_paths[name])
    rc, wall = run_bounded(command, ctx.logs(check.key), check.timeout_s)
    return command, rc, wall, read_events(cfg.layout.events)


def check_train(ctx: Context, check: Check) -> CheckResult:
    cfg = ctx.configs["train"]
    command, rc, wall, events = launch_run(ctx, check, "train")
    steps = [r for r in events if r.get("event") == Event.STEP.value]
    timed = [r for r in steps if r["step"] > WARMUP_STEPS] or steps
    step_s = _median([r["step_s"] for r in timed])
    tokens_s = _median([r["tokens_per_s"] for r in timed])
    final_loss = steps[-1]["loss"] if steps else None
    stalls = [r["blocking_s"] for r in events if r.get("event") == Event.CHECKPOINT_BEGIN.value]
    begin = next((r for r in events if r.get("event") == Event.TRAIN_BEGIN.value), {})
    problems = []
    if not steps or steps[-1]["step"] != cfg.steps:
        problems.append(f"logged steps up to {steps[-1]['step'] if steps else 0} of {cfg.steps}")
    if not _finite(final_loss):
        problems.append(f"final loss is {final_loss!r}, not a finite number")
    if begin and "cuda" not in str(begin.get("device")):
        problems.append(f"trained on {begin.get('device')}, not CUDA")
    figures = {
        "model": cfg.model,
        "world_size": cfg.world_size,
        "seq_len": cfg.seq_len,
        "batch_size": cfg.batch_size,
        "steps": cfg.steps,
        "device": begin.get("device"),
        "precision": "bf16 compute, fp32 master weights and reduction (Precision.for_device)",
        "step_s_median": step_s,
        "tokens_per_s_median": tokens_s,
        "tokens_per_s_per_gpu": round(tokens_s / cfg.world_size, 1) if tokens_s else None,
        "first_loss": round(steps[0]["loss"], 4) if steps else None,
        "final_loss": round(final_loss, 4) if _finite(final_loss) else final_loss,
        "checkpoint_blocking_s": stalls,
        "final": (final_status(cfg.run_dir) or {}).get("failure_class"),
    }
    summary = (
        f"{step_s:.3f} s/step, {tokens_s / 1e3:,.1f} k tokens/s, loss {figures['first_loss']:.2f} → {final_loss:.2f}"
        if step_s and tokens_s
        else "no step figures"
    )  # a NaN loss shows as nan
    return _result(check, ctx, command, rc, wall, problems, figures, summary)


def _check_recovery(ctx: Context, check: Check, layer: str, forbidden: tuple[str, ...]) -> CheckResult:
    """A run with one drill: it must log restart_begin and restart_end at ``layer``, never
    escalate to a ``forbidden`` layer, and finish with exit 0."""
    cfg = ctx.configs[check.key]
    drill = cfg.faults[0]
    command, rc, wall, events = launch_run(ctx, check, check.key)
    begins = [r for r in events if r.get("event") == Event.RESTART_BEGIN.value]
    layers_seen = collections.Counter(r.get("layer") for r in begins)
    ends = [r for r in events if r.get("event") == Event.RESTART_END.value]
    injected = [r for r in events if r.get("event") == Event.FAULT_INJECTED.value and r.get("kind") == drill.kind]
    end = next((r for r in ends if r.get("layer") == layer), None)
    problems = []
    if not injected:
        problems.append(f"the {drill.kind} drill never fired (no fault_injected event)")
    if not any(r.get("layer") == layer for r in begins):
        problems.append(f"no restart_begin with layer {layer!r} (layers seen: {sorted(layers_seen)})")
    if end is None:
        problems.append(f"no restart_end with layer {layer!r}: training did not resume after the {drill.kind}")
    escalated = sorted(lay for lay in layers_seen if lay in forbidden)
    if escalated:
        problems.append(f"escalated to {escalated}: the {drill.kind} was not recovered {layer} alone")
    latency = end.get("latency_s") if end else None
    figures = {
        "drill": asdict(drill),
        "world_size": cfg.world_size,
        "restart_layer": layer,
        **nccl_timeouts(cfg),
        "latency_s": latency,
        "resumed_at_step": end.get("step") if end else None,
        "restart_reasons": [r.get("reason") for r in begins],
        "restarts_by_layer": dict(layers_seen),
        "final": (final_status(cfg.run_dir) or {}).get("failure_class"),
    }
    summary = (
        f"{drill.kind} at step {drill.step} → {layer} restart, next step after {latency:.1f} s"
        if latency is not None
        else f"{drill.kind} at step {drill.step}: not recovered {layer}"
    )
    return _result(check, ctx, command, rc, wall, problems, figures, summary)


def check_exception(ctx: Context, check: Check) -> CheckResult:
    return _check_recovery(ctx, check, "inprocess", forbidden=("injob", "relaunch"))


def check_hang(ctx: Context, check: Check) -> CheckResult:
    return _check_recovery(ctx, check, "inprocess", forbidden=("injob", "relaunch"))


def check_sigkill(ctx: Context, check: Check) -> CheckResult:
    # A dead rank may first trip the Wrapper in the others (in-process); ft_launcher must finish it.
    return _check_recovery(ctx, check, "injob", forbidden=("relaunch",))


def check_evaluate(ctx: Context, check: Check) -> CheckResult:
    cfg = ctx.configs["train"]
    command = [sys.executable, "-m", "fsdp_resilience.training.evaluate", "--config", str(cfg.layout.config)]
    latest = CheckpointCatalog(cfg.run_dir).latest()
    if latest is None:
        return CheckResult(
            check.key,
            check.title,
            passed=False,
            command=shlex.join(command),
            summary="no checkpoint to evaluate",
            problems=[
                f"no committed checkpoint in {cfg.layout.checkpoints}: the train check "
                "makes it; fix that check first (rerun with --only train,evaluate)"
            ],
        )
    cfg.layout.eval_result.unlink(missing_ok=True)
    rc, wall = run_bounded(command, ctx.logs(check.key), check.timeout_s)
    try:
        result = json.loads(cfg.layout.eval_result.read_text())
    except (OSError, ValueError):
        result = {}
    problems = [] if _finite(result.get("val_loss")) else [f"no finite val_loss in {cfg.layout.eval_result}"]
    figures = {
        k: result.get(k)
        for k in ("checkpoint_id", "step", "val_loss", "perplexity", "batches", "tokens", "saved_world_size")
    }
    summary = (
        f"{result['checkpoint_id']}: val loss {result['val_loss']:.3f}, perplexity {result['perplexity']:.2f}"
        if not problems
        else "no evaluation result"
    )
    return _result(check, ctx, command, rc, wall, problems, figures, summary)


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


def check_checkpoint(ctx: Context, check: Check) -> CheckResult:
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
    ratio = result.get("stall_over_memcpy")
    shm = result.get("shm", {})
    if result:  # a figure, not a pass condition: docs/benchmarks.md tracks the same target on CPU
        result["stall_target"] = f"≤ {STALL_TARGET:g}× memcpy: {'met' if ratio <= STALL_TARGET else 'missed'}"
    summary = (
        f"stall {result['stall_s'] * 1e3:.0f} ms = {ratio:.2f}× pinned memcpy ({result['state_mb']:.0f} MB/rank; "
        f"target {result['stall_target']}); /dev/shm +{shm.get('peak_growth_mb', 0):.0f} MB; "
        f"writer CUDA context: {'yes' if result['writer_has_cuda_context'] else 'none'}"
        if result
        else "no result"
    )
    return _result(check, ctx, command, rc, wall, problems, result, summary)


def check_memory(ctx: Context, check: Check) -> CheckResult:
    command, rc, wall, result = _run_worker(ctx, check)
    problems = [] if result else ["the worker wrote no result (see the log)"]
    if result and not all(_finite(x) for x in result["losses"]):
        problems.append(f"losses are not finite: {result['losses']}")
    per_gpu = result.get("max_allocated_gib", [])
    summary = (
        f"{max(per_gpu):.1f} GiB peak allocated per GPU (max of {len(per_gpu)}), "
        f"seq {result['seq_len']} × batch {result['batch_size']}; estimated "
        f"{result['estimate_gib']['total']} GiB at the preset's default world size"
        if per_gpu
        else "no result"
    )
    return _result(check, ctx, command, rc, wall, problems, result, summary)


CHECKS: tuple[Check, ...] = (
    Check("train", f"bf16 FSDP2 training (`fsdp_resilience.training.launch`, `{GPU_RUN['model']}`)", 600, check_train),
    Check("checkpoint", "async checkpoint on CUDA (AsyncCheckpointer)", 420, check_checkpoint),
    Check("exception", "exception → in-process restart (NCCL)", 600, check_exception),
    Check("hang", "hang → in-process restart (NCCL)", 600, check_hang),
    Check("sigkill", "SIGKILL → in-job restart (ft_launcher)", 600, check_sigkill),
    Check(
        "evaluate", "evaluation of the trained checkpoint (`fsdp_resilience.training.evaluate`)", 300, check_evaluate
    ),
    Check("memory", "memory of the `1b` preset (FSDP2 + AdamW)", 420, check_memory),
)

#: The checks that run ``python -m fsdp_resilience.training.launch``; the others run a worker (workers.py).
LAUNCHED = tuple(LAUNCH_SCENARIOS)
WORKERS = ("checkpoint", "memory")


def run_check(ctx: Context, check: Check) -> CheckResult:
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
