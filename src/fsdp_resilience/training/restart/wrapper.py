"""The in-process restart layer: NVRx's ``inprocess.Wrapper`` as this run configures it, with the
abort that tears the failed attempt's process groups down and the finalize step that logs the
restart."""

from __future__ import annotations

import datetime
import gc
import os
import sys
import threading
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from nvidia_resiliency_ext import inprocess

from fsdp_resilience.training.contract import Event, EventLog, RunConfig
from fsdp_resilience.training.restart.gloo_transport import group_transport
from fsdp_resilience.training.restart.process_group import use_libuv


class _AbortProcessGroups(inprocess.abort.Abort):
    """Tear down the training process groups so blocked ranks can unwind.

    Runs in every rank's Wrapper monitor thread once any rank reported a fault. No abort reaches
    a blocked gloo collective: breaking the attempt's gloo connections (``GroupTransport``) fails
    it at once, and fails every peer's pending collective with this rank too. Those are every
    group on CPU, and the save protocol's gloo group on CUDA, where a healthy rank may wait in a
    round of a pending save. On CUDA, NVRx's ``AbortTorchDistributed`` then aborts the NCCL
    communicators (a blocked NCCL collective otherwise never returns) and destroys the groups.
    The default group may already be destroyed (``Trainer.run`` does it on the way out); its
    connections live on until it is freed.
    """

    def __call__(self, state):
        group_transport.shut_down()  # the attempt's gloo connections, on every backend
        if not (dist.is_available() and dist.is_initialized()):
            return state
        if torch.cuda.is_available():
            return inprocess.abort.AbortTorchDistributed()(state)
        dist.destroy_process_group()
        return state


class _RecordRestart(inprocess.finalize.Finalize):
    """Runs on every rank once the Wrapper decided to restart (after an exception, a timeout or
    a peer's failure): puts the restart in the events log."""

    def __init__(self, events: Callable[[], EventLog]):
        self.events = events

    def __call__(self, state):
        if state.initial_rank == 0:
            exc = state.fn_exception
            reason = f"{type(exc).__name__}: {exc}"[:500] if exc is not None else "timeout or a peer's fault"
            self.events().emit(Event.RESTART_BEGIN, layer="inprocess", iteration=state.iteration, reason=reason)
        return state


#: How long each rank's Wrapper monitor thread waits, once a rank reported a fault, for others to
#: report theirs before it aborts and restarts (NVRx's default: 1 s, spent by every restart).
#: Only the restart log's list of faults depends on it: which ranks were terminated is read after
#: the iteration barrier, which waits for every rank (or its monitor process) anyway. Peers of a
#: failed rank report within about 10 ms (``GroupTransport``), well inside this.
LAST_CALL_WAIT_S = 0.05


def inprocess_wrapper(
    cfg: RunConfig,
    events: Callable[[], EventLog],
    *,
    device_type: str,
    on_store_lost: Callable[[BaseException], None] | None = None,
) -> inprocess.Wrapper:
    """The in-process restart Wrapper for this run. ``on_store_lost`` is called (before the
    process exits) when the Wrapper's store with rank 0 is gone (``exit_when_the_monitor_thread_dies``).

    Stores: the Wrapper's own TCPStore listens on ``MASTER_PORT + 2`` (the training process group
    uses ``MASTER_PORT + 1``); ft_launcher picks a fresh ``MASTER_PORT`` each rendezvous round, so
    the ports never clash across in-job restarts. Timeouts follow the run contract's order
    (``RunConfig.timeouts``), which ``RunConfig.validate`` has checked for this backend.

    Garbage collection: before every restart the Wrapper runs ``gc.collect()`` until it finds
    nothing, to free the failed attempt's model and groups: at least two full collections, each
    over every object of the process (about 250k once torch is imported; 0.3-1 s each on 2 busy
    cores). What exists before the first attempt lives as long as the process, so it is frozen
    here (``gc.freeze``): those collections then walk only what the attempts allocated, and
    still free all of it. Freezing also keeps whatever cyclic garbage the imports left, once.
    """
    gc.freeze()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    master_port = int(os.environ["MASTER_PORT"])
    timeouts = cfg.timeouts("nccl" if device_type == "cuda" else "gloo")
    soft = datetime.timedelta(seconds=timeouts.soft_s)
    hard = datetime.timedelta(seconds=timeouts.hard_s)
    barrier = max(datetime.timedelta(seconds=cfg.initial_heartbeat_timeout_s), hard + datetime.timedelta(seconds=10))
    log_dir = Path(cfg.run_dir).resolve() / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    wrapper = inprocess.Wrapper(
        store_kwargs={"port": master_port + 2, "timeout": barrier, "use_libuv": use_libuv()},
        # Fixed world size: FSDP shards are laid out for it. Losing a rank, or spending the
        # in-process budget, raises RestartAbort, ends the process, and escalates to ft_launcher.
        initialize=inprocess.initialize.RetryController(
            max_iterations=cfg.max_inprocess_restarts + 1, min_world_size=world, min_active_world_size=world
        ),
        abort=_AbortProcessGroups(),
        finalize=_RecordRestart(events),
        soft_timeout=soft,
        hard_timeout=hard,
        heartbeat_timeout=datetime.timedelta(seconds=max(5.0, cfg.hang_timeout_s)),
        barrier_timeout=barrier,
        completion_timeout=barrier,
        last_call_wait=datetime.timedelta(seconds=LAST_CALL_WAIT_S),
        monitor_process_logfile=str(log_dir / "inprocess-monitor-rank{rank}.log"),
    )
    if not restart_health_checks_wanted(cfg, device_type):
        disable_gpu_health_checks(wrapper)
    exit_when_the_monitor_thread_dies(on_store_lost)
    return wrapper


