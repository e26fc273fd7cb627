"""``AsyncCheckpointer``: asynchronous DCP checkpoints with NVRx's async writer, and the commit protocol.

What a save does (``AsyncCheckpointer.save``), on every rank of the process group:

1. settle: finish the previous save (a collective, see below) and agree that every rank's writer
   process is up and that all ranks save the same step;
2. snapshot: copy every tensor of the state dict into reused host buffers (``snapshot``). This
   memcpy is the only copy of the state a save makes;
3. plan with NVRx's ``save_state_dict_async_plan`` over the snapshot (never the live tensors) and
   hand the shard to the rank's writer process (``writer``; its job: ``write_job``). The plan is
   cached (NVRx's ``CheckpointMetadataCache``): once two saves planned the same, later saves skip
   the planning collectives and reuse the plan and DCP metadata. Whether the cache may be used is
   agreed by every rank in step 1 (each compares its state's ``structure_key`` with the one its
   cache was built for), so no rank skips a planning collective another rank runs; ``rebind``
   drops it;
4. return. The writer writes ``__<rank>_*.distcp`` into ``RunDir.checkpoint_dir(step)``, then the
   size and CRC32C of each file it wrote into ``.sums/`` and a digest of the model's bytes.

With ``save(..., overlap_snapshot=True)`` (the training loop's saves), step 2's copy runs in a copy
thread (CPU) or on the side stream (CUDA) while ``save`` returns, a cached plan (step 3) is made in
the background beside it, and the hand-off waits for ``wait_snapshot()``, which the loop calls
just before the next ``optimizer.step()``: the copy overlaps the next forward and backward, which
read the state but never write it.

Finalizing (``poll``/``wait``, and at the start of the next ``save``) is a collective (``rounds``):
only when every rank finished writing does rank 0 commit (``commit``); retention then runs in the
background on rank 0, never deleting the newest checkpoint this checkpointer knows verifies
(``trust``). A failure anywhere makes every rank raise ``CheckpointWriterError``; the step stays
torn (no marker) and is never loaded. A save whose model bytes equal the previous commit's while
the step advanced gets a ``checkpoint_stale`` event. Resuming: ``resume`` (verify, quarantine,
fall back).

Why not NVRx's stock finalize path (measured on CPU with 0.4.1, see ``NVRX-NOTES.md``): it syncs
on CUDA tensors, its blocking waits never notice a dead worker, and live CPU tensors passed through
its queue move into shared memory, so the writer writes parameters that training keeps changing.
Here the snapshot is an explicit copy; "all calls done" and the call-index check are one
all-reduce of small host tensors per short round (on a gloo group over the same ranks when
training runs on NCCL); NVRx's worker-side preload is dropped where the request carries its
buckets (0.4.1) and never waited for where it builds them (0.7); waits on the worker are bounded
and check that it is alive and making progress; each save's write results come back tagged with
the save's own number, over the writer's completion queue (no manager process).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import dataclasses
import functools
import logging
import os
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncRequest
from nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver import (
    CheckpointMetadataCache,
    save_state_dict_async_plan,
)

from fsdp_resilience.training.checkpointing.commit import Committer, remove_torn, write_empty_sums, write_sync_sums
from fsdp_resilience.training.checkpointing.resume import collective_device
from fsdp_resilience.training.checkpointing.rounds import (
    _DEAD,
    _DONE,
    _FAILED,
    CheckpointWriterError,
    CommitRounds,
    _failed_ranks,
    _PendingSave,
    _protocol_group,
)
from fsdp_resilience.training.checkpointing.save_stats import SaveStats
from fsdp_resilience.training.checkpointing.snapshot import (
    SnapshotBuffers,
    _cpu_safe_preload,
    _SnapshotWriter,
    structure_key,
)
from fsdp_resilience.training.checkpointing.write_job import write_then_checksum
from fsdp_resilience.training.checkpointing.write_results import _WriteResultsChannel
from fsdp_resilience.training.checkpointing.writer import (
    _HelperProcesses,
    _noop,
    _PersistentWriter,
    _WriterGone,
    _WriterQueue,
    fork_is_safe,
)
from fsdp_resilience.training.contract import COMMIT_MARKER, CheckpointCatalog, CheckpointInfo, Event, EventLog, RunDir

log = logging.getLogger(__name__)


def _no_progress() -> None:
    """``AsyncCheckpointer``'s progress callback when nothing watches progress."""


