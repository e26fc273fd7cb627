"""Workers: one process per GPU, started by torchrun (``--worker``): the checkpoint and memory
measurements, and the version probe.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import subprocess
import threading
import time
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from bench.common import write_json
from bench.gpu_check.processes import descendants
from fsdp_resilience.training.contract import CheckpointCatalog, RunConfig


def training_api() -> SimpleNamespace:
    """What the workers use from torch and training/, imported in one place: the dry run calls
    this too, so it proves the very imports the workers make."""
    import torch
    import torch.distributed as dist

    from fsdp_resilience.training.checkpointing.checkpointer import AsyncCheckpointer
    from fsdp_resilience.training.checkpointing.snapshot import app_state
    from fsdp_resilience.training.contract import EventLog
    from fsdp_resilience.training.model import BYTE_VOCAB, PRESETS, cross_entropy_loss, param_count
    from fsdp_resilience.training.parallelize import build_optimizer, build_sharded_model, device_mesh

    return SimpleNamespace(
        torch=torch,
        dist=dist,
        AsyncCheckpointer=AsyncCheckpointer,
        app_state=app_state,
        EventLog=EventLog,
        BYTE_VOCAB=BYTE_VOCAB,
        PRESETS=PRESETS,
        cross_entropy_loss=cross_entropy_loss,
        param_count=param_count,
        build_optimizer=build_optimizer,
        build_sharded_model=build_sharded_model,
        device_mesh=device_mesh,
    )


def _worker_setup(api: SimpleNamespace) -> tuple[int, int, Any]:
    """(rank, world size, device) from torchrun's environment, the device made current."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = api.torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    api.torch.cuda.set_device(device)
    return rank, world, device


def _model_and_optimizer(api: SimpleNamespace, cfg: RunConfig, device: Any) -> tuple[Any, Any]:
    """The model and optimizer exactly as src/fsdp_resilience/training/train/loop.py builds them."""
    mesh = api.device_mesh(device, cfg.nodes, cfg.procs_per_node)
    model = api.build_sharded_model(cfg.model, mesh, device, seed=cfg.seed, max_seq_len=cfg.seq_len)
    return model, api.build_optimizer(model, device, lr=cfg.lr, weight_decay=cfg.weight_decay)


def _train_step(api: SimpleNamespace, model: Any, optimizer: Any, cfg: RunConfig, device: Any, gen: Any) -> float:
    """One step of train/loop.py's loop on random tokens (enough for memory and checkpoint figures)."""
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
    mine = {
        "gpu": torch.cuda.get_device_name(device),
        "losses": losses,
        "step_s": step_s,
        "allocated": torch.cuda.max_memory_allocated(device) / gib,
        "reserved": torch.cuda.max_memory_reserved(device) / gib,
        "total": torch.cuda.get_device_properties(device).total_memory / gib,
    }
    ranks = _gather(api, mine, world)
    if rank == 0:
        write_json(
            result_path,
            {
                "model": cfg.model,
                "params": api.param_count(api.PRESETS[cfg.model]),
                "world_size": world,
                "seq_len": cfg.seq_len,
                "batch_size": cfg.batch_size,
                "steps": cfg.steps,
                "optimizer": f"AdamW (fsdp_resilience.training.parallelize.build_optimizer), lr {cfg.lr}, "
                f"weight_decay {cfg.weight_decay}",
                "max_allocated_gib": [round(r["allocated"], 2) for r in ranks],
                "max_reserved_gib": [round(r["reserved"], 2) for r in ranks],
                "gpu_total_gib": round(ranks[0]["total"], 1),
                "losses": losses,
                "step_s": step_s,
            },
        )
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
        return {
            "size_mb": round(shutil.disk_usage(self.path).total / mb, 1),
            "baseline_mb": round(self.baseline / mb, 1),
            "peak_mb": round(self.peak / mb, 1),
            "peak_growth_mb": round((self.peak - self.baseline) / mb, 1),
            "after_mb": round(shutil.disk_usage(self.path).used / mb, 1),
        }


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
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
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
    # Built before the process group, as train/loop.py does: the writer process boots meanwhile.
    ckpt = api.AsyncCheckpointer(
        cfg.run_dir, rank=rank, world_size=world, keep=cfg.keep_checkpoints, device=device, events=events
    )
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
                raise RuntimeError(
                    f"save of step {step} was skipped: {cfg.run_dir} already holds it; remove that "
                    "folder (the checkpoint check starts from an empty one)"
                )
            saves.append(asdict(ckpt.last_save))
            # Untimed: the write finishes before the next save, as it does over a checkpoint interval.
            ckpt.wait()
    writer_pids = ckpt.writer_pids()
    writers = writer_pids + [c for pid in writer_pids for c in descendants(pid)]
    mine = {
        "pid": os.getpid(),
        "writers": writers,
        "state_bytes": state_bytes,
        "memcpy_s": memcpy_s,
        "blocking_s": [s["blocking_s"] for s in saves],
        "saves": saves,
        "libcuda_mapped": {pid: maps_libcuda(pid) for pid in writers},
        "shm": sampler.result() if isinstance(sampler, ShmSampler) else None,
    }
    ranks = _gather(api, mine, world)
    if rank == 0:
        write_json(result_path, _checkpoint_result(cfg, ranks, compute_app_pids()))
    ckpt.close()
    api.dist.destroy_process_group()


