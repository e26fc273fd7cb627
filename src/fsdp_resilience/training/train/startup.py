"""What a worker and each of its attempts set up besides the model and the checkpoint: the device,
the job's restart round, and the longer collective timeout a restore runs under."""

from __future__ import annotations

import contextlib
from typing import Iterable

import torch
import torch.distributed as dist

from fsdp_resilience.training.contract import RunConfig
from fsdp_resilience.training.parallelize import choose_device
from fsdp_resilience.training.restart.process_group import set_collective_timeout
from fsdp_resilience.training.train.env import WorkerEnv


@contextlib.contextmanager
def restore_timeout(collective_s: float, restore_s: float, groups: Iterable[dist.ProcessGroup] = ()):
    """Run a restore under the longer ``restore_s`` timeout on the default group and ``groups``
    (the device mesh's), then return to ``collective_s``.

    The short collective timeout detects a failed peer during training steps, where ranks move in
    lockstep. In a restore they do not: each rank checksums its own share of the files, rank 0
    alone quarantines a checkpoint that fails (moves it, writes and fsyncs records), and loads
    read unequal amounts, so healthy ranks may reach the next collective seconds apart (minutes
    for a large model). ``restore_s`` is the bound the run config gives a start and restore
    (``initial_heartbeat_timeout_s``); a rank that dies meanwhile is still found by ft_launcher's
    process monitoring."""
    groups = tuple(groups)
    if restore_s <= collective_s:
        yield
        return
    set_collective_timeout(restore_s, groups)
    try:
        yield
    finally:
        if dist.is_initialized():
            set_collective_timeout(collective_s, groups)


def job_restart_round(local_count: int, device: torch.device) -> int:
    """The job's restart round: the largest TORCHELASTIC_RESTART_COUNT of any rank (a collective).

    A node that joined after a restart (a replacement pod) counts from 0 on NVRx 0.4.1, while
    the nodes that were there count every round; on 0.7 every node already has the job's round.
    Fault drills select their ``attempt`` by it, so a drill fires once per round on both."""
    count = torch.tensor([local_count], dtype=torch.int64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count.item())


def setup_device(cfg: RunConfig, env: WorkerEnv) -> torch.device:
    """This rank's device, made current. On CUDA this runs before anything of NVRx's starts (the
    in-process Wrapper forks its monitor process; the checkpoint writer is forked or spawned), so
    none of them starts from a process whose device is still unset. (A process with a CUDA
    context spawns its writer: ``fork_is_safe``.)"""
    device = choose_device(cfg.device, env.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device
