"""`make gpu-check`: the training plane on the GPUs of one CUDA machine, checked and measured.

    python -m bench.gpu_check [--only train,checkpoint,...] [--gpus N] [--work DIR] [--dry-run]

World size = the number of GPUs (NCCL needs one rank per GPU; one GPU is enough). Checks, each
in its own processes and bounded by its own timeout, so one that hangs cannot block the rest:

  train       bf16 FSDP2 training with the product command, ``python -m fsdp_resilience.training.launch``
              (``small`` preset, NCCL, layered restarts): step time, tokens/s, final loss, exit 0
  checkpoint  fsdp_resilience.training.checkpointing.AsyncCheckpointer on CUDA with a few hundred MB of state: its
              stall against a pinned-memory memcpy of the same bytes, peak /dev/shm use during
              saves, and that the writer process holds no CUDA context
  exception   an exception in rank 0, recovered in-process on NCCL (restart latency)
  hang        a hang in rank 0, recovered in-process on NCCL (restart latency)
  sigkill     rank 0 SIGKILLed, recovered in-job by ft_launcher (restart latency)
  evaluate    ``python -m fsdp_resilience.training.evaluate`` on the ``train`` run's checkpoint: exit 0, finite loss
  memory      the ``1b`` preset sharded over the GPUs, AdamW as training builds it, a few steps at
              RunConfig's default seq_len and batch size: peak memory allocated per GPU

Writes docs/gpu.md (figures and versions: torch, CUDA, NCCL, NVRx, GPUs, driver) and
bench/results/gpu.json; run dirs and logs stay in runs/gpu-check/. Exit 0 when every check passed.

Without a GPU, or with --dry-run, it checks its own wiring instead, in seconds: every run config
validates, ``fsdp_resilience.training.launch --dry-run`` prints a launcher command for each scenario, the modules
and command lines it uses resolve, and the report writer works (on a temp path: docs/gpu.md is
never touched by a dry run). Then it exits 0.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import json
import math
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

from bench.common import REPO, RESULTS, ensure_dataset, free_port, log, machine, write_json
from fsdp_resilience.training.contract import CheckpointCatalog, ConfigError, Event, RunConfig, final_status, read_events

DOC = REPO / "docs" / "gpu.md"
JSON_OUT = RESULTS / "gpu.json"
WORK = REPO / "runs" / "gpu-check"  # /runs/ is git-ignored; `make clean` removes it

#: Every launched run: the product path on CUDA (NCCL, bf16, layered restarts) with timeouts short
#: enough to resolve the drills in seconds yet valid on NCCL (RunConfig.validate orders them).
#: collective_timeout_s is left unset: the contract derives it for the backend (on NCCL, above
#: the in-process hard timeout, so the watchdog never kills ranks a hang recovery would save).
GPU_RUN: dict[str, Any] = {
    "model": "small", "seq_len": 1024, "batch_size": 8, "device": "cuda", "nodes": 1,
    "restart_mode": "layered", "hang_timeout_s": 15.0, "heartbeat_timeout_s": 60.0,
    "initial_heartbeat_timeout_s": 300.0, "keep_checkpoints": 2, "eval_batches": 8,
}
#: The ``python -m fsdp_resilience.training.launch`` runs. Drills fire at step 12, after the step-10 checkpoint,
#: so each recovery also restores a committed checkpoint.
LAUNCH_SCENARIOS: dict[str, dict[str, Any]] = {
    "train": {"steps": 40, "checkpoint_interval": 10},
    "exception": {"steps": 20, "checkpoint_interval": 5, "faults": [{"kind": "exception", "step": 12, "rank": 0}]},
    "hang": {"steps": 20, "checkpoint_interval": 5, "faults": [{"kind": "hang", "step": 12, "rank": 0}]},
    "sigkill": {"steps": 20, "checkpoint_interval": 5, "faults": [{"kind": "sigkill", "step": 12, "rank": 0}]},
}
CHECKPOINT_SAVES = 5  # the first one pins its buffers and waits for the writer's boot: not timed
MEMORY_STEPS = 3
WARMUP_STEPS = 5  # steps left out of step-time medians (allocator, cuBLAS and NCCL warm-up)
STALL_TARGET = 2.0  # stall <= 2x the memcpy floor: the target docs/benchmarks.md measures on CPU
STOP_GRACE_S = 30.0  # SIGTERM -> SIGKILL: fsdp_resilience.training.launch and torchrun stop their workers first


# --------------------------------------------------------------------------------------------
# Run configs: one per scenario, built (and so validated) by RunConfig
# --------------------------------------------------------------------------------------------


def build_configs(work: Path, dataset: Path, gpus: int) -> dict[str, RunConfig]:
    """Every run config the checks use. Raises ConfigError (naming the field) if one is invalid."""
    configs = {}
    for name, scenario in LAUNCH_SCENARIOS.items():
        configs[name] = RunConfig(**{**GPU_RUN, **scenario}, run_id=f"gpu-check-{name}",
                                  run_dir=str(work / "runs" / name), dataset_dir=str(dataset),
                                  procs_per_node=gpus, rdzv_port=free_port())
    # The workers below take their settings from a RunConfig too, so the dry run validates them.
    configs["checkpoint"] = RunConfig(**GPU_RUN, run_id="gpu-check-checkpoint",
                                      run_dir=str(work / "runs" / "checkpoint"), dataset_dir=str(dataset),
                                      procs_per_node=gpus, steps=CHECKPOINT_SAVES, checkpoint_interval=1)
    # The 1b preset's default run (fsdp_resilience.training.model.PRESET_RUNS): its tokens per rank per step, so
    # the figure can be set beside the README's estimate (memory_per_gpu).
    from fsdp_resilience.training.model import PRESET_RUNS  # torch: imported only where a config needs it

    preset = PRESET_RUNS["1b"]
    configs["memory"] = RunConfig(run_id="gpu-check-memory", run_dir=str(work / "runs" / "memory"),
                                  dataset_dir=str(dataset), model="1b", device="cuda", procs_per_node=gpus,
                                  steps=MEMORY_STEPS, batch_size=preset.batch_size, seq_len=preset.seq_len)
    return configs


def write_configs(configs: dict[str, RunConfig], folder: Path) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, cfg in configs.items():
        paths[name] = folder / f"{name}.json"
        paths[name].write_text(cfg.to_json() + "\n")
    return paths


def launch_command(cfg_path: Path, dry_run: bool = False) -> list[str]:
    return [sys.executable, "-m", "fsdp_resilience.training.launch", "--config", str(cfg_path)] + (["--dry-run"] if dry_run else [])


def worker_command(worker: str, cfg_path: Path, result: Path, gpus: int) -> list[str]:
    """One process per GPU under torchrun, each running ``worker`` of this module."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}",
            "-m", "bench.gpu_check", "--worker", worker, "--config", str(cfg_path), "--result", str(result)]


