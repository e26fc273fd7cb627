"""NVRx's persistent checkpoint writer process, hardened: one per rank, started, watched and replaced.

One writer process per rank (``_PersistentWriter``), started by us on every NVRx version with a
parent-death signal, fed through ``_WriterQueue`` (NVRx's ``AsyncCallsQueue`` without its CUDA
finalize). Write results come back over the writer's own completion queue, each tagged with its
save's number (``write_results``): no manager process, so a rank runs two interpreters
(trainer and writer), not three. A trainer that asks for it (``fork=True``) gets its first writer
forked before it has threads, a process group or CUDA: no second interpreter boot importing torch
to compete with its start and restore. Replacements are spawned. Writers run at reduced CPU
priority (``NICE``).

A save's job in the writer (NVRx's write, then the checksums the commit needs) is ``write_job``'s.

Liveness: a writer that dies is seen by its process state; one that is stopped or hung (no CPU
time used and no byte read or written, by it or by the file writers it forked, for ``stall_s``
while it has work) is treated as dead: SIGKILLed with every descendant (SIGKILL also ends a
SIGSTOPped process) and replaced. The file writers NVRx 0.4.1 forks get a parent-death signal of
their own, so they never outlive their writer.

NVRx versions: tested on 0.4.1 and 0.7.0 (``make test-nvrx07``), with feature detection where they
differ: ``cpu_shm_mode`` (0.7's writer opens no CUDA context with it), the writer loop's arguments
(we spawn the writer ourselves on both, with a parent-death signal), whether the save request carries
its write buckets, the ``non_blocking`` parameter of the preload, and write errors raised (0.4.1) or
returned wrapped (0.7). ``AsyncCallsQueue.close`` (0.7 runs it from ``__del__``) never runs NVRx's
CUDA finalize here. Only interfaces both versions share are used otherwise.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import os
import queue as queue_lib
import signal
import threading
import time
from typing import Any

import torch
from nvidia_resiliency_ext.checkpointing.async_ckpt.core import (
    AsyncCallsQueue,
    AsyncRequest,
    PersistentAsyncCaller,
)
from torch import multiprocessing as mp

from fsdp_resilience.training.checkpointing import write_results
from fsdp_resilience.training.checkpointing.write_results import _RESULT, _WriteResultsChannel
from fsdp_resilience.training.contract import describe_process_exit
from fsdp_resilience.training.faults import descendants

log = logging.getLogger(__name__)


def writer_stall_bound(hang_timeout_s: float, write_timeout_s: float = 600.0) -> float:
    """How long a checkpoint writer with work may show no progress before it is killed and
    replaced: half the hang timeout (``RunConfig.hang_timeout_s``, the in-process Wrapper's soft
    timeout), at most ``write_timeout_s``.

    Why half: a save waiting on a stuck writer holds the training loop, and the soft timeout fires
    after ``hang_timeout_s`` without a step. The writer must be declared dead well before that, with
    the rest left for the finalize rounds that agree on it and for the step itself, so the save
    fails as a checkpoint fault (one ``CheckpointWriterError``, a fresh writer) rather than as a
    hang that restarts the process and meets the same stuck writer again."""
    return min(write_timeout_s, hang_timeout_s / 2)


class _WriterGone(Exception):
    """Internal: the local writer process died or stopped taking work."""


# --------------------------------------------------------------------------------------------
# In the writer process
# --------------------------------------------------------------------------------------------


def _set_parent_death_signal(parent_pid: int) -> None:
    """Linux: SIGKILL this process when its parent dies. The kernel ties this to the thread that
    forked or spawned us, so that must be a thread that lives as long as the process should."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    except OSError:
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _die_with_parent(parent_pid: int) -> None:
    """For the writer process: die with the trainer (the notes saw writers linger with parent
    PID 1), and leave Ctrl-C to the trainer, which decides how to shut us down."""
    _set_parent_death_signal(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _run_writer_loop(parent_pid: int | None, loop_kwargs: dict[str, Any]) -> None:
    """Entry point of the writer process."""
    if parent_pid is not None:
        _die_with_parent(parent_pid)
    # NVRx 0.4.1 forks one file writer per bucket and save. Each dies with this process, so a
    # killed writer never leaves one finishing a torn write.
    os.register_at_fork(after_in_child=functools.partial(_set_parent_death_signal, os.getpid()))
    torch.set_num_threads(1)  # the writer only copies and checksums: no intra-op threads to compete with training
    PersistentAsyncCaller.async_loop(**loop_kwargs)


def _writer_main(parent_pid: int | None, loop_kwargs: dict[str, Any]) -> None:
    """Entry point of the writer process: write results share NVRx's completion queue, which
    this process inherited at start (an ``mp.Queue`` cannot travel inside a request)."""
    write_results._results_out = loop_kwargs["comp_q"]
    _run_writer_loop(parent_pid, loop_kwargs)


def fork_is_safe() -> bool:
    """Whether this process may fork a writer: the main thread, no other Python thread, no
    process group (gloo and NCCL run threads of their own) and no CUDA context. A forked child
    gets only the forking thread; a lock another thread held at that moment stays held in it."""
    return (
        threading.current_thread() is threading.main_thread()
        and threading.active_count() == 1
        and not torch.distributed.is_initialized()
        and not torch.cuda.is_initialized()
    )


def _noop() -> None:
    """The ping a fresh writer runs to show it is up (0.4.1's worker needs an ``async_fn``)."""


# --------------------------------------------------------------------------------------------
# Watching a writer from the trainer
# --------------------------------------------------------------------------------------------


def _activity(pid: int) -> tuple[int, int, int]:
    """What a process tree has done so far: CPU ticks (its own and its reaped children's), bytes
    read and written (any file or pipe), and how many processes it has. Any change is progress."""
    pids = [pid, *descendants(pid)]
    ticks = io = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            ticks += sum(int(x) for x in fields[11:15])  # utime, stime, cutime, cstime
        except (OSError, ValueError, IndexError):
            continue
        try:
            with open(f"/proc/{p}/io") as f:
                io += sum(int(line.split()[1]) for line in f if line.startswith(("rchar", "wchar")))
        except (OSError, ValueError, IndexError):
            pass
    return ticks, io, len(pids)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _kill_tree(process: Any) -> list[int]:
    """SIGKILL a writer and everything below it (found before the kill: orphans are reparented),
    and wait until they are gone. SIGKILL ends a stopped process too. Returns the pids killed."""
    tree = [process.pid, *descendants(process.pid)]
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.join(10)
    deadline = time.monotonic() + 10
    while any(_running(p) for p in tree[1:]) and time.monotonic() < deadline:
        time.sleep(0.02)
    return tree


class _PersistentWriter(PersistentAsyncCaller):
    """NVRx's persistent checkpoint worker (one spawned process per rank) with bounded waits.

    Adds to the stock caller: an eager ``start`` with a parent-death signal; no wait on the staging
    handshake (the stock ``preload_q.join()`` waits forever on a dead worker, and our snapshot needs
    no staging); completion tracking by call index; stall detection (``stalled``); a ``close``
    that never blocks on a dead or stuck worker's queues.
    """

    def __init__(self, rank: int, stall_s: float = 600.0, results: _WriteResultsChannel | None = None):
        params = inspect.signature(PersistentAsyncCaller.__init__).parameters
        # 0.7 opens a CUDA context in the worker unless told host memory is all it will see. It
        # is: the snapshot is in host buffers on every device, so the writer never needs a GPU
        # (and never holds GPU memory a training rank could use).
        super().__init__(**({"cpu_shm_mode": True} if "cpu_shm_mode" in params else {}))
        self.rank = rank
        self.stall_s = stall_s
        self.completed_idx = -1
        self.results = results  # where the write results this writer sends are filed
        self._activity: tuple | None = None
        self._active_at = time.monotonic()  # when the activity last changed (or work arrived)
        self._sampled_at = 0.0

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.is_alive()

    def exit_description(self) -> str:
        """How the writer process ended (its exit code or the signal that killed it; SIGBUS means
        /dev/shm is full and reads as a storage error, ``describe_process_exit``)."""
        process = self.process
        return describe_process_exit(
            f"the checkpoint writer process (pid {self.pid})", process.exitcode if process is not None else None
        )

    #: The writer's nice value, set as soon as it exists (a spawned writer's boot, importing
    #: torch, then yields the CPU to training). NVRx 0.7's loop sets the same itself
    #: (``cpu_priority``, default 10), and warns when it finds it set already.
    NICE = 10

    def start(self, fork: bool = False) -> None:
        """Start the writer ourselves on every NVRx version: 0.7's own ``_start_worker`` starts a
        daemon (which may not fork file writers) with no parent-death signal, so a killed trainer
        would leave it running.

        ``fork``: fork it from this process (milliseconds: torch is imported already) instead of
        spawning a fresh interpreter (seconds of CPU). The caller vouches that this process has no
        process group, no CUDA context and no threads of its own yet (see ``fork_is_safe``)."""
        if self.process is not None:
            return
        # Tie the writer's life to ours only when started from the main thread (see _die_with_parent).
        parent = os.getpid() if threading.current_thread() is threading.main_thread() else None
        # Not a daemon: 0.4.1's writer forks its file writers, which daemons may not do.
        self.process = mp.get_context("fork" if fork else "spawn").Process(
            target=_writer_main, args=(parent, self._loop_kwargs()), name=f"ckpt-writer-{self.rank}", daemon=False
        )
        self.process.start()
        if "cpu_priority" not in inspect.signature(PersistentAsyncCaller.async_loop).parameters:
            try:
                os.setpriority(os.PRIO_PROCESS, self.process.pid, max(os.getpriority(os.PRIO_PROCESS, 0), self.NICE))
            except OSError as e:  # still correct at normal priority, only competing more
                log.debug("rank %d: could not lower the checkpoint writer's priority: %s", self.rank, e)
        self._work_arrived()

    def _loop_kwargs(self) -> dict[str, Any]:
        """``async_loop``'s arguments, bound by name (later versions add parameters in between)."""
        params = inspect.signature(PersistentAsyncCaller.async_loop).parameters
        known = {
            "rank": self.rank,
            "queue": self.queue,
            "preload_q": self.preload_q,
            "comp_q": self.comp_q,
            "shm_rel_q": getattr(self, "shm_rel_q", None),
            "log_level": logging.getLogger(PersistentAsyncCaller.__module__).getEffectiveLevel(),
            "cpu_shm_mode": getattr(self, "cpu_shm_mode", True),
        }
        missing = [n for n, p in params.items() if p.default is p.empty and n not in known]
        if missing:
            raise RuntimeError(f"unsupported nvidia-resiliency-ext: its writer loop needs {missing}")
        return {n: v for n, v in known.items() if n in params}

    def schedule_async_call(self, async_req: AsyncRequest) -> None:
        """Hand a request to the worker and return at once. The stock caller waits here for the
        worker's preload (a device-to-host stage): our snapshot already is a host copy that stays
        untouched until this save is finalized, so nothing needs that wait."""
        if async_req.async_fn is None:
            return
        if not self.alive:
            raise _WriterGone(f"{self.exit_description()}: not running")
        self.start_time = time.time()
        self._work_arrived()
        if async_req.preload_fn:
            self.preload_q.put(async_req.call_idx)  # the worker takes it before running the preload
        self.queue.put(async_req)

    def wait_completed(self, call_idx: int, timeout: float) -> bool:
        """Whether call ``call_idx`` (and so every earlier one: the worker runs them in order) has
        completed, waiting up to ``timeout`` seconds. Late completions of older calls are skipped."""
        deadline = time.monotonic() + timeout
        while self.completed_idx < call_idx:
            remaining = deadline - time.monotonic()
            try:
                item = self.comp_q.get(timeout=remaining) if remaining > 0 else self.comp_q.get_nowait()
            except queue_lib.Empty:
                return False
            self._work_arrived()  # a result or a finished call is progress
            if isinstance(item, tuple) and item and item[0] == _RESULT:
                # A save's result; its call index follows on the same queue.
                if self.results is not None:
                    self.results.file(item[1], item[2])
                continue
            self.completed_idx = max(self.completed_idx, int(item))
        return True

    # -- stall detection ------------------------------------------------------------------------
    def _work_arrived(self) -> None:
        """Restart the stall clock: an idle writer was not stuck, it had nothing to do."""
        self._active_at = time.monotonic()
        self._activity = None

    def idle_s(self) -> float:
        """Seconds since the writer (or a process it forked) last used CPU or moved a byte, or
        since it was last given work. Sampled from /proc at most every ``stall_s / 8``."""
        pid = self.pid
        now = time.monotonic()
        if pid is None or now - self._sampled_at < min(1.0, self.stall_s / 8):
            return now - self._active_at
        self._sampled_at = now
        sample = _activity(pid)
        if sample != self._activity:  # the first sample only sets the baseline: count from here
            self._active_at = now
            self._activity = sample
        return now - self._active_at

    def stalled(self) -> bool:
        """Whether the writer made no progress for ``stall_s``. Ask only while it has work."""
        return self.alive and self.idle_s() > self.stall_s

    def close(self, abort: bool = False, timeout: float = 30.0) -> None:
        """Stop the writer. ``abort``: SIGKILL it and its file writers now. Otherwise ask it to
        finish what it was given and exit, for up to ``timeout`` s, and kill it (and everything it
        forked) if it does not, or if it stalls meanwhile."""
        process = self.process
        if process is None:
            return
        if not abort and process.is_alive():
            try:
                self.queue.put("DONE")  # the stock shutdown: finish queued work, then exit
            except (OSError, ValueError):
                pass
            self._work_arrived()
            deadline = time.monotonic() + timeout
            while process.is_alive() and time.monotonic() < deadline and not self.stalled():
                process.join(0.1)
        self.process = None
        if process.is_alive():
            killed = _kill_tree(process)
            log.info(
                "rank %d: killed checkpoint writer %s and its %d file writer(s)",
                self.rank,
                process.pid,
                len(killed) - 1,
            )
        # A dead reader must not keep interpreter exit waiting on the queues' feeder threads.
        for q in (self.queue, self.preload_q):
            q.cancel_join_thread()
            q.close()


class _WriterQueue(AsyncCallsQueue):
    """NVRx's ``AsyncCallsQueue`` bound to a writer we start (and replace) ourselves; it assigns
    the call indices. Its own finalize path (CUDA-only, failure-blind) is not used."""

    def __init__(self, writer: _PersistentWriter):
        super().__init__(persistent=True)
        self.persistent_caller = writer

    def _get_async_caller(self) -> _PersistentWriter:
        return self.persistent_caller

    def close(self, abort: bool = False) -> None:
        """Forget the calls; never the stock close, whose finalize runs NVRx's CUDA collective
        (0.7 calls it from ``__del__``, i.e. whenever garbage collection gets to us). The writer
        process is ``AsyncCheckpointer``'s to stop."""
        self.async_calls.clear()
        self.persistent_caller = None

    def __del__(self) -> None:
        pass

    def forget_up_to(self, call_idx: int) -> None:
        """Drop requests the writer finished (never one it may still be reading)."""
        while self.async_calls and self.async_calls[0].idx <= call_idx:
            self.async_calls.popleft()


@dataclasses.dataclass
class _HelperProcesses:
    """What must be stopped even if ``close`` is never called (garbage collection, interpreter
    exit). No collectives here: this may run after the process group is gone."""

    writer: _PersistentWriter | None = None
    channel: _WriteResultsChannel | None = None

    def stop(self) -> None:
        writer, self.writer = self.writer, None
        channel, self.channel = self.channel, None
        if writer is not None:
            writer.close()
        if channel is not None:
            channel.close()