class AsyncCheckpointer(CommitRounds):
    """Asynchronous DCP checkpoints of one run, with the commit protocol of ``CheckpointCatalog``.

    Every method that takes part in the protocol (``save``, ``poll``, ``wait``, and ``close`` while
    a save is pending) is a collective over the bound process group: call it on every rank at the
    same point of the loop. ``abandon_pending``, ``rebind``, ``trust`` and ``writer_pids`` are local.

    Construct it early (before the model): it starts the writer process. Spawning one boots an
    interpreter that imports torch (seconds of CPU, competing with the trainer's own start);
    ``fork_writer=True`` forks it from this process instead, in milliseconds, when that is safe
    (``fork_is_safe``: build the checkpointer before any process group, store, CUDA context or
    thread; else it spawns). Writers that replace a dead one are always spawned. It can be built
    before the process group exists (pass ``rank`` and ``world_size``) and bound to a group later
    with ``rebind``, as an in-process restart does with each new group.

    ``writer_stall_s``: a writer with work that shows no progress this long is killed and replaced
    (see ``writer_stall_bound``; default ``write_timeout_s``). ``write_timeout_s`` bounds a whole
    write. ``async_save=False`` saves synchronously with ``torch.distributed.checkpoint.save``
    through the same commit protocol (a baseline for benchmarks, or where a writer cannot run).
    """

    def __init__(
        self,
        run_dir: str | os.PathLike | RunDir,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        process_group: dist.ProcessGroup | None = None,
        events: EventLog | None = None,
        keep: int = 3,
        async_save: bool = True,
        device: str | torch.device | None = None,
        thread_count: int = 1,
        write_timeout_s: float = 600.0,
        start_timeout_s: float = 180.0,
        writer_stall_s: float | None = None,
        fork_writer: bool = False,
    ):
        if keep < 1:
            raise ValueError(f"keep={keep} must be at least 1")
        self.layout = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
        self.catalog = CheckpointCatalog(self.layout)
        self.events = events
        self.async_save = async_save
        self.device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        self.thread_count = thread_count
        self.write_timeout_s = write_timeout_s
        self.start_timeout_s = start_timeout_s
        self.writer_stall_s = writer_stall_s if writer_stall_s is not None else write_timeout_s
        self.last_save: SaveStats | None = None

        self._group: dist.ProcessGroup | None = None
        self._progress: Callable[[], None] = _no_progress
        self._rank = rank if rank is not None else (dist.get_rank() if dist.is_initialized() else 0)
        self._world_size = (
            world_size if world_size is not None else (dist.get_world_size() if dist.is_initialized() else 1)
        )
        self._collective_device = torch.device("cpu")
        self._pending: _PendingSave | None = None
        #: ``overlap_snapshot``: (step, its plan, or the future of it) of a save whose snapshot copy
        #: may still run; handed to the writer by ``wait_snapshot``.
        self._unscheduled: tuple[int, Any] | None = None
        self._planner: concurrent.futures.ThreadPoolExecutor | None = None  # plans cached saves meanwhile
        self._committer = Committer(self.catalog, events, keep)
        self._closed = False

        self._buffers = SnapshotBuffers(pin_memory=self.device.type == "cuda")
        self._helpers = _HelperProcesses()
        self._reaper = weakref.finalize(self, _HelperProcesses.stop, self._helpers)
        # At interpreter exit (a trainer ending on an exception), multiprocessing's own exit hook
        # joins every non-daemon child, the writer included, which waits for work forever. atexit
        # runs hooks last-registered first, and multiprocessing registered its hook at import.
        atexit.register(self._reaper)
        self._calls: _WriterQueue | None = None
        self._handed_over: dict[Any, tuple] = {}  # what the current writer process holds (_SnapshotWriter)
        # NVRx's plan cache, valid for states of structure key self._plan_key (None: empty).
        self._plan_cache = CheckpointMetadataCache()
        self._plan_key: int | None = None
        if process_group is not None or dist.is_initialized():
            self.rebind(process_group)
        if async_save:
            self._helpers.channel = _WriteResultsChannel()
            self._start_writer(fork=fork_writer and fork_is_safe())

    # -- public -------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def pending_step(self) -> int | None:
        """The step being written, not yet committed (None when idle)."""
        if self._unscheduled is not None:
            return self._unscheduled[0]
        return self._pending.step if self._pending is not None else None

    @property
    def keep(self) -> int:
        """How many committed checkpoints retention keeps (besides the trusted one)."""
        return self._committer.keep

    @keep.setter
    def keep(self, keep: int) -> None:
        if keep < 1:
            raise ValueError(f"keep={keep} must be at least 1")
        self._committer.keep = keep

    @property
    def trusted_step(self) -> int | None:
        """The newest step this checkpointer knows verifies (``trust``, or its own last commit)."""
        return self._committer.trusted

    @property
    def plan_reusable(self) -> bool:
        """Whether the next save of a state with the structure of the last one reuses the cached
        plan (NVRx validates a plan once two saves planned alike). Local."""
        return bool(self._plan_cache.get_cache_metadata()[2])

    def writer_pids(self) -> list[int]:
        """PIDs of this rank's writer process(es): what a fault drill kills to crash a save."""
        writer = self._helpers.writer
        return [writer.pid] if writer is not None and writer.alive else []

    def helper_pids(self) -> list[int]:
        """Every process this checkpointer started on this rank: its writer (write results come
        back over the writer's own queue, so there is no other)."""
        return self.writer_pids()

    def trust(self, step: int) -> None:
        """Record that checkpoint ``step`` verified and was loaded (the resume point): retention
        never deletes it until this checkpointer commits a newer one. Local."""
        self._committer.trusted = step

    def rebind(
        self,
        process_group: dist.ProcessGroup | None = None,
        *,
        timeout_s: float | None = None,
        progress: Callable[[], None] | None = None,
    ) -> None:
        """Use ``process_group``'s ranks (None: the default group's) from now on, e.g. the new
        group of an in-process restart: the save protocol gets a gloo group of its own over them,
        with collective timeout ``timeout_s`` (a collective: every rank calls this at the same
        point). ``progress`` is called at each round of the blocking waits (settling before a
        save, waiting for the previous one's write): the in-process Wrapper's ``ping``, so a rank
        waiting on a slow write is not taken for a hung one. A save still pending on the old
        group is abandoned (stays torn); a writer process that died, or stalled with work, is
        replaced."""
        self._require_open()
        if self._pending is not None or self._unscheduled is not None:
            self.abandon_pending()
        if not dist.is_initialized():
            raise RuntimeError("rebind needs an initialized torch.distributed process group")
        group = process_group if process_group is not None else dist.group.WORLD
        self._drop_plan_cache()  # a plan made over another group (ranks may have moved) is not reused
        self._progress = progress if progress is not None else _no_progress
        self._group = _protocol_group(group, timeout_s)
        self._rank = dist.get_rank(group)
        self._world_size = dist.get_world_size(group)
        self._collective_device = collective_device(self._group)
        writer = self._helpers.writer
        if self.async_save and writer is not None and (not writer.alive or self._writer_stuck()):
            log.warning(
                "rank %d: checkpoint writer (pid %s) is %s; starting a new one",
                self._rank,
                writer.pid,
                "gone" if not writer.alive else f"stuck (no progress for {writer.idle_s():.0f}s)",
            )
            self._start_writer()

    def save(self, step: int, state: dict[str, Any], *, overlap_snapshot: bool = False) -> None:
        """Checkpoint ``state`` as ``step``. Returns once the state is snapshotted and handed to
        the writer (async) or written and committed (sync). Finishes the previous save first and
        raises ``CheckpointWriterError`` if that one failed (this step is then not started; the
        checkpointer is ready for another ``save``). A step that is already committed is skipped.

        ``overlap_snapshot=True`` (async only): return as soon as the snapshot copy has started
        and the save is planned; the copy runs on while the caller computes the next forward and
        backward, and the save is handed to the writer once it is done. The caller must call
        ``wait_snapshot()`` before it next writes any tensor of ``state`` (the training loop: just
        before ``optimizer.step()``); every other call of the protocol waits for it too.
        """
        self._require_open()
        self.wait_snapshot()
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict (see app_state), got {type(state).__name__}")
        began = time.monotonic()
        if self._pending is not None:
            self._finalize(blocking=True)
        path = self.layout.checkpoint_dir(step)
        already_committed = 0
        if self._rank == 0:
            already_committed = int((path / COMMIT_MARKER).is_file())
            if not already_committed:
                remove_torn(path)  # a leftover of an earlier attempt; before anyone writes there
        plan_key = structure_key(state) if self.async_save else None
        if not self._settle(step, already_committed, plan_key):
            log.warning("checkpoint %s is already committed; not saving it again", path.name)
            return
        settled = time.monotonic()
        if self.async_save:
            self._save_async(step, state, path, began, settled, overlap_snapshot)
        else:
            self._save_sync(step, state, path, began, settled)

    def poll(self) -> list[CheckpointInfo]:
        """Commit the pending save if every rank finished writing it; never waits for writers.
        Returns what was committed. Raises ``CheckpointWriterError`` if the save failed anywhere."""
        self._require_open()
        self.wait_snapshot()
        return self._finalize(blocking=False) if self._pending is not None else []

    def wait(self) -> list[CheckpointInfo]:
        """Wait for the pending save and commit it (or raise ``CheckpointWriterError``)."""
        self._require_open()
        self.wait_snapshot()
        return self._finalize(blocking=True) if self._pending is not None else []

    def pending_written(self) -> bool:
        """Whether this rank's writer finished the pending save's write (True when none is
        pending). Local: no collective, commits nothing; ``poll``/``wait`` do that."""
        if self._unscheduled is not None:
            return False  # still copying: the writer has not been handed it yet
        pending = self._pending
        if pending is None or pending.call_idx is None or pending.local_state is not None:
            return True
        return self._helpers.writer.wait_completed(pending.call_idx, 0.0) or not self._helpers.writer.alive

    def abandon_pending(self) -> int | None:
        """Drop the pending save without any collective (for when the process group is broken or
        replaced). Its folder stays torn: never committed, never loaded. Returns its step."""
        if self._unscheduled is not None:
            (step, planning), self._unscheduled = self._unscheduled, None  # never handed to the writer
            try:
                self._buffers.wait_copied()  # buffers are refilled only once no copy runs into them
                if isinstance(planning, concurrent.futures.Future):
                    planning.result()
            except Exception as e:  # noqa: BLE001 - the save is dropped anyway
                log.warning("rank %d: the abandoned save's snapshot copy or plan failed: %s", self._rank, e)
            # Its plan may have counted on its request handing the buffers to the writer.
            self._handed_over.clear()
            log.info("rank %d: abandoned checkpoint step %d (never handed to the writer)", self._rank, step)
            return step
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        # Its request stays in self._calls until the writer reports it done (see forget_up_to).
        log.info("rank %d: abandoned checkpoint step %d (left uncommitted)", self._rank, pending.step)
        return pending.step

    def unbind(self) -> int | None:
        """After a fault: abandon the pending save (``abandon_pending``) and drop the save
        protocol's group, whose connections the fault broke, so nothing holds it past the attempt
        (the next attempt's ``rebind`` makes a new one). Local. Returns the abandoned step."""
        step = self.abandon_pending()
        self._group = None
        self._progress = _no_progress
        return step

    def close(self, wait: bool = True) -> None:
        """Commit the pending save (``wait=True``: a collective) or abandon it, then stop the
        writer (and every process it forked). No process started here outlives this call."""
        if self._closed:
            return
        try:
            if self._unscheduled is not None:
                if wait:
                    self.wait_snapshot()
                else:
                    self.abandon_pending()
            if self._pending is not None:
                if wait:
                    self._finalize(blocking=True)
                else:
                    self.abandon_pending()
        finally:
            self._pending = None
            self._unscheduled = None
            self._closed = True
            try:
                self._buffers.close()
            except Exception as e:  # noqa: BLE001 - closing anyway
                log.warning("rank %d: a snapshot copy failed while closing: %s", self._rank, e)
            if self._planner is not None:
                self._planner.shutdown(wait=True)
            self._committer.join_retention()
            self._reaper()  # stops the helper processes (once)
            atexit.unregister(self._reaper)

    def __enter__(self) -> "AsyncCheckpointer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(wait=exc_type is None)

    # -- saving -------------------------------------------------------------------------------
    def _save_async(
        self, step: int, state: dict[str, Any], path: Path, began: float, settled: float, overlap: bool
    ) -> None:
        snapshot = self._buffers.snapshot(state, overlap=overlap)
        snapped = time.monotonic()
        results_queue = self._helpers.channel.new_queue()  # before planning: see _WriteResultsChannel
        plan = functools.partial(self._plan, step, path, snapshot, results_queue, began)
        # Planning reads the buffers' shapes and addresses, never their values, so it runs while
        # the copies into them may still be in flight. A cached plan (validated by two saves that
        # planned alike, and agreed by every rank in _settle) needs no collective: overlapped, it
        # is made in the background with the copy; otherwise here, on every rank at once.
        if overlap and self.plan_reusable:
            if self._planner is None:
                self._planner = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="save-plan")
            planning: Any = self._planner.submit(plan)
        else:
            planning = plan()
        self._unscheduled = (step, planning)
        plan_s = 0.0 if isinstance(planning, concurrent.futures.Future) else planning[2]
        copy_wait_s = 0.0 if overlap else self._hand_over()[0]
        returned = time.monotonic()
        # Overlapped, the event carries what the loop waited in save() itself; the rest of the
        # copy is waited for inside the next step, whose time shows it (goodput's interference).
        self._record(
            SaveStats(
                step,
                "async",
                returned - began,
                settled - began,
                snapped - settled + copy_wait_s,
                plan_s,
                returned - snapped - copy_wait_s - plan_s,
                self._buffers.nbytes,
                None if overlap else 0.0,
                isinstance(planning, concurrent.futures.Future),
            )
        )

    def _plan(
        self, step: int, path: Path, snapshot: Any, results_queue: Any, began: float
    ) -> tuple[_PendingSave, AsyncRequest | None, float]:
        """Plan the save of ``snapshot`` and build the writer's request (None: nothing to write on
        this rank); a collective unless the plan is cached. Returns them and the seconds planning took."""
        t0 = time.monotonic()
        writer = _SnapshotWriter(
            str(path),
            handed_over=self._handed_over,
            generation=self._buffers.generation,
            thread_count=self.thread_count,
        )
        # With the cache, NVRx skips the planning collectives once two saves planned alike; on
        # every rank at once (_settle agreed that the cache holds everywhere, and equal
        # structures plan alike on every rank).
        writer, metadata, dist_wrapper = save_state_dict_async_plan(
            snapshot, writer, process_group=self._group, enable_cache=True, metadata_cache=self._plan_cache
        )
        if writer.results_queue is not None:
            writer.results_queue = results_queue
        save_fn, preload_fn, save_args = writer.get_save_function_and_args()
        planned = time.monotonic()
        pending = _PendingSave(
            step, path, writer, metadata, dist_wrapper, call_idx=None, began=began, scheduled=planned
        )
        request = None
        if save_fn is None:  # nothing to write here, but the commit wants this rank's (empty) record
            try:
                write_empty_sums(path, self._rank)
            except OSError as e:
                pending.local_state, pending.error = _FAILED, f"{type(e).__name__}: {e}"
        else:
            job = writer.wrap_job(functools.partial(write_then_checksum, save_fn, str(path), self._rank))
            request = AsyncRequest(job, tuple(save_args), [], preload_fn=self._staging(preload_fn, save_args))
        return pending, request, planned - t0

    def wait_snapshot(self) -> float:
        """Wait until the pending save's snapshot copy (and, if it ran in the background, its
        planning) is done (``save(overlap_snapshot=True)``), then hand the save to the writer; from
        then on the saved state may change. Returns the seconds waited (0.0 when nothing was in
        flight). Local: no collective. A copy or plan that raised fails this rank's write (the
        save then fails on every rank at the next round)."""
        if self._unscheduled is None:
            return 0.0
        waited, plan_s = self._hand_over()
        last = self.last_save
        if last is not None and last.snapshot_wait_s is None and last.step == self._pending.step:
            self.last_save = dataclasses.replace(last, snapshot_wait_s=waited, plan_s=plan_s)
        return waited

    def _hand_over(self) -> tuple[float, float]:
        """Wait for the snapshot copy and the plan, then schedule the request on the writer;
        returns the seconds waited for them and the seconds planning took."""
        (step, planning), self._unscheduled = self._unscheduled, None
        began = time.perf_counter()
        error = None
        try:
            self._buffers.wait_copied()
        except Exception as e:  # noqa: BLE001 - becomes this rank's failed write
            error = f"snapshot copy: {type(e).__name__}: {e}"
        try:
            pending, request, plan_s = (
                planning.result() if isinstance(planning, concurrent.futures.Future) else planning
            )
        except Exception as e:  # noqa: BLE001 - the same
            error = error or f"planning: {type(e).__name__}: {e}"
            path = self.layout.checkpoint_dir(step)
            now = time.monotonic()
            pending, request, plan_s = _PendingSave(step, path, None, None, None, None, now, now), None, 0.0
        waited = time.perf_counter() - began
        self._pending = pending
        if error is not None:
            log.error("rank %d: checkpoint step %d failed before its write: %s", self._rank, step, error)
            pending.local_state, pending.error, request = _FAILED, error, None
            self._handed_over.clear()  # the request that would have handed the buffers over is dropped
        if request is not None:
            try:
                pending.call_idx = self._calls.schedule_async_request(request)
            except _WriterGone as e:
                # Every other rank goes on; the next finalize round makes them all fail this step.
                pending.call_idx = self._calls.call_idx
                pending.local_state, pending.error = _DEAD, str(e)
                self._start_writer()
        return waited, plan_s

    def _save_sync(self, step: int, state: dict[str, Any], path: Path, began: float, settled: float) -> None:
        # dcp.save returns on every rank only after the coordinator wrote .metadata, i.e. after
        # every rank's write finished. Then each rank checksums its own files (DCP names them by
        # the rank's index in the group) before rank 0 commits.
        dcp.save(state, checkpoint_id=str(path), process_group=self._group)
        written = time.monotonic()
        error = None
        try:
            write_sync_sums(path, self._rank, state)
        except OSError as e:
            error = f"{type(e).__name__}: {e}"
            log.error("rank %d: checksumming checkpoint %s failed: %s", self._rank, path.name, error)
        failed = _failed_ranks([_FAILED if s else _DONE for s in self._agree(int(error is not None))[0]])
        if failed:
            raise CheckpointWriterError(
                step,
                f"checksums failed on rank(s) {failed}"
                f"{f' (here: {error})' if error else ''}; {path.name} is left uncommitted",
                tuple(failed),
            )
        self._record(SaveStats(step, "sync", written - began, settled - began, 0.0, written - settled, 0.0, 0))
        self._commit(step, path, began, finish=None)

    def _staging(self, preload_fn: Callable | None, save_args: Any) -> Callable | None:
        """The worker-side staging step NVRx would run before the trainer may go on. Its job is the
        device-to-host copy our snapshot already made, so when the request carries the write
        buckets itself (0.4.1) it is dropped, and with it a round trip to the worker per save.
        When the preload builds the buckets (0.7) it stays; on CPU it never syncs CUDA."""
        if len(save_args) > 1 and save_args[1] is not None:
            return None
        return preload_fn if self.device.type == "cuda" else _cpu_safe_preload(preload_fn)

    def _record(self, stats: SaveStats) -> None:
        self.last_save = stats
        if self._rank == 0 and self.events is not None:
            self.events.emit(
                Event.CHECKPOINT_BEGIN,
                step=stats.step,
                blocking_s=round(stats.blocking_s, 4),
                mode=stats.mode,
                snapshot_s=round(stats.snapshot_s, 4),
            )

    # -- helpers ------------------------------------------------------------------------------
    def _start_writer(self, fork: bool = False) -> None:
        """Start (or replace: the old one is killed with every process it forked) this rank's
        writer and send it a ping; does not wait for it to boot. ``fork``: see ``__init__``."""
        old = self._helpers.writer
        if old is not None:
            old.close(abort=True)
        writer = _PersistentWriter(self._rank, stall_s=self.writer_stall_s, results=self._helpers.channel)
        writer.start(fork=fork)
        self._handed_over.clear()  # a new process holds no buffers yet
        self._helpers.writer = writer
        if self._calls is None:
            self._calls = _WriterQueue(writer)
        else:
            self._calls.persistent_caller = writer
            self._calls.async_calls.clear()
        self._calls.schedule_async_request(AsyncRequest(_noop, (), []))

    def _drop_plan_cache(self) -> None:
        self._plan_cache = CheckpointMetadataCache()
        self._plan_key = None

    def _require_open(self) -> None:
        if self._closed:
            raise RuntimeError("this AsyncCheckpointer is closed")