# --------------------------------------------------------------------------------------------
# Processes: bounded, and nothing left behind
# --------------------------------------------------------------------------------------------


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, from /proc. Needed because torchrun and fsdp_resilience.training.launch put
    their workers in sessions of their own: killing one process group would orphan them."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def stop_tree(proc: subprocess.Popen) -> None:
    """SIGTERM (the launchers pass it on to their workers), then SIGKILL whatever is left."""
    family = descendants(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(STOP_GRACE_S)
    for pid in family + descendants(proc.pid) + [proc.pid]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def run_bounded(command: list[str], log_path: Path, timeout_s: float) -> tuple[int | None, float]:
    """Run ``command`` from the repo root, output to ``log_path``; (exit code or None if it ran
    past ``timeout_s`` and was stopped, wall seconds)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO / "src"), os.environ.get("PYTHONPATH", "")) if p)}
    t0 = time.monotonic()
    with open(log_path, "w") as out:
        out.write(f"$ {shlex.join(command)}\n")
        out.flush()
        proc = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stop_tree(proc)
            rc = None
    return rc, time.monotonic() - t0


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


# --------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------


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


def _result(check: Check, ctx: Context, command: list[str], rc: int | None, wall: float,
            problems: list[str], figures: dict[str, Any], summary: str) -> CheckResult:
    """The row of a check that ran one command; a timeout or a non-zero exit is always a problem."""
    if rc is None:
        problems.insert(0, f"timed out after {check.timeout_s:.0f} s and was stopped")
    elif rc != 0:
        problems.insert(0, f"exited {rc}")
    figures = {"exit_code": rc, "wall_s": round(wall, 1), **figures}
    log_path = ctx.logs(check.key)
    return CheckResult(check.key, check.title, passed=not problems, seconds=round(wall, 1), summary=summary,
                       figures=figures, problems=problems, command=shlex.join(command), log=str(log_path),
                       log_tail=log_tail(log_path) if problems else "")


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def nccl_timeouts(cfg: RunConfig) -> dict[str, float]:
    """The restart-layer timeouts a run gets on NCCL (the contract derives the collective one)."""
    t = cfg.timeouts("nccl")
    return {"hang_timeout_s": t.soft_s, "hard_timeout_s": t.hard_s, "collective_timeout_s": t.collective_s,
            "heartbeat_timeout_s": t.heartbeat_s}


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
    figures = {"model": cfg.model, "world_size": cfg.world_size, "seq_len": cfg.seq_len, "batch_size": cfg.batch_size,
               "steps": cfg.steps, "device": begin.get("device"),
               "precision": "bf16 compute, fp32 master weights and reduction (Precision.for_device)",
               "step_s_median": step_s, "tokens_per_s_median": tokens_s,
               "tokens_per_s_per_gpu": round(tokens_s / cfg.world_size, 1) if tokens_s else None,
               "first_loss": round(steps[0]["loss"], 4) if steps else None,
               "final_loss": round(final_loss, 4) if _finite(final_loss) else final_loss,
               "checkpoint_blocking_s": stalls, "final": (final_status(cfg.run_dir) or {}).get("failure_class")}
    summary = (f"{step_s:.3f} s/step, {tokens_s / 1e3:,.1f} k tokens/s, loss {figures['first_loss']:.2f} → "
               f"{final_loss:.2f}" if step_s and tokens_s else "no step figures")  # a NaN loss shows as nan
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
    figures = {"drill": asdict(drill), "world_size": cfg.world_size, "restart_layer": layer, **nccl_timeouts(cfg),
               "latency_s": latency, "resumed_at_step": end.get("step") if end else None,
               "restart_reasons": [r.get("reason") for r in begins],
               "restarts_by_layer": dict(layers_seen),
               "final": (final_status(cfg.run_dir) or {}).get("failure_class")}
    summary = (f"{drill.kind} at step {drill.step} → {layer} restart, next step after {latency:.1f} s"
               if latency is not None else f"{drill.kind} at step {drill.step}: not recovered {layer}")
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
        return CheckResult(check.key, check.title, passed=False, command=shlex.join(command),
                           summary="no checkpoint to evaluate",
                           problems=[f"no committed checkpoint in {cfg.layout.checkpoints}: the train check "
                                     "makes it; fix that check first (rerun with --only train,evaluate)"])
    cfg.layout.eval_result.unlink(missing_ok=True)
    rc, wall = run_bounded(command, ctx.logs(check.key), check.timeout_s)
    try:
        result = json.loads(cfg.layout.eval_result.read_text())
    except (OSError, ValueError):
        result = {}
    problems = [] if _finite(result.get("val_loss")) else [f"no finite val_loss in {cfg.layout.eval_result}"]
    figures = {k: result.get(k) for k in ("checkpoint_id", "step", "val_loss", "perplexity", "batches", "tokens",
                                          "saved_world_size")}
    summary = (f"{result['checkpoint_id']}: val loss {result['val_loss']:.3f}, perplexity {result['perplexity']:.2f}"
               if not problems else "no evaluation result")
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
            problems.append(f"a checkpoint writer process holds a CUDA context ({result['writer_cuda_evidence']}): "
                            "every rank's writer costs GPU memory and can block on the device")
    ratio = result.get("stall_over_memcpy")
    shm = result.get("shm", {})
    if result:  # a figure, not a pass condition: docs/benchmarks.md tracks the same target on CPU
        result["stall_target"] = f"≤ {STALL_TARGET:g}× memcpy: {'met' if ratio <= STALL_TARGET else 'missed'}"
    summary = (f"stall {result['stall_s'] * 1e3:.0f} ms = {ratio:.2f}× pinned memcpy ({result['state_mb']:.0f} MB/rank; "
               f"target {result['stall_target']}); /dev/shm +{shm.get('peak_growth_mb', 0):.0f} MB; "
               f"writer CUDA context: {'yes' if result['writer_has_cuda_context'] else 'none'}" if result else "no result")
    return _result(check, ctx, command, rc, wall, problems, result, summary)


def check_memory(ctx: Context, check: Check) -> CheckResult:
    command, rc, wall, result = _run_worker(ctx, check)
    problems = [] if result else ["the worker wrote no result (see the log)"]
    if result and not all(_finite(x) for x in result["losses"]):
        problems.append(f"losses are not finite: {result['losses']}")
    per_gpu = result.get("max_allocated_gib", [])
    summary = (f"{max(per_gpu):.1f} GiB peak allocated per GPU (max of {len(per_gpu)}), "
               f"seq {result['seq_len']} × batch {result['batch_size']}; estimated "
               f"{result['estimate_gib']['total']} GiB at the preset's default world size" if per_gpu else "no result")
    return _result(check, ctx, command, rc, wall, problems, result, summary)


CHECKS: tuple[Check, ...] = (
    Check("train", f"bf16 FSDP2 training (`fsdp_resilience.training.launch`, `{GPU_RUN['model']}`)", 600, check_train),
    Check("checkpoint", "async checkpoint on CUDA (AsyncCheckpointer)", 420, check_checkpoint),
    Check("exception", "exception → in-process restart (NCCL)", 600, check_exception),
    Check("hang", "hang → in-process restart (NCCL)", 600, check_hang),
    Check("sigkill", "SIGKILL → in-job restart (ft_launcher)", 600, check_sigkill),
    Check("evaluate", "evaluation of the trained checkpoint (`fsdp_resilience.training.evaluate`)", 300, check_evaluate),
    Check("memory", "memory of the `1b` preset (FSDP2 + AdamW)", 420, check_memory),
)
#: The checks that run ``python -m fsdp_resilience.training.launch``; the others run a worker of this module.
LAUNCHED = tuple(LAUNCH_SCENARIOS)
WORKERS = ("checkpoint", "memory")


def run_check(ctx: Context, check: Check) -> CheckResult:
    log(f"{check.key}: {check.title} (at most {check.timeout_s:.0f} s)")
    t0 = time.monotonic()
    try:
        result = check.run(ctx, check)
    except Exception as e:  # a bug in this script must not hide the other checks' results
        result = CheckResult(check.key, check.title, passed=False, seconds=round(time.monotonic() - t0, 1),
                             problems=[f"gpu_check itself failed: {type(e).__name__}: {e}"])
    log(f"{check.key}: {'passed' if result.passed else 'FAILED'} in {result.seconds:.0f} s: "
        f"{result.summary}{'; ' + '; '.join(result.problems) if result.problems else ''}")
    return result


# --------------------------------------------------------------------------------------------
# Workers: one process per GPU, started by torchrun (``--worker``)
# --------------------------------------------------------------------------------------------


def training_api() -> SimpleNamespace:
    """What the workers use from torch and training/, imported in one place: the dry run calls
    this too, so it proves the very imports the workers make."""
    import torch
    import torch.distributed as dist

    from fsdp_resilience.training.checkpointing import AsyncCheckpointer, app_state
    from fsdp_resilience.training.contract import EventLog
    from fsdp_resilience.training.model import BYTE_VOCAB, PRESET_RUNS, PRESETS, cross_entropy_loss, memory_per_gpu, param_count
    from fsdp_resilience.training.parallelize import build_optimizer, build_sharded_model, device_mesh

    return SimpleNamespace(torch=torch, dist=dist, AsyncCheckpointer=AsyncCheckpointer, app_state=app_state,
                           EventLog=EventLog, BYTE_VOCAB=BYTE_VOCAB, PRESETS=PRESETS,
                           cross_entropy_loss=cross_entropy_loss, param_count=param_count,
                           build_optimizer=build_optimizer, build_sharded_model=build_sharded_model,
                           device_mesh=device_mesh, PRESET_RUNS=PRESET_RUNS, memory_per_gpu=memory_per_gpu)


def _worker_setup(api: SimpleNamespace) -> tuple[int, int, Any]:
    """(rank, world size, device) from torchrun's environment, the device made current."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = api.torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    api.torch.cuda.set_device(device)
    return rank, world, device


def _model_and_optimizer(api: SimpleNamespace, cfg: RunConfig, device: Any) -> tuple[Any, Any]:
    """The model and optimizer exactly as src/fsdp_resilience/training/train.py builds them."""
    mesh = api.device_mesh(device, cfg.nodes, cfg.procs_per_node)
    model = api.build_sharded_model(cfg.model, mesh, device, seed=cfg.seed, max_seq_len=cfg.seq_len)
    return model, api.build_optimizer(model, device, lr=cfg.lr, weight_decay=cfg.weight_decay)


def _train_step(api: SimpleNamespace, model: Any, optimizer: Any, cfg: RunConfig, device: Any, gen: Any) -> float:
    """One step of train.py's loop on random tokens (enough for memory and checkpoint figures)."""
    torch = api.torch
    tokens = torch.randint(0, api.BYTE_VOCAB, (cfg.batch_size, cfg.seq_len + 1), device=device, generator=gen)
    loss = api.cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def _gather(api: SimpleNamespace, value: Any, world: int) -> list[Any]:
    out: list[Any] = [None] * world
    api.dist.all_gather_object(out, value)
    return out


def worker_memory(cfg: RunConfig, result_path: Path) -> None:
    api = training_api()
    torch = api.torch
    rank, world, device = _worker_setup(api)
    api.dist.init_process_group("nccl", timeout=timedelta(seconds=300), device_id=device)
    model, optimizer = _model_and_optimizer(api, cfg, device)
    gen = torch.Generator(device=device).manual_seed(cfg.seed + rank)
    losses, step_s = [], []
    for _ in range(cfg.steps):
        t0 = time.perf_counter()
        losses.append(_train_step(api, model, optimizer, cfg, device, gen))
        step_s.append(round(time.perf_counter() - t0, 4))
    gib = 2**30
    mine = {"gpu": torch.cuda.get_device_name(device), "losses": losses, "step_s": step_s,
            "allocated": torch.cuda.max_memory_allocated(device) / gib,
            "reserved": torch.cuda.max_memory_reserved(device) / gib,
            "total": torch.cuda.get_device_properties(device).total_memory / gib}
    ranks = _gather(api, mine, world)
    if rank == 0:
        write_json(result_path, {
            "model": cfg.model, "params": api.param_count(api.PRESETS[cfg.model]), "world_size": world,
            "seq_len": cfg.seq_len, "batch_size": cfg.batch_size, "steps": cfg.steps,
            "optimizer": f"AdamW (fsdp_resilience.training.parallelize.build_optimizer), lr {cfg.lr}, weight_decay {cfg.weight_decay}",
            "max_allocated_gib": [round(r["allocated"], 2) for r in ranks],
            "max_reserved_gib": [round(r["reserved"], 2) for r in ranks],
            "gpu_total_gib": round(ranks[0]["total"], 1), "losses": losses, "step_s": step_s,
            "estimate_gib": api.memory_per_gpu(api.PRESETS[cfg.model], api.PRESET_RUNS[cfg.model])})
    api.dist.destroy_process_group()


class ShmSampler:
    """Peak bytes used on /dev/shm, sampled in a thread: the snapshot buffers the writer process
    maps live there, and a full /dev/shm (64 MB by default in a container) fails saves."""

    def __init__(self, path: str = "/dev/shm", interval_s: float = 0.005):
        self.path, self.interval_s = path, interval_s
        self.baseline = self.peak = shutil.disk_usage(path).used
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="shm-sampler", daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, shutil.disk_usage(self.path).used)

    def __enter__(self) -> "ShmSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def result(self) -> dict[str, float]:
        mb = 1e6
        return {"size_mb": round(shutil.disk_usage(self.path).total / mb, 1), "baseline_mb": round(self.baseline / mb, 1),
                "peak_mb": round(self.peak / mb, 1), "peak_growth_mb": round((self.peak - self.baseline) / mb, 1),
                "after_mb": round(shutil.disk_usage(self.path).used / mb, 1)}


