"""The restart layers inside a job, built on NVIDIA Resiliency Extension (NVRx).

Two layers, chosen by ``RunConfig.restart_mode``:

- **in-process** (``inprocess.Wrapper``): an exception or a Python-level hang in any rank is
  recovered inside the same processes; every rank re-enters the training function, which builds
  a fresh process group and reloads the newest committed checkpoint. Cheap (seconds).
- **in-job** (``ft_launcher``): a dead, frozen or silent rank (SIGKILL, OOM, SIGSTOP, node loss)
  is detected by the launcher's rank monitors (heartbeats and sections) and the whole worker group
  is respawned in the same pods, up to ``--max-restarts``.

``layered`` stacks them: ft_launcher outside, the Wrapper inside. Anything the Wrapper cannot
handle (a rank gone, the in-process budget spent) leaves the process with a non-zero exit, which
ft_launcher turns into an in-job restart. Worker-side pieces live here; the launcher command is
built in ``training.launch``.

Tested with nvidia-resiliency-ext 0.4.1 and 0.7.0 (the GPU image's; ``make test-nvrx07``) on CPU;
differences are feature-detected where noted.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from nvidia_resiliency_ext import inprocess
from nvidia_resiliency_ext.fault_tolerance import (
    RankMonitorClient,
    RankMonitorClientError,
    WorkloadAction,
    WorkloadControlRequest,
)

from training.checkpoint import CheckpointWriterError
from training.contract import Event, EventLog, RunConfig

FT_SOCKET_ENV = "FT_RANK_MONITOR_IPC_SOCKET"  # set by ft_launcher for each worker


class UserErrorAbort(BaseException):
    """Raised (as a BaseException, so the in-process Wrapper does not retry it) once a fault is
    classified as a user error: the same exception at the same step on two attempts."""


#: Words in a RuntimeError's message that mark a collective / transport failure.
_COMM_MARKERS = ("gloo", "nccl", "connection", "timed out", "timeout", "socket", "peer")


def is_platform_fault(exc: BaseException) -> bool:
    """Whether ``exc`` comes from the platform (storage, network, collectives, the checkpoint
    writer, memory) rather than the user's code: such faults are never called user errors, however
    often they repeat; they escalate through the restart layers instead."""
    if isinstance(exc, (CheckpointWriterError, dist.DistError, OSError, MemoryError, TimeoutError)):
        return True
    if isinstance(exc, RuntimeError):
        message = str(exc).lower()
        return any(marker in message for marker in _COMM_MARKERS)
    return False


class RankMonitor:
    """The worker's link to ft_launcher: heartbeats, sections, and workload control.

    A no-op when the worker was not started by ft_launcher (``restart_mode`` inprocess/none).
    Re-created at every in-process iteration, as NVRx requires a fresh client per attempt.

    Monitoring must never be what kills training: an in-process interrupt can cut an exchange with
    the rank monitor short, leaving the server's view of our sections out of step. On any error the
    client reconnects and keeps sending heartbeats (the launcher's hang detection), and stops
    reporting sections until the next attempt.
    """

    def __init__(self) -> None:
        self.client: RankMonitorClient | None = None
        self.section: str | None = None
        self.sections_ok = True

    @property
    def enabled(self) -> bool:
        return FT_SOCKET_ENV in os.environ

    def start(self) -> None:
        if self.enabled and self.client is None:
            self.client = RankMonitorClient()
            self.client.init_workload_monitoring()
            self.sections_ok = True

    def _call(self, what: str, fn: Callable[[RankMonitorClient], None]) -> None:
        if self.client is None:
            return
        try:
            fn(self.client)
        except RankMonitorClientError as e:
            print(f"[restart] rank monitor {what} failed ({e}); reconnecting, sections off until the next attempt",
                  flush=True)
            self.stop()
            self.start()
            self.sections_ok = False

    def heartbeat(self) -> None:
        self._call("heartbeat", lambda c: c.send_heartbeat())

    def enter(self, section: str) -> None:
        """Open ``section`` (closing the open one): the launcher times each section separately."""
        if not self.sections_ok:
            return
        previous, self.section = self.section, section
        if previous is not None:
            self._call("end_section", lambda c: c.end_section(previous))
        self._call("start_section", lambda c: c.start_section(section))

    def leave(self) -> None:
        previous, self.section = self.section, None
        if previous is not None and self.sections_ok:
            self._call("end_section", lambda c: c.end_section(previous))

    def shutdown_workload(self, reason: str) -> None:
        """Ask ft_launcher not to restart anyone: used for user errors, which would only repeat."""
        client = self.client or (RankMonitorClient() if self.enabled else None)
        if client is None:
            return
        try:
            if client.rank_info is None:  # the request carries our rank
                client.init_workload_monitoring()
            client.send_workload_control_request(
                WorkloadControlRequest(WorkloadAction.ShutdownWorkload, reason))
        except Exception as e:  # the marker file still stops relaunches; don't mask the user error
            print(f"[restart] could not ask ft_launcher to shut down: {e}", flush=True)

    def stop(self) -> None:
        client, self.client, self.section = self.client, None, None
        if client is not None:
            try:
                client.shutdown_workload_monitoring()
            except Exception:
                pass


class _AbortProcessGroups(inprocess.abort.Abort):
    """Tear down the training process groups so blocked ranks can unwind.

    NVRx's ``AbortTorchDistributed`` aborts NCCL communicators first (a blocked NCCL collective
    otherwise never returns); on CPU/gloo there is nothing to abort, so it only destroys the groups.
    """

    def __call__(self, state):
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


def use_libuv() -> bool:
    """Whether TCPStores use libuv: torch's own ``USE_LIBUV`` switch (default on). Torch builds
    without libuv (Debian's, in the NVRx 0.7 test lane) need ``USE_LIBUV=0``."""
    return os.environ.get("USE_LIBUV", "1").strip().lower() not in ("0", "false", "no")


def inprocess_wrapper(cfg: RunConfig, events: Callable[[], EventLog], *, device_type: str) -> inprocess.Wrapper:
    """The in-process restart Wrapper for this run.

    Stores: the Wrapper's own TCPStore listens on ``MASTER_PORT + 2`` (the training process group
    uses ``MASTER_PORT + 1``); ft_launcher picks a fresh ``MASTER_PORT`` each rendezvous round, so
    the ports never clash across in-job restarts. Timeouts follow the run contract's order
    (``RunConfig.timeouts``), which ``RunConfig.validate`` has checked for this backend.
    """
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
            max_iterations=cfg.max_inprocess_restarts + 1,
            min_world_size=world, min_active_world_size=world),
        abort=_AbortProcessGroups(),
        finalize=_RecordRestart(events),
        soft_timeout=soft,
        hard_timeout=hard,
        heartbeat_timeout=datetime.timedelta(seconds=max(5.0, cfg.hang_timeout_s)),
        barrier_timeout=barrier,
        completion_timeout=barrier,
        monitor_process_logfile=str(log_dir / "inprocess-monitor-rank{rank}.log"),
    )
    if not restart_health_checks_wanted(cfg, device_type):
        disable_gpu_health_checks(wrapper)
    return wrapper


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


def process_group_options(device: torch.device) -> dict:
    """Extra ``init_process_group`` arguments for ``device``: on CUDA, ``device_id`` binds the
    group to this rank's GPU, so NCCL creates its communicator eagerly on the right device (and
    no collective ever guesses the device from the current one)."""
    return {"device_id": device} if device.type == "cuda" else {}


def init_process_group(backend: str, iteration: int, timeout_s: float, join_timeout_s: float,
                       app_store: dist.Store, device: torch.device | None = None) -> None:
    """A fresh default process group for this in-process iteration, on its own key prefix so
    iterations never read each other's rendezvous keys.

    Ranks arrive at different times after a restart (a healthy rank first sits out its collective
    timeout), so forming the group may take up to ``join_timeout_s``; collectives then get
    ``timeout_s`` (``RunConfig.timeouts(backend).collective_s``): on gloo it bounds how long a
    healthy rank waits for a failed one; on NCCL it stays above the Wrapper's hard timeout.
    """
    store = dist.PrefixStore(f"train-iter-{iteration}", app_store)
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
