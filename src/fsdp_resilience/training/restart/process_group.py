"""Each attempt's default process group, and the store it forms on, which outlives in-process
restarts."""

from __future__ import annotations

import datetime
import os

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
    dist.init_process_group(
        backend=backend,
        store=store,
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=datetime.timedelta(seconds=max(timeout_s, join_timeout_s)),
        **process_group_options(device if device is not None else torch.device("cpu")),
    )
    dist.barrier()  # every rank is connected before the timeout shrinks
    set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if set_timeout is not None:
        set_timeout(datetime.timedelta(seconds=timeout_s))


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
