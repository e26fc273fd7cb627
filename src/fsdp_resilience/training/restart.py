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
built in ``fsdp_resilience.training.launch``.

Tested with nvidia-resiliency-ext 0.4.1 and 0.7.0 (the GPU image's; ``make test-nvrx07``) on CPU;
differences are feature-detected where noted.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import socket
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

from fsdp_resilience.training.checkpointing import CheckpointWriterError
from fsdp_resilience.training.contract import (
    DERIVED_SECTIONS,
    DerivedTimeouts,
    Event,
    EventLog,
    RestartTimeouts,
    RunConfig,
    atomic_write_text,
)

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


#: Heartbeats an attempt sends before it derives ft_launcher's timeouts (with two saves among them).
WARM_HEARTBEATS = 5


class RankMonitor:
    """The worker's link to ft_launcher: heartbeats, sections, workload control, and the timeouts
    derived from what this worker measured.

    A no-op when the worker was not started by ft_launcher (``restart_mode`` inprocess/none).
    Started at every in-process iteration, as NVRx requires a fresh client per attempt.

    Timeouts: ft_launcher starts with the configured ones (``RunConfig.section_timeouts``). In
    each attempt (in-process iteration), NVRx's ``TimeoutsCalc`` in the client measures the
    intervals between heartbeats and how long each section stays open. The start, the restore
    and the first save (it may wait for the checkpoint writer to boot) are one-off costs: the
    measure starts after the first save. At the first heartbeat after the next save, once
    ``WARM_HEARTBEATS`` were sent, every rank derives the same tighter heartbeat, ``step`` and
    ``checkpoint`` timeouts from it (``derive_when_warm``), so a frozen rank is found in seconds.
    They apply while training steps and saves run; entering ``setup`` (a restore) or
    ``final_checkpoint`` (waiting for the last write), which were not measured, puts the
    configured timeouts back. A rank monitor keeps what it was last sent across worker restarts,
    so every attempt begins by sending it the configured timeouts.

    Monitoring must never be what kills training: an in-process interrupt can cut an exchange with
    the rank monitor short, leaving the server's view of our sections out of step. On any error the
    client reconnects and keeps sending heartbeats (the launcher's hang detection), and stops
    reporting sections until the next attempt.
    """

    def __init__(self, cfg: RunConfig, timeouts: RestartTimeouts) -> None:
        self.cfg = cfg
        self.timeouts = timeouts
        self.client: RankMonitorClient | None = None
        self.section: str | None = None
        self.sections_ok = True
        self.applied: str | None = None  # "configured" | "derived": what the rank monitor holds
        self._new_attempt()

    def _new_attempt(self) -> None:
        # The derivation's schedule: the same on every rank, as the derivation is a collective.
        self.heartbeats = 0
        self.saves = 0
        self.heartbeats_at_save = 0  # heartbeats sent before the latest save began
        self.measured_from_save: int | None = None  # saves done when the measure (re)started
        self.derived: DerivedTimeouts | None = None

    @property
    def enabled(self) -> bool:
        return FT_SOCKET_ENV in os.environ

    def start(self) -> None:
        if self.enabled and self.client is None:
            self.client = RankMonitorClient()
            self.client.init_workload_monitoring()
            self.sections_ok = True
            self.applied = None  # unknown: an earlier attempt may have left derived timeouts
            self._new_attempt()

    def _call(self, what: str, fn: Callable[[RankMonitorClient], None]) -> None:
        if self.client is None:
            return
        try:
            fn(self.client)
        except RankMonitorClientError as e:
            print(f"[restart] rank monitor {what} failed ({e}); reconnecting, sections off until the next attempt",
                  flush=True)
            schedule = (self.heartbeats, self.saves, self.heartbeats_at_save, self.measured_from_save, self.derived)
            self.stop()
            self.start()
            # A reconnect on one rank must not move the derivation's schedule.
            (self.heartbeats, self.saves, self.heartbeats_at_save, self.measured_from_save, self.derived) = schedule
            self.sections_ok = False

    def heartbeat(self) -> None:
        self.heartbeats += 1
        self._call("heartbeat", lambda c: c.send_heartbeat())
        if self.client is not None and self.saves >= 1 and self.measured_from_save is None:
            # Start, restore and the first save are behind us: measure the steady state from here.
            calc = self.client.timeouts_calc
            calc.subsequent_max_time = -1.0
            calc.section_to_max_time = dict.fromkeys(calc.section_to_max_time, -1.0)
            self.measured_from_save = self.saves

    def enter(self, section: str) -> None:
        """Open ``section`` (closing the open one): the launcher times each section separately."""
        if section == "checkpoint":
            self.saves += 1
            self.heartbeats_at_save = self.heartbeats
        self._apply("derived" if section in DERIVED_SECTIONS else "configured")
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

    def derive_when_warm(self, step: int, events: EventLog) -> DerivedTimeouts | None:
        """Derive ft_launcher's timeouts when this attempt is warm (see the class); call it after
        each heartbeat, at the same steps on every rank: it is a collective on the default process
        group. Returns them the one time they are derived.

        NVRx's ``TimeoutsCalc`` takes the longest intervals over all ranks; ``RestartTimeouts.derive``
        turns them into timeouts (``timeout_safety_factor`` x each, above the restart layers' order,
        never above the configured ones). Rank 0 records them: a ``timeouts_derived`` event and
        ``RunDir.derived_timeouts``."""
        if (self.client is None or self.derived is not None or self.heartbeats < WARM_HEARTBEATS
                or self.measured_from_save is None or self.saves <= self.measured_from_save
                or self.heartbeats <= self.heartbeats_at_save):
            return None
        calc = self.client.timeouts_calc
        calc.synchronize_all()  # all-reduce (max) over ranks: every rank derives the same values
        if calc.subsequent_max_time <= 0:  # every rank reconnected meanwhile: nothing measured
            return None
        measured = {name: calc.section_to_max_time.get(name, -1.0) for name in DERIVED_SECTIONS}
        self.derived = self.timeouts.derive(self.cfg.restart_mode, calc.safety_factor, calc.subsequent_max_time,
                                            measured)
        self._apply("derived")
        if int(os.environ.get("RANK", "0")) == 0:
            events.emit(Event.TIMEOUTS_DERIVED, step=step, **self.derived.to_dict())
            try:
                atomic_write_text(self.cfg.layout.derived_timeouts,
                                  json.dumps({"step": step, **self.derived.to_dict()}, indent=2, sort_keys=True) + "\n")
            except OSError as e:  # the events log has it; a full run dir is found by the next save
                print(f"[restart] could not write {self.cfg.layout.derived_timeouts}: {e}", flush=True)
        return self.derived

    def _apply(self, which: str) -> None:
        """Send the rank monitor the configured or the derived timeouts, unless it holds them (or
        none are derived yet). ``initial`` and ``setup`` are never derived."""
        if which == "derived" and self.derived is None:
            which = "configured"
        if self.client is None or self.applied == which:
            return
        sections = self.cfg.section_timeouts()
        heartbeat = self.cfg.heartbeat_timeout_s
        if which == "derived":
            sections.update(self.derived.sections)
            heartbeat = self.derived.heartbeat_s
        # load_state_dict is NVRx's public way to hand timeouts to the rank monitor (it restores
        # calculated ones); it sends them at once.
        state = {"heartbeat": {"initial": self.cfg.initial_heartbeat_timeout_s, "subsequent": heartbeat,
                               "were_calculated": which == "derived"},
                 "section": {"section": sections, "out_of_section": self.cfg.initial_heartbeat_timeout_s,
                             "calculated_sections": list(DERIVED_SECTIONS) if which == "derived" else [],
                             "is_out_of_section_calculated": False}}
        sent = []
        self._call("timeouts update",
                   lambda c: (c.load_state_dict({c.CURRENT_TIMEOUTS_STATE_KEY: state}), sent.append(which)))
        if sent:
            self.applied = which

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


class GroupTransport:
    """The TCP connections of this attempt's gloo process groups, and a way to break them at once.

    A gloo collective blocked on a peer returns only when its timeout expires or its connection
    breaks. In torch 2.13 (measured with two processes) none of ``ProcessGroup.abort()``,
    ``shutdown()``, the backend's ``abort()``/``shutdown()``, ``dist.destroy_process_group`` or
    ``distributed_c10d._abort_process_group`` interrupts a pending gloo receive, on the blocked rank
    or on its peer: the group's sockets close only when its last reference goes, and after a fault
    a traceback holding the model (its DTensors hold the mesh, the mesh the groups) keeps it.
    ``shutdown(2)`` on the group's connections does it: the pending operations fail within
    milliseconds with "Connection closed by peer", on this rank and on every peer connected to it.
    The descriptors stay open (gloo owns them and closes them when the group is freed), so this
    is safe from any thread, at any time, and more than once.

    Which sockets: the TCP connections this process opened or accepted since ``mark`` (called just
    before the attempt's first group forms), less those of the stores (``MASTER_PORT`` .. +2, and
    any server listening before ``mark``): the groups' pairs, whichever groups the attempt made
    (the default group, a device mesh's). Connections something else opens in this process during
    an attempt would be broken too; nothing in the training worker does. Listening sockets are left
    alone: gloo's listener treats a failed accept as fatal.
    """

    def __init__(self) -> None:
        self._before: frozenset[str] | None = None  # "socket:[inode]" of sockets open before mark
        self._skip_ports: frozenset[int] = frozenset()

    def mark(self) -> None:
        """Call just before the attempt's first gloo process group forms."""
        ports = set()
        if "MASTER_PORT" in os.environ:
            master = int(os.environ["MASTER_PORT"])
            ports |= {master, master + 1, master + 2}  # rendezvous, app_store, the Wrapper's store
        before = set()
        for link, sock in _borrowed_sockets():
            before.add(link)
            try:
                if _is_tcp(sock) and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    ports.add(sock.getsockname()[1])  # a server (a store) that predates the attempt
            except OSError:  # closed meanwhile
                pass
        self._before = frozenset(before)
        self._skip_ports = frozenset(ports)

    def shut_down(self) -> int:
        """Break every connection of the attempt's groups; returns how many were shut down now.
        A no-op before ``mark`` (and on NCCL, where nothing marks). Never raises: it runs on the
        way out of a fault."""
        if self._before is None:
            return 0
        count = 0
        for link, sock in _borrowed_sockets():
            if link in self._before:
                continue
            try:
                if not _is_tcp(sock) or sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    continue
                if {sock.getsockname()[1], sock.getpeername()[1]} & self._skip_ports:
                    continue
                sock.shutdown(socket.SHUT_RDWR)
                count += 1
            except OSError:  # not connected, already shut down, reset by the peer, or closed
                pass
        return count


#: The current attempt's gloo connections: ``init_process_group`` marks them, a fault breaks them
#: (``Trainer._on_fault`` on the failing rank, the Wrapper's abort on every rank).
group_transport = GroupTransport()


def _borrowed_sockets():
    """("socket:[inode]", socket) for each open socket of this process (Linux /proc; none
    elsewhere). The socket objects wrap descriptors that others own: each is detached, never
    closed, before the next is made, and one whose descriptor was closed and reused meanwhile is
    left out."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return
    for name in names:
        fd = int(name)
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile, or the listing's own descriptor
            continue
        if not link.startswith("socket:["):
            continue
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == link:
                yield link, sock
        except OSError:
            pass
        finally:
            sock.detach()


def _is_tcp(sock: socket.socket) -> bool:
    return sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM


class _AbortProcessGroups(inprocess.abort.Abort):
    """Tear down the training process groups so blocked ranks can unwind.

    Runs in every rank's Wrapper monitor thread once any rank reported a fault. On CUDA, NVRx's
    ``AbortTorchDistributed`` aborts the NCCL communicators (a blocked NCCL collective otherwise
    never returns) and destroys the groups. On gloo, no abort reaches a blocked collective:
    breaking the attempt's connections (``GroupTransport``) fails it at once, and fails every
    peer's pending collective with this rank too. The default group may already be destroyed
    (``Trainer.run`` does it on the way out); its connections live on until it is freed.
    """

    def __call__(self, state):
        group_transport.shut_down()  # a no-op unless this attempt's groups are gloo's
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


#: How long each rank's Wrapper monitor thread waits, once a rank reported a fault, for others to
#: report theirs before it aborts and restarts (NVRx's default: 1 s, spent by every restart).
#: Only the restart log's list of faults depends on it: which ranks were terminated is read after
#: the iteration barrier, which waits for every rank (or its monitor process) anyway. Peers of a
#: failed rank report within about 10 ms (``GroupTransport``), well inside this.
LAST_CALL_WAIT_S = 0.05


def inprocess_wrapper(cfg: RunConfig, events: Callable[[], EventLog], *, device_type: str) -> inprocess.Wrapper:
    """The in-process restart Wrapper for this run.

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
            max_iterations=cfg.max_inprocess_restarts + 1,
            min_world_size=world, min_active_world_size=world),
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
