"""Each attempt's default process group, and the store it forms on, which outlives in-process
restarts."""

from __future__ import annotations

import datetime
import os
from typing import Iterable

import torch
import torch.distributed as dist

from fsdp_resilience.training.restart.gloo_transport import group_transport


def use_libuv() -> bool:
    """Whether TCPStores use libuv: torch's own ``USE_LIBUV`` switch (default on). Torch builds
    without libuv (Debian's, in the NVRx 0.7 test lane) need ``USE_LIBUV=0``."""
    return os.environ.get("USE_LIBUV", "1").strip().lower() not in ("0", "false", "no")


def process_group_options(device: torch.device) -> dict:
    """Extra ``init_process_group`` arguments for ``device``: on CUDA, ``device_id`` binds the
    group to this rank's GPU, so NCCL creates its communicator eagerly on the right device (and
    no collective ever guesses the device from the current one)."""
    return {"device_id": device} if device.type == "cuda" else {}


def init_process_group(
    backend: str,
    iteration: int,
    timeout_s: float,
    join_timeout_s: float,
    app_store: dist.Store,
    device: torch.device | None = None,
) -> None:
    """A fresh default process group for this in-process iteration, on its own key prefix so
    iterations never read each other's rendezvous keys.

    Ranks arrive at different times after a restart, so forming the group may take up to
    ``join_timeout_s``; collectives then get ``timeout_s``
    (``RunConfig.timeouts(backend).collective_s``): on gloo it bounds how long a healthy rank waits
    for a hung one (a failed one breaks its connections at once: ``GroupTransport``); on NCCL it
    stays above the Wrapper's hard timeout.
    """
    store = dist.PrefixStore(f"train-iter-{iteration}", app_store)
    if backend == "gloo":
        group_transport.mark()  # so a fault can break this attempt's connections (GroupTransport)
    # (On NCCL the Trainer marks just before the save protocol's gloo group, the attempt's only one.)
    dist.init_process_group(
        backend=backend,
        store=store,
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=datetime.timedelta(seconds=max(timeout_s, join_timeout_s)),
        **process_group_options(device if device is not None else torch.device("cpu")),
    )
    dist.barrier()  # every rank is connected before the timeout shrinks
    set_collective_timeout(timeout_s)


def set_collective_timeout(timeout_s: float, groups: Iterable[dist.ProcessGroup] = ()) -> None:
    """Give the default group and ``groups`` (a device mesh's sub-groups) the collective timeout.

    torch gives every group it creates without an explicit timeout its backend's default (NCCL
    10 min, gloo 30 min), and ``init_device_mesh`` passes none: on a multi-node HSDP run the
    replicate and shard groups would not keep the timeout order the run config checked
    (``RestartTimeouts.check``). Where torch has no way to set it, nothing changes, and
    ``check_collective_timeouts`` says so."""
    set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if set_timeout is None:
        return
    for group in (None, *groups):
        set_timeout(datetime.timedelta(seconds=timeout_s), group)


def collective_timeout_s(group: dist.ProcessGroup | None = None) -> float | None:
    """The timeout (seconds) of ``group``'s backend (None: the default group), read from the
    backend's options; None where torch does not show it."""
    group = group if group is not None else dist.group.WORLD
    timeouts = set()
    for device in ("cpu", "cuda"):
        try:
            backend = group._get_backend(torch.device(device))
            timeouts.add(backend.options._timeout.total_seconds())
        except (AttributeError, RuntimeError, ValueError):
            continue  # no backend for this device type, or options not exposed
    return timeouts.pop() if len(timeouts) == 1 else None


def check_collective_timeouts(timeout_s: float, groups: Iterable[dist.ProcessGroup] = ()) -> None:
    """Raise if the default group or one of ``groups`` does not have ``timeout_s``: the timeout
    order of ``RestartTimeouts.check`` holds only if every group the training waits on has it."""
    for group in (None, *groups):
        got = collective_timeout_s(group)
        if got is not None and abs(got - timeout_s) > 1e-3:
            name = "default" if group is None else dist.distributed_c10d._get_process_group_name(group)
            raise RuntimeError(
                f"process group {name!r} has a collective timeout of {got:.0f}s, not the run's {timeout_s:.0f}s: "
                "the restart layers' timeout order would not hold on it"
            )


def app_store() -> dist.TCPStore:
    """The training process groups' store on ``MASTER_PORT + 1``, hosted by rank 0 for the life
    of the process (it survives in-process restarts, unlike the process groups)."""
    rank = int(os.environ["RANK"])
    return dist.TCPStore(
        host_name=os.environ["MASTER_ADDR"],
        port=int(os.environ["MASTER_PORT"]) + 1,
        world_size=int(os.environ["WORLD_SIZE"]),
        is_master=rank == 0,
        timeout=datetime.timedelta(seconds=300),
        wait_for_workers=False,
        use_libuv=use_libuv(),
    )