def _local_tensors(api: SimpleNamespace, state: Any) -> list[Any]:
    """Every tensor of a state dict as this rank holds it (a DTensor's local shard)."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, dict):
        return [t for v in state.values() for t in _local_tensors(api, v)]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in _local_tensors(api, v)]
    if isinstance(state, DTensor):
        return [state.to_local()]
    return [state] if isinstance(state, api.torch.Tensor) else []


def _pinned_memcpy_s(api: SimpleNamespace, tensors: list[Any], trials: int) -> list[float]:
    """The floor a snapshot is measured against: the same bytes copied into pinned host buffers
    (allocated once, as the checkpointer's are), until the copies landed."""
    torch = api.torch
    buffers = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    times = []
    for trial in range(trials + 1):  # trial 0 warms up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for buf, t in zip(buffers, tensors):
            buf.copy_(t, non_blocking=t.is_cuda)
        torch.cuda.synchronize()
        if trial:
            times.append(time.perf_counter() - t0)
    return times


def compute_app_pids() -> list[int] | None:
    """PIDs nvidia-smi lists as holding a CUDA context; None when nvidia-smi is missing or fails."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return [int(x) for x in out.split() if x.strip().isdigit()]


def maps_libcuda(pid: int) -> bool | None:
    """Whether the process has the CUDA driver library mapped (None: cannot read its maps)."""
    try:
        return "libcuda.so" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return None


def worker_checkpoint(cfg: RunConfig, result_path: Path) -> None:
    api = training_api()
    torch = api.torch
    rank, world, device = _worker_setup(api)
    events = api.EventLog(cfg.layout.events, run_id=cfg.run_id, rank=rank) if rank == 0 else None
    # Built before the process group, as train.py does: the writer process boots meanwhile.
    ckpt = api.AsyncCheckpointer(cfg.run_dir, rank=rank, world_size=world, keep=cfg.keep_checkpoints,
                                 device=device, events=events)
    api.dist.init_process_group("nccl", timeout=timedelta(seconds=300), device_id=device)
    ckpt.rebind(api.dist.group.WORLD)
    model, optimizer = _model_and_optimizer(api, cfg, device)
    gen = torch.Generator(device=device).manual_seed(cfg.seed + rank)
    _train_step(api, model, optimizer, cfg, device, gen)  # AdamW's moments exist from here on
    tensors = _local_tensors(api, api.app_state(model, optimizer, {"step": 0}))
    state_bytes = sum(t.numel() * t.element_size() for t in tensors)
    memcpy_s = _pinned_memcpy_s(api, tensors, trials=cfg.steps)
    del tensors
    saves = []
    sampler = ShmSampler() if int(os.environ["LOCAL_RANK"]) == 0 else contextlib.nullcontext()
    with sampler:
        for step in range(1, cfg.steps + 1):
            _train_step(api, model, optimizer, cfg, device, gen)
            api.dist.barrier()
            state = api.app_state(model, optimizer, {"step": step})
            ckpt.save(step, state)
            if ckpt.last_save is None or ckpt.last_save.step != step:  # save() skips committed steps
                raise RuntimeError(f"save of step {step} was skipped: {cfg.run_dir} already holds it; remove that "
                                   "folder (the checkpoint check starts from an empty one)")
            saves.append(asdict(ckpt.last_save))
            # Untimed: the write finishes before the next save, as it does over a checkpoint interval.
            ckpt.wait()
    writer_pids = ckpt.writer_pids()
    writers = writer_pids + [c for pid in writer_pids for c in descendants(pid)]
    mine = {"pid": os.getpid(), "writers": writers, "state_bytes": state_bytes, "memcpy_s": memcpy_s,
            "blocking_s": [s["blocking_s"] for s in saves], "saves": saves,
            "libcuda_mapped": {pid: maps_libcuda(pid) for pid in writers},
            "shm": sampler.result() if isinstance(sampler, ShmSampler) else None}
    ranks = _gather(api, mine, world)
    if rank == 0:
        write_json(result_path, _checkpoint_result(cfg, ranks, compute_app_pids()))
    ckpt.close()
    api.dist.destroy_process_group()


def _checkpoint_result(cfg: RunConfig, ranks: list[dict[str, Any]], apps: list[int] | None) -> dict[str, Any]:
    """Rank 0's summary: the slowest rank's figures (the loop goes on when the slowest rank does)."""
    # Saves after the first: the first one allocates and pins its buffers and may wait for the
    # writer's boot; train.py pays that once per process.
    stall = max(statistics.median(r["blocking_s"][1:] or r["blocking_s"]) for r in ranks)
    memcpy = max(statistics.median(r["memcpy_s"]) for r in ranks)
    writers = [pid for r in ranks for pid in r["writers"]]
    trainers = [r["pid"] for r in ranks]
    # nvidia-smi lists host PIDs; inside a container it may list none of ours. Trust it only when it
    # sees the training processes themselves, else go by the mapped driver library.
    smi_sees_trainers = apps is not None and any(pid in apps for pid in trainers)
    mapped = {int(pid): m for r in ranks for pid, m in r["libcuda_mapped"].items()}
    if smi_sees_trainers:
        with_context = [pid for pid in writers if pid in apps]
        evidence = f"nvidia-smi lists writer pid(s) {with_context}"
    else:
        with_context = [pid for pid, m in mapped.items() if m]
        why = "nvidia-smi failed" if apps is None else "nvidia-smi does not list the trainers (another PID namespace)"
        evidence = f"libcuda mapped in writer pid(s) {with_context}; {why}"
    breakdown = {k: round(statistics.median(s[k] for s in ranks[0]["saves"][1:] or ranks[0]["saves"]), 4)
                 for k in ("settle_s", "snapshot_s", "plan_s", "schedule_s")}
    latest = CheckpointCatalog(cfg.run_dir).latest()
    return {"model": cfg.model, "world_size": len(ranks), "saves": cfg.steps,
            "state_mb": round(max(r["state_bytes"] for r in ranks) / 1e6, 1),
            "state_mb_total": round(sum(r["state_bytes"] for r in ranks) / 1e6, 1),
            "stall_s": round(stall, 4), "first_save_s": round(max(r["blocking_s"][0] for r in ranks), 4),
            "memcpy_s": round(memcpy, 4), "stall_over_memcpy": round(stall / memcpy, 2),
            "stall_breakdown_rank0_s": breakdown,
            "blocking_s_per_rank": [[round(x, 4) for x in r["blocking_s"]] for r in ranks],
            "memcpy_s_per_rank": [[round(x, 4) for x in r["memcpy_s"]] for r in ranks],
            "shm": ranks[0]["shm"] or {}, "writer_pids": writers, "trainer_pids": trainers,
            "nvidia_smi_compute_pids": apps, "nvidia_smi_sees_trainers": smi_sees_trainers,
            "writer_libcuda_mapped": mapped, "writer_has_cuda_context": bool(with_context),
            "writer_cuda_evidence": evidence, "committed_step": latest.step if latest else None}


def worker_probe(result_path: Path) -> None:
    """Versions and GPUs, from a process of its own (the orchestrator never creates a CUDA context)."""
    import importlib.metadata

    import torch

    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    torch.ones(1, device="cuda").add_(1).item()  # CUDA works, not just enumerates
    nccl = torch.cuda.nccl.version()
    smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,memory.total", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=60)
    first = smi.stdout.splitlines()[0].split(",") if smi.returncode == 0 and smi.stdout.strip() else ["?", "?"]
    write_json(result_path, {
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl),
        "nvidia-resiliency-ext": importlib.metadata.version("nvidia-resiliency-ext"),
        "gpu": names[0] if names else None, "gpu_count": len(names), "gpus": names,
        "gpu_memory": first[1].strip(), "driver": first[0].strip(),
        "capability": ".".join(map(str, torch.cuda.get_device_capability(0)))})


# --------------------------------------------------------------------------------------------
# The report: docs/gpu.md and bench/results/gpu.json
# --------------------------------------------------------------------------------------------


def render_markdown(report: dict[str, Any]) -> str:
    v = report["versions"]
    checks = report["checks"]
    passed = sum(c["passed"] is True for c in checks)
    when = report["started_at"][:16].replace("T", " ")
    lines = ["# GPU check", "",
             f"Written by `make gpu-check` (`python -m bench.gpu_check`) on {when} in "
             f"{report['wall_s'] / 60:.1f} min: **{passed} of {len(checks)} checks passed**"
             + (" (dry run: nothing ran on a GPU)" if report["dry_run"] else "") + ". "
             "Raw figures: `bench/results/gpu.json`; logs and run dirs: `runs/gpu-check/` on that machine.", "",
             "| | |", "|---|---|",
             f"| GPUs | {v.get('gpu_count', 0)} × {v.get('gpu') or 'none'} ({v.get('gpu_memory', '?')}) |",
             f"| driver | {v.get('driver', '?')} |", f"| CUDA (torch build) | {v.get('cuda')} |",
             f"| NCCL | {v.get('nccl', '?')} |", f"| torch | {v.get('torch')} |",
             f"| nvidia-resiliency-ext | {v.get('nvidia-resiliency-ext')} |",
             f"| host | {report['machine'].get('cores')} cores, {report['machine'].get('memory_gb')} GB, "
             f"python {report['machine'].get('python')} |", "",
             "| # | check | result | figures | time |", "|---|---|---|---|---|"]
    for i, c in enumerate(checks, 1):
        result = {True: "passed", False: "**failed**", None: "not run"}[c["passed"]]
        lines.append(f"| {i} | {c['title']} | {result} | {c['summary']} | {c['seconds']:.0f} s |")
    lines += ["", "## Details", ""]
    for i, c in enumerate(checks, 1):
        lines += [f"### {i}. {c['title']}", ""]
        if c["command"]:
            lines += [f"`{c['command'].replace(str(REPO) + '/', '')}`", ""]
        lines += [f"- {k}: {json.dumps(val, default=str, ensure_ascii=False)}" for k, val in c["figures"].items()]
        if c["problems"]:
            lines += ["", "Failed: " + "; ".join(c["problems"]) + f". Log: `{c['log']}`."]
        if c["log_tail"]:
            lines += ["", "```", c["log_tail"], "```"]
        lines.append("")
    return "\n".join(lines)


def write_report(report: dict[str, Any], md_path: Path, json_path: Path) -> None:
    write_json(json_path, report)
    md_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = md_path.with_name(f".{md_path.name}.tmp.{os.getpid()}")
    tmp.write_text(render_markdown(report))
    os.replace(tmp, md_path)


def new_report(versions: dict[str, Any], results: list[CheckResult], started: float, dry_run: bool,
               work: Path) -> dict[str, Any]:
    return {"command": "python -m bench.gpu_check " + " ".join(sys.argv[1:]), "dry_run": dry_run,
            "started_at": datetime.fromtimestamp(started).astimezone().isoformat(timespec="seconds"),
            "wall_s": round(time.time() - started, 1), "machine": machine(), "versions": versions,
            "work_dir": str(work), "passed": sum(r.passed is True for r in results), "total": len(results),
            "checks": [asdict(r) for r in results]}


# --------------------------------------------------------------------------------------------
# Dry run: the wiring, without a GPU
# --------------------------------------------------------------------------------------------


def dry_run(gpus: int, reason: str, checks: tuple[Check, ...]) -> int:
    """Everything short of running on a GPU; returns the exit code."""
    import importlib
    import importlib.metadata

    started = time.time()
    done: list[str] = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-dry-") as tmp:
        work = Path(tmp)
        dataset = ensure_dataset(work / "dataset", sys.executable)
        try:
            configs = build_configs(work, dataset, gpus)
        except ConfigError as e:
            print(f"error: a gpu-check run config is invalid: {e}. Fix GPU_RUN / the scenarios in "
                  "bench/gpu_check.py to match RunConfig.validate (src/fsdp_resilience/training/contract.py).", file=sys.stderr)
            return 1
        paths = write_configs(configs, work / "configs")
        t = nccl_timeouts(configs["hang"])
        done.append(f"{len(configs)} run configs valid for {gpus} GPU(s) (NCCL: hang {t['hang_timeout_s']:g} s, "
                    f"hard {t['hard_timeout_s']:g} s, collective {t['collective_timeout_s']:g} s, "
                    f"heartbeat {t['heartbeat_timeout_s']:g} s)")
        for name in LAUNCHED:  # what `fsdp_resilience.training.launch` would start, without starting it
            proc = subprocess.run(launch_command(paths[name], dry_run=True), cwd=REPO, capture_output=True,
                                  text=True, timeout=60)
            if proc.returncode != 0 or "fsdp_resilience.training.train" not in proc.stdout:
                print(f"error: `fsdp_resilience.training.launch --dry-run` failed for scenario {name} (exit {proc.returncode}):\n"
                      f"{proc.stdout}{proc.stderr}", file=sys.stderr)
                return 1
            print(f"[dry-run] {name}: {proc.stdout.strip().replace(str(REPO) + '/', '')}")
        done.append(f"launcher commands for {', '.join(LAUNCHED)}")
        import torch.distributed.run as torchrun

        for name in WORKERS:  # torchrun and the worker parse their command lines as built
            command = worker_command(name, paths[name], work / f"{name}.json", gpus)
            torchrun.get_args_parser().parse_args(command[3:])
            parse_args(command[command.index("bench.gpu_check") + 1:])
            print(f"[dry-run] {name}: {shlex.join(command).replace(str(REPO) + '/', '')}")
        done.append(f"torchrun workers {', '.join(WORKERS)}")
        training_api()
        for module in ("fsdp_resilience.training.train", "fsdp_resilience.training.evaluate", "nvidia_resiliency_ext.inprocess"):
            importlib.import_module(module)
        evaluate_help = io.StringIO()
        with contextlib.redirect_stdout(evaluate_help), contextlib.suppress(SystemExit):
            importlib.import_module("fsdp_resilience.training.evaluate").main(["--help"])
        if "--config" not in evaluate_help.getvalue() or "--device" not in evaluate_help.getvalue():
            print("error: `python -m fsdp_resilience.training.evaluate` no longer takes --config and --device; update check_evaluate",
                  file=sys.stderr)
            return 1
        done.append("modules import")
        results = [CheckResult(c.key, c.title, passed=None, summary="dry run: wired, not run") for c in checks]
        versions = {"torch": importlib.import_module("torch").__version__,
                    "cuda": importlib.import_module("torch").version.cuda,
                    "nvidia-resiliency-ext": importlib.metadata.version("nvidia-resiliency-ext"), "gpu_count": 0}
        report = new_report(versions, results, started, True, work)
        write_report(report, work / "gpu.md", work / "gpu.json")
        text = (work / "gpu.md").read_text()
        if not all(c.title in text for c in checks) or json.loads((work / "gpu.json").read_text())["total"] != len(checks):
            print("error: the report writer left out checks; see render_markdown", file=sys.stderr)
            return 1
        done.append("report writer (temp dir; docs/gpu.md untouched)")
    print(f"gpu-check dry run: {reason}; wired {len(checks)} checks ({', '.join(c.key for c in checks)}): "
          f"{'; '.join(done)}; in {time.time() - started:.1f} s. Run `make gpu-check` on a CUDA machine for figures.")
    return 0


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def probe_versions(work: Path) -> dict[str, Any]:
    result = work / "results" / "probe.json"
    result.unlink(missing_ok=True)
    rc, _ = run_bounded([sys.executable, "-m", "bench.gpu_check", "--worker", "probe", "--result", str(result)],
                        work / "logs" / "probe.log", timeout_s=180)
    try:
        return json.loads(result.read_text())
    except (OSError, ValueError):
        return {"error": f"the version probe failed (exit {rc}); see {work / 'logs' / 'probe.log'}"}


def run_on_gpus(args: argparse.Namespace, gpus: int, checks: tuple[Check, ...]) -> int:
    started = time.time()
    work = args.work.resolve()
    log(f"gpu-check on {gpus} GPU(s): {', '.join(c.key for c in checks)}; work dir {work}")
    dataset = ensure_dataset(work / "dataset", sys.executable)
    try:
        configs = build_configs(work, dataset, gpus)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ctx = Context(work, gpus, configs, write_configs(configs, work / "configs"))
    versions = probe_versions(work)
    log(f"versions: {versions}")
    results = [run_check(ctx, check) for check in checks]
    if not args.keep_checkpoints:  # GBs per run; logs and events stay for diagnosis
        for cfg in configs.values():
            shutil.rmtree(cfg.layout.checkpoints, ignore_errors=True)
    report = new_report(versions, results, started, False, work)
    write_report(report, args.doc, args.json)
    failed = [r.key for r in results if not r.passed]
    print(f"gpu-check: {report['passed']} of {len(results)} checks passed on {gpus} × {versions.get('gpu')} "
          f"in {report['wall_s'] / 60:.1f} min" + (f"; failed: {', '.join(failed)}" if failed else "")
          + f". Wrote {args.doc} and {args.json}.")
    return 1 if failed else 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="check the wiring only (the default without a GPU)")
    parser.add_argument("--only", default=None,
                        help=f"comma-separated checks (default all): {','.join(c.key for c in CHECKS)}")
    parser.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: every visible one; dry run: 1)")
    parser.add_argument("--work", type=Path, default=WORK, help=f"run dirs and logs (default {WORK.relative_to(REPO)})")
    parser.add_argument("--keep-checkpoints", action="store_true", help="keep the runs' checkpoints (GBs)")
    parser.add_argument("--doc", type=Path, default=DOC, help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, default=JSON_OUT, help=argparse.SUPPRESS)
    # A worker process of a check (started by torchrun), not for direct use.
    parser.add_argument("--worker", choices=("probe", *WORKERS), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--config", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker == "probe":
        worker_probe(args.result)
        return 0
    if args.worker is not None:
        worker = {"checkpoint": worker_checkpoint, "memory": worker_memory}[args.worker]
        worker(RunConfig.load(args.config), args.result)
        return 0
    wanted = [k.strip() for k in (args.only or "").split(",") if k.strip()]
    unknown = sorted(set(wanted) - {c.key for c in CHECKS})
    if unknown:
        print(f"error: unknown check(s) {unknown}; choose from {', '.join(c.key for c in CHECKS)}", file=sys.stderr)
        return 2
    checks = tuple(c for c in CHECKS if not wanted or c.key in wanted)
    import torch

    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible == 0 or args.dry_run:
        reason = (f"--dry-run given ({visible} GPU(s) visible)" if visible else
                  "found no GPU (torch.cuda.is_available() is False), so ran dry")
        return dry_run(args.gpus or visible or 1, reason, checks)
    gpus = args.gpus or visible
    if not 1 <= gpus <= visible:
        print(f"error: --gpus {gpus}: this machine has {visible} visible GPU(s)", file=sys.stderr)
        return 2
    return run_on_gpus(args, gpus, checks)


if __name__ == "__main__":  # the guard the checkpoint writer needs: it spawns this module's workers
    sys.exit(main())