def _checkpoint_result(cfg: RunConfig, ranks: list[dict[str, Any]], apps: list[int] | None) -> dict[str, Any]:
    """Rank 0's summary: the slowest rank's figures (the loop goes on when the slowest rank does)."""
    # Saves after the first: the first one allocates and pins its buffers and may wait for the
    # writer's boot; train/loop.py pays that once per process.
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
    breakdown = {
        k: round(statistics.median(s[k] for s in ranks[0]["saves"][1:] or ranks[0]["saves"]), 4)
        for k in ("settle_s", "snapshot_s", "plan_s", "schedule_s")
    }
    latest = CheckpointCatalog(cfg.run_dir).latest()
    return {
        "model": cfg.model,
        "world_size": len(ranks),
        "saves": cfg.steps,
        "state_mb": round(max(r["state_bytes"] for r in ranks) / 1e6, 1),
        "state_mb_total": round(sum(r["state_bytes"] for r in ranks) / 1e6, 1),
        "stall_s": round(stall, 4),
        "first_save_s": round(max(r["blocking_s"][0] for r in ranks), 4),
        "memcpy_s": round(memcpy, 4),
        "stall_over_memcpy": round(stall / memcpy, 2),
        "stall_breakdown_rank0_s": breakdown,
        "blocking_s_per_rank": [[round(x, 4) for x in r["blocking_s"]] for r in ranks],
        "memcpy_s_per_rank": [[round(x, 4) for x in r["memcpy_s"]] for r in ranks],
        "shm": ranks[0]["shm"] or {},
        "writer_pids": writers,
        "trainer_pids": trainers,
        "nvidia_smi_compute_pids": apps,
        "nvidia_smi_sees_trainers": smi_sees_trainers,
        "writer_libcuda_mapped": mapped,
        "writer_has_cuda_context": bool(with_context),
        "writer_cuda_evidence": evidence,
        "committed_step": latest.step if latest else None,
    }


def worker_probe(result_path: Path) -> None:
    """Versions and GPUs, from a process of its own (the orchestrator never creates a CUDA context)."""
    import importlib.metadata

    import torch

    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    torch.ones(1, device="cuda").add_(1).item()  # CUDA works, not just enumerates
    nccl = torch.cuda.nccl.version()
    smi = subprocess.run(
        ["nvidia-smi", "--query-gpu=driver_version,memory.total", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    first = smi.stdout.splitlines()[0].split(",") if smi.returncode == 0 and smi.stdout.strip() else ["?", "?"]
    write_json(
        result_path,
        {
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl),
            "nvidia-resiliency-ext": importlib.metadata.version("nvidia-resiliency-ext"),
            "gpu": names[0] if names else None,
            "gpu_count": len(names),
            "gpus": names,
            "gpu_memory": first[1].strip(),
            "driver": first[0].strip(),
            "capability": ".".join(map(str, torch.cuda.get_device_capability(0))),
        },
    )
