"""The checks that run the product command, ``python -m fsdp_resilience.training.launch`` (training, and
one drill per run recovered by a restart layer), and evaluation of the trained checkpoint."""

from __future__ import annotations

import collections
import json
import shlex
import shutil
import sys
from dataclasses import asdict
from typing import Any, Callable

from bench.gpu_check.check_types import Check, CheckResult, Context, check_result, finite, median, nccl_timeouts
from bench.gpu_check.configs import WARMUP_STEPS, launch_command
from bench.gpu_check.processes import run_bounded
from fsdp_resilience.training.contract import CheckpointCatalog, Event, FaultDrill, final_status, read_events


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
    step_s = median([r["step_s"] for r in timed])
    tokens_s = median([r["tokens_per_s"] for r in timed])
    final_loss = steps[-1]["loss"] if steps else None
    stalls = [r["blocking_s"] for r in events if r.get("event") == Event.CHECKPOINT_BEGIN.value]
    begin = next((r for r in events if r.get("event") == Event.TRAIN_BEGIN.value), {})
    problems = []
    if not steps or steps[-1]["step"] != cfg.steps:
        problems.append(f"logged steps up to {steps[-1]['step'] if steps else 0} of {cfg.steps}")
    if not finite(final_loss):
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
        "final_loss": round(final_loss, 4) if finite(final_loss) else final_loss,
        "checkpoint_blocking_s": stalls,
        "final": (final_status(cfg.run_dir) or {}).get("failure_class"),
    }
    summary = (
        f"{step_s:.3f} s/step, {tokens_s / 1e3:,.1f} k tokens/s, loss {figures['first_loss']:.2f} → {final_loss:.2f}"
        if step_s and tokens_s
        else "no step figures"
    )  # a NaN loss shows as nan
    return check_result(check, ctx, command, rc, wall, problems, figures, summary)


Evidence = Callable[[list[dict], FaultDrill], tuple[list[str], dict[str, Any]]]


def _check_recovery(
    ctx: Context, check: Check, layer: str, forbidden: tuple[str, ...], evidence: Evidence | None = None
) -> CheckResult:
    """A run with one drill: it must log restart_begin and restart_end at ``layer``, never
    escalate to a ``forbidden`` layer, and finish with exit 0; ``evidence`` adds what else the
    events must show (its problems and figures)."""
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
    extra_problems, extra_figures = evidence(events, drill) if evidence else ([], {})
    problems += extra_problems
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
        **extra_figures,
    }
    summary = (
        f"{drill.kind} at step {drill.step} → {layer} restart, next step after {latency:.1f} s"
        if latency is not None
        else f"{drill.kind} at step {drill.step}: not recovered {layer}"
    )
    return check_result(check, ctx, command, rc, wall, problems, figures, summary)


def check_exception(ctx: Context, check: Check) -> CheckResult:
    return _check_recovery(ctx, check, "inprocess", forbidden=("injob", "relaunch"))


def pending_save_at_fault(events: list[dict], drill: FaultDrill) -> tuple[list[str], dict[str, Any]]:
    """That the drill fired while a save was pending: the newest save begun before it had not been
    committed yet (events of one machine: the writers' clocks are the same clock)."""
    fired = next(  # at the first save-protocol round at or after its step
        (
            r
            for r in events
            if r.get("event") == Event.FAULT_INJECTED.value and r.get("kind") == drill.kind and r["step"] >= drill.step
        ),
        None,
    )
    begun = [r for r in events if r.get("event") == Event.CHECKPOINT_BEGIN.value and fired and r["ts"] <= fired["ts"]]
    if fired is None or not begun:
        return [f"no save had begun before the drill at step {drill.step}: nothing was pending"], {}
    saving = max(r["step"] for r in begun)
    committed = [
        r
        for r in events
        if r.get("event") == Event.CHECKPOINT_COMMIT.value and r.get("step") == saving and r["ts"] <= fired["ts"]
    ]
    figures = {"pending_save_step": saving, "pending_at_fault": not committed}
    if committed:
        return [f"the step-{saving} save was committed before the drill fired: it did not fire while saving"], figures
    return [], figures


def check_while_saving(ctx: Context, check: Check) -> CheckResult:
    # The layer issue 28's defect 2 escalated: a healthy peer blocked in the save protocol's gloo
    # collective was interrupted only by the Wrapper's hard timeout, as an in-job restart.
    return _check_recovery(ctx, check, "inprocess", ("injob", "relaunch"), evidence=pending_save_at_fault)


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
    problems = [] if finite(result.get("val_loss")) else [f"no finite val_loss in {cfg.layout.eval_result}"]
    figures = {
        k: result.get(k)
        for k in ("checkpoint_id", "step", "val_loss", "perplexity", "batches", "tokens", "saved_world_size")
    }
    summary = (
        f"{result['checkpoint_id']}: val loss {result['val_loss']:.3f}, perplexity {result['perplexity']:.2f}"
        if not problems
        else "no evaluation result"
    )
    return check_result(check, ctx, command, rc, wall, problems, figures, summary)