#: What NVRx names the Wrapper's monitor thread (``MonitorThread-<rank>``, 0.4.1 and 0.7).
_MONITOR_THREAD = "MonitorThread"


def exit_when_the_monitor_thread_dies(on_store_lost: Callable[[BaseException], None] | None = None) -> None:
    """End this rank's process when the Wrapper's monitor thread dies before the Wrapper stopped it.

    The monitor thread waits on the Wrapper's store, which lives with rank 0. When rank 0's node
    is lost, the wait fails with ``DistNetworkError``, which the thread does not catch (only a
    store timeout), so it dies. A rank that then fails a collective waits forever in the Wrapper
    for that thread to pause it, and its progress watchdog keeps ticking, so no Wrapper timeout
    fires: the surviving node hangs (seen on NVRx 0.7 when the rendezvous put rank 0 on the lost
    node). Without its store the in-process layer cannot restart this rank anyway: exit, and
    ft_launcher restarts the node's workers in-job, as for any rank the in-process layer gave up.
    A thread the Wrapper itself stopped (``stop_loop``: an iteration or the run ended, and rank 0
    may already be gone) is left to the usual hook. ``on_store_lost`` (the trainer logging the
    fault) runs first; nothing it raises keeps the process from exiting.
    """
    previous = threading.excepthook
    if getattr(previous, "exits_on_monitor_death", False):
        return  # installed by an earlier Wrapper in this process

    def hook(args: threading.ExceptHookArgs) -> None:
        thread = args.thread
        stopping = getattr(thread, "stop_loop", None)
        if thread is None or not thread.name.startswith(_MONITOR_THREAD) or stopping is None or stopping.is_set():
            previous(args)
            return
        print(
            f"error: NVRx's in-process monitor thread ({thread.name}) died: "
            f"{args.exc_type.__name__}: {args.exc_value}. Its store (with rank 0) is gone, "
            "so this rank cannot restart in-process; exiting so that ft_launcher restarts "
            "this node's workers.",
            file=sys.stderr,
            flush=True,
        )
        if on_store_lost is not None and args.exc_value is not None:
            try:
                on_store_lost(args.exc_value)
            except BaseException as e:  # the exit below matters more than the record
                print(f"error: could not log the lost store: {e!r}", file=sys.stderr, flush=True)
        os._exit(1)

    hook.exits_on_monitor_death = True  # type: ignore[attr-defined]
    threading.excepthook = hook


def restart_health_checks_wanted(cfg: RunConfig, device_type: str) -> bool:
    """NVRx 0.7's NVML GPU / NVLink / NIC checks before an in-process restart: on CUDA unless the
    run turns them off (``gpu_health_checks``); never on CPU, where NVML does not exist and every
    check fails, turning each in-process restart into a process exit."""
    return device_type == "cuda" and cfg.gpu_health_checks


def disable_gpu_health_checks(wrapper: inprocess.Wrapper) -> None:
    """Drop the restart health checks NVRx 0.7 chains in by itself when LOCAL_RANK is set.

    The Wrapper has no constructor switch for them. ``restart_health_check`` is the public
    attribute the Wrapper builds from ``health_check`` plus those NVML checks and consults before
    each restart; we pass no ``health_check`` of our own, so what remains is exactly the NVML
    chain. 0.4.1 has no such attribute and adds no checks.
    """
    if getattr(wrapper, "restart_health_check", None) is not None:
        wrapper.restart_health_check = None
