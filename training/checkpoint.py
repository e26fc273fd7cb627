"""Asynchronous DCP checkpoints with NVRx's async writer, a commit protocol, and resume.

What a save does (``AsyncCheckpointer.save``), on every rank of the process group:

1. settle: finish the previous save (a collective, see below) and agree that every rank's writer
   process is up and that all ranks save the same step;
2. snapshot: copy every tensor of the state dict into host buffers allocated on the first save and
   reused afterwards (pinned on CUDA, plain shared memory on CPU); non-tensor values are deep-copied.
   On CUDA the copies run on a side stream that the next step's parameter writes wait for. This
   memcpy is the only copy of the state a save makes;
3. plan with NVRx's ``save_state_dict_async_plan`` over the snapshot (never the live tensors) and
   hand the shard to NVRx's persistent writer process through ``AsyncCallsQueue`` (on NVRx 0.7 the
   buffers themselves are handed over once per writer process, see ``_SnapshotWriter``);
4. return. The writer writes ``__<rank>_*.distcp`` into ``RunDir.checkpoint_dir(step)``.

Finalizing (``poll``/``wait``, and at the start of the next ``save``) is a collective: every rank
reports whether its write finished, failed, or its writer process died; only when every rank
finished does rank 0 write DCP's ``.metadata`` and then ``CheckpointCatalog.commit`` (marker +
``latest``); retention then runs in the background on rank 0. A failed write or a dead writer makes
every rank raise ``CheckpointWriterError``; the step stays torn (no marker) and is never loaded.
``load_latest`` loads the newest committed checkpoint.

Why not NVRx's stock finalize path: measured on CPU with nvidia-resiliency-ext 0.4.1 (see
``NVRX-NOTES.md``) it syncs on CUDA tensors (``sync_all_async_calls``, the call-index check in
``execute_finalize_fns``, ``preload_tensors``), its blocking waits never notice a dead worker, and
passing live CPU tensors through the queue moves them into shared memory so the writer writes
parameters that training keeps changing. Here:

- the snapshot is an explicit copy taken in the trainer before ``save`` returns;
- the "all calls done" decision and the call-index check are one all-reduce of small tensors over
  the protocol's process group (the training group on gloo; a gloo group over the same ranks when
  training runs on NCCL, so no round touches the GPU), done in short rounds so a slow writer never
  holds a collective open longer than a round;
- the worker-side preload (a device-to-host stage the snapshot already did) is dropped when the
  request carries the write buckets itself (0.4.1); where it builds them (0.7) it is kept but never
  waited for, and on CPU it runs with ``non_blocking=False`` (no ``torch.cuda.synchronize``);
- waits on the worker are bounded and check that its process is alive; completions are matched by
  call index; each save gets its own write-results queue, so nothing from an abandoned save can be
  mistaken for a later one.

NVRx versions: tested on 0.4.1 and 0.7.0 (``make test-nvrx07``), with feature detection where they
differ: ``cpu_shm_mode`` (0.7's writer opens no CUDA context with it), the writer loop's arguments
(we spawn the writer ourselves on both, with a parent-death signal), whether the save request carries
its write buckets, the ``non_blocking`` parameter of the preload, and write errors raised (0.4.1) or
returned wrapped (0.7). ``AsyncCallsQueue.close`` (0.7 runs it from ``__del__``) never runs NVRx's
CUDA finalize here. Only interfaces both versions share are used otherwise.
"""

from __future__ import annotations

import copy
import ctypes
import dataclasses
import functools
import inspect
import logging
import multiprocessing.managers
import os
import queue as queue_lib
import shutil
import signal
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from nvidia_resiliency_ext.checkpointing.async_ckpt import filesystem_async as nvrx_filesystem
from nvidia_resiliency_ext.checkpointing.async_ckpt.core import (
    AsyncCallsQueue,
    AsyncRequest,
    PersistentAsyncCaller,
)
from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import FileSystemWriterAsync
from torch.distributed.checkpoint.planner import WriteItemType
from nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver import save_state_dict_async_plan
from torch import multiprocessing as mp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from training.contract import COMMIT_MARKER, CheckpointCatalog, CheckpointInfo, Event, EventLog, RunDir

try:  # a dependency of NVRx 0.4.1's writer; optional in later versions
    import psutil
except ImportError:  # pragma: no cover
    psutil = None

log = logging.getLogger(__name__)

__all__ = [
    "AsyncCheckpointer",
    "CheckpointWriterError",
    "SaveStats",
    "SnapshotBuffers",
    "app_state",
    "choose_checkpoint",
    "load_checkpoint",
    "load_latest",
    "restore_app_state",
]

#: How long one finalize round waits locally before the ranks compare notes (seconds). Short, so
#: a rank that finished early never sits in a collective for long (gloo timeouts can be seconds).
_ROUND_S = 0.05

# Per-rank states exchanged in a finalize / settle round. Larger is worse: any rank's FAILED or
# DEAD fails the save everywhere.
_DONE, _BUSY, _FAILED, _DEAD = 0, 1, 2, 3
_STATE_NAMES = {_DONE: "done", _BUSY: "busy", _FAILED: "write failed", _DEAD: "writer process died"}


class CheckpointWriterError(RuntimeError):
    """A checkpoint save failed on at least one rank (its writer process died, hung, or the write
    raised). Raised on every rank at the same point; the step is left uncommitted (torn) and the
    checkpointer is ready for the next save (a dead writer has already been replaced)."""

    def __init__(self, step: int, message: str, failed_ranks: tuple[int, ...] = ()):
        # args mirror the signature: restart layers copy and pickle exceptions as cls(*args).
        super().__init__(step, message, tuple(failed_ranks))
        self.step = step
        self.message = message
        self.failed_ranks = tuple(failed_ranks)

    def __str__(self) -> str:
        return f"checkpoint step {self.step} failed: {self.message}"


class _WriterGone(Exception):
    """Internal: the local writer process died or stopped taking work."""


# --------------------------------------------------------------------------------------------
# The state the training loop saves
# --------------------------------------------------------------------------------------------


def app_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, trainer: dict[str, Any]) -> dict[str, Any]:
    """The checkpointed state: ``{"model", "optim", "trainer"}``. Model and optimizer come from
    DCP's ``get_state_dict`` (DTensor shards under FSDP2, keyed by parameter FQN, so a checkpoint
    reshards to any world size). ``trainer`` holds plain values and small tensors (step, sampler
    position, RNG state). DCP treats a plain tensor or value as replicated and stores one copy, so
    anything that differs per rank belongs under a per-rank key."""
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state, "trainer": trainer}


def restore_app_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> dict[str, Any]:
    """Apply a loaded ``app_state`` to the model and optimizer; returns the trainer values."""
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return state["trainer"]


# --------------------------------------------------------------------------------------------
# Snapshot into reused host buffers
# --------------------------------------------------------------------------------------------


def _pin(buffer: torch.Tensor) -> None:
    """Page-lock an existing (shared-memory) host buffer so D2H copies into it are DMA."""
    try:
        from torch.cuda import _pin_memory_utils  # torch>=2.5; the same call DCP's stager uses

        nbytes = buffer.numel() * buffer.element_size()
        _pin_memory_utils.pin_memory(buffer.data_ptr(), nbytes)
        weakref.finalize(buffer, _pin_memory_utils.unpin_memory, buffer.data_ptr())
    except Exception as e:  # still correct unpinned, only slower
        log.warning("could not pin a %s checkpoint buffer (%s); copies into it will be pageable",
                    tuple(buffer.shape), e)


class SnapshotBuffers:
    """Host copies of a state dict's tensors, allocated by the first snapshot and reused by every
    later one (so a save costs a memcpy, not an allocation).

    Buffers live in shared memory: the writer process maps them instead of receiving a copy. One
    buffer per tensor, exactly sized, so NVRx never sees a view it would clone. On CUDA they are
    also pinned. A buffer is reused only after the save that used it finished or was abandoned;
    ``AsyncCheckpointer`` keeps at most one save in flight for that reason.
    """

    def __init__(self, pin_memory: bool = False):
        self.pin_memory = pin_memory
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}
        self._stream = None  # CUDA: the side stream the device-to-host copies run on
        self._copied = None  # CUDA: an event recorded after the last snapshot's copies

    @property
    def buffers(self) -> list[torch.Tensor]:
        return list(self._buffers.values())

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    @torch.no_grad()
    def snapshot(self, state: Any) -> Any:
        """A copy of ``state`` with the same structure: tensors (DTensor shards included) copied
        into the buffers, other values deep-copied.

        On CUDA the device-to-host copies run on a side stream, after the work already queued on
        the current stream (the optimizer step that wrote the parameters), and the current stream
        waits for them, so the next step cannot write a parameter before its copy is taken. They
        may still be in flight when this returns: call ``wait_copied`` before the host reads the
        buffers (the caller plans the save meanwhile)."""
        if not self.pin_memory:
            return self._copy(state, ())
        current = torch.cuda.current_stream()
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            copied = self._copy(state, ())
            self._copied = torch.cuda.Event()
            self._copied.record(self._stream)
        current.wait_stream(self._stream)
        return copied

    def wait_copied(self) -> None:
        """Block the host until the last snapshot's copies have landed (a no-op on CPU)."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None

    def _copy(self, obj: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(obj, DTensor):
            local = self._copy_tensor(obj.to_local(), path)
            # Same sharding spec, local shard in the host buffer: what DCP plans and writes. (The
            # public from_local would move the shard back to the mesh's device.)
            return DTensor(local, obj._spec, requires_grad=False)
        if isinstance(obj, torch.Tensor):
            return self._copy_tensor(obj.detach(), path)
        if isinstance(obj, Mapping):
            return {k: self._copy(v, path + (k,)) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            items = [self._copy(v, path + (i,)) for i, v in enumerate(obj)]
            return items if isinstance(obj, list) else type(obj)(items)
        return copy.deepcopy(obj)  # ints, floats, strings: frozen now, not when the writer runs

    def _copy_tensor(self, src: torch.Tensor, path: tuple[Any, ...]) -> torch.Tensor:
        buffer = self._buffers.get(path)
        if buffer is None or buffer.shape != src.shape or buffer.dtype != src.dtype:
            buffer = torch.empty(src.shape, dtype=src.dtype)
            if buffer.numel() > 0:
                buffer.share_memory_()
                if self.pin_memory:
                    _pin(buffer)
            self._buffers[path] = buffer
        buffer.copy_(src, non_blocking=self.pin_memory and src.is_cuda)
        return buffer


# --------------------------------------------------------------------------------------------
# NVRx's persistent writer process, hardened
# --------------------------------------------------------------------------------------------


def _die_with_parent(parent_pid: int) -> None:
    """Linux: SIGKILL this process when its parent dies, so no writer or manager outlives a killed
    trainer (the notes saw them linger with parent PID 1). The kernel ties this to the thread that
    spawned us, so spawn only from a thread that lives as long as the process should."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    except OSError:
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)
    # Ctrl-C goes to the whole foreground process group; the trainer decides how to shut us down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _run_writer_loop(parent_pid: int | None, loop_kwargs: dict[str, Any]) -> None:
    """Entry point of the writer process on NVRx versions that let us start it (0.4.1)."""
    if parent_pid is not None:
        _die_with_parent(parent_pid)
    PersistentAsyncCaller.async_loop(**loop_kwargs)


def _kill_children(pid: int) -> None:
    if psutil is None:
        return
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return
    for child in children:
        try:
            child.kill()
        except psutil.Error:
            pass


def _noop() -> None:
    """The ping a fresh writer runs to show it is up (0.4.1's worker needs an ``async_fn``)."""


def _cpu_safe_preload(preload_fn: Callable | None) -> Callable | None:
    """NVRx's preload with ``non_blocking=False``: the same staging (a no-op for our host
    snapshot) without 0.4.1's unconditional ``torch.cuda.synchronize()``. Kept as is when its shape
    is not the one both 0.4.1 and 0.7 use (0.7's preload only syncs for CUDA tensors anyway)."""
    if not isinstance(preload_fn, functools.partial):
        return preload_fn
    try:
        params = list(inspect.signature(preload_fn.func).parameters)
    except (TypeError, ValueError):
        return preload_fn
    if "non_blocking" not in params:
        return preload_fn
    position = params.index("non_blocking")
    args = preload_fn.args
    if len(args) > position:
        args = args[:position] + (False,) + args[position + 1:]
        return functools.partial(preload_fn.func, *args, **preload_fn.keywords)
    return functools.partial(preload_fn.func, *args, **{**preload_fn.keywords, "non_blocking": False})


#: NVRx 0.7 builds the write buckets in the writer process: ``preload_tensors`` takes
#: ``(checkpoint_dir, (identifier, data))``. 0.4.1 builds them in the trainer.
_BUCKETS_IN_WRITER = hasattr(nvrx_filesystem, "ConsistentDataIdentifier")


class _SnapshotWriter(FileSystemWriterAsync):
    """NVRx's async file writer over our snapshot buffers: one copy of the state per save.

    On NVRx 0.7 the stock ``prepare_write_data`` clones every CPU tensor (a second copy of the
    state in private memory), and sending the clones to the writer moves each into fresh shared
    memory (a third): an 8b save on 2x8 GPUs would need about twice its size in ``/dev/shm``. Our
    snapshot already is a stable copy in shared memory, reused by every save and left untouched
    until the save that read it is finalized. So here the buffers are handed to the writer as they
    are, and only once per writer process: the writer keeps them under NVRx's plan-shape key
    (``ConsistentDataIdentifier``) and later saves send no tensor at all, only the plan.

    ``handed_over`` maps a plan key to the buffers' storage addresses the current writer process
    holds; ``AsyncCheckpointer`` clears it whenever it starts a writer. 0.4.1 clones nothing (it
    builds the buckets here, and the buffers pickle as shared memory), so it keeps the stock path.
    """

    def __init__(self, path: str, *, handed_over: dict[str, tuple], **kwargs: Any):
        super().__init__(path, **kwargs)
        self.handed_over = handed_over

    def prepare_write_data(self, plan, planner) -> None:
        if not _BUCKETS_IN_WRITER:
            return super().prepare_write_data(plan, planner)
        tensor_items = [item for item in plan.items if item.type != WriteItemType.BYTE_IO]
        byte_items = [item for item in plan.items if item.type == WriteItemType.BYTE_IO]
        tensors = [planner.resolve_data(item).detach() for item in tensor_items]
        not_shared = [item.index.fqn for item, t in zip(tensor_items, tensors) if t.numel() and not t.is_shared()]
        if not_shared:  # only our snapshot may be handed over uncopied
            raise RuntimeError(f"_SnapshotWriter writes snapshot buffers only; not in shared memory: {not_shared[:3]}")
        self.consistent_data_identifier = None
        self.cached_tensor_data = None
        if tensor_items:
            key = nvrx_filesystem._compute_data_structure_key_from_plan(tensor_items)
            storages = tuple((t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)) for t in tensors)
            self.consistent_data_identifier = nvrx_filesystem.ConsistentDataIdentifier(key)
            if self.handed_over.get(key) != storages:
                self.cached_tensor_data = (tensor_items, tensors)
                self.handed_over[key] = storages
        self.uncached_tensor_data = None
        self.byte_io_data = (byte_items, [planner.resolve_data(item) for item in byte_items]) if byte_items else None
        self.storage_plan = plan.storage_data
        self.has_data_to_write = len(plan.items) > 0
        self.results_queue = nvrx_filesystem.get_write_results_queue() if self.has_data_to_write else None


class _PersistentWriter(PersistentAsyncCaller):
    """NVRx's persistent checkpoint worker (one spawned process per rank) with bounded waits.

    Adds to the stock caller: an eager ``start`` with a parent-death signal; no wait on the staging
    handshake (the stock ``preload_q.join()`` waits forever on a dead worker, and our snapshot needs
    no staging); completion tracking by call index; a ``close`` that never blocks on a dead
    worker's queues.
    """

    def __init__(self, rank: int):
        params = inspect.signature(PersistentAsyncCaller.__init__).parameters
        # 0.7 opens a CUDA context in the worker unless told host memory is all it will see. It
        # is: the snapshot is in host buffers on every device, so the writer never needs a GPU
        # (and never holds GPU memory a training rank could use).
        super().__init__(**({"cpu_shm_mode": True} if "cpu_shm_mode" in params else {}))
        self.rank = rank
        self.completed_idx = -1

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.is_alive()

    def start(self) -> None:
        """Spawn the writer ourselves on every NVRx version: 0.7's own ``_start_worker`` starts a
        daemon (which may not fork file writers) with no parent-death signal, so a killed trainer
        would leave it running."""
        if self.process is not None:
            return
        # Tie the writer's life to ours only when spawned from the main thread (see _die_with_parent).
        parent = os.getpid() if threading.current_thread() is threading.main_thread() else None
        # Not a daemon: 0.4.1's writer forks its file writers, which daemons may not do.
        self.process = mp.get_context("spawn").Process(
            target=_run_writer_loop, args=(parent, self._loop_kwargs()), name=f"ckpt-writer-{self.rank}", daemon=False)
        self.process.start()

    def _loop_kwargs(self) -> dict[str, Any]:
        """``async_loop``'s arguments, bound by name (later versions add parameters in between)."""
        params = inspect.signature(PersistentAsyncCaller.async_loop).parameters
        known = {"rank": self.rank, "queue": self.queue, "preload_q": self.preload_q, "comp_q": self.comp_q,
                 "shm_rel_q": getattr(self, "shm_rel_q", None),
                 "log_level": logging.getLogger(PersistentAsyncCaller.__module__).getEffectiveLevel(),
                 "cpu_shm_mode": getattr(self, "cpu_shm_mode", True)}
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
            raise _WriterGone(f"the checkpoint writer (pid {self.pid}) is not running")
        self.start_time = time.time()
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
                idx = self.comp_q.get(timeout=remaining) if remaining > 0 else self.comp_q.get_nowait()
            except queue_lib.Empty:
                return False
            self.completed_idx = max(self.completed_idx, int(idx))
        return True

    def close(self, abort: bool = False, timeout: float = 30.0) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        if not abort and process.is_alive():
            try:
                self.queue.put("DONE")  # the stock shutdown: finish queued work, then exit
            except (OSError, ValueError):
                pass
            process.join(timeout)
        if process.is_alive():
            _kill_children(process.pid)  # 0.4.1's forked file writers would finish a torn write
            process.terminate()
            process.join(5)
        if process.is_alive():
            process.kill()
            process.join(5)
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
        """Drop requests the writer finished. Not earlier: a request holds the only trainer-side
        reference to its write-results queue, and the manager deletes a queue whose last reference
        goes before the writer has unpickled it (the writer then dies on a KeyError)."""
        while self.async_calls and self.async_calls[0].idx <= call_idx:
            self.async_calls.popleft()


class _WriteResultsChannel:
    """The manager process whose queues carry write results from the writer back to the trainer.

    NVRx spawns such a manager on first use and never stops it; owning it lets ``close`` stop it
    and lets every save have its own queue (an abandoned save's late result lands in its own queue,
    never in a newer save's). It starts in the background (booting an interpreter takes seconds)
    from a thread that lives as long as the manager: PDEATHSIG fires when the *thread* that
    spawned a process exits.
    """

    def __init__(self) -> None:
        self._manager = multiprocessing.managers.SyncManager(ctx=mp.get_context("spawn"))
        self._up = threading.Event()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._installed: Any = None
        self._thread = threading.Thread(target=self._serve, name="ckpt-results-manager", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            self._manager.start(initializer=_die_with_parent, initargs=(os.getpid(),))
        except BaseException as e:  # reported to the trainer by check()
            self._error = e
            return
        finally:
            self._up.set()
        self._stop.wait()
        try:
            self._manager.shutdown()
        except Exception as e:  # already gone
            log.debug("write-results manager shutdown: %s", e)

    @property
    def ready(self) -> bool:
        return self._up.is_set()

    @property
    def pid(self) -> int | None:
        process = getattr(self._manager, "_process", None)
        return process.pid if process is not None else None

    @property
    def error(self) -> str | None:
        """Why the manager did not start, once that is known."""
        return f"the checkpoint write-results manager did not start: {self._error}" if self._error else None

    def check(self) -> None:
        if self.error:
            raise RuntimeError(self.error)

    def new_queue(self) -> Any:
        self._up.wait()
        self.check()
        if self._installed is None and getattr(nvrx_filesystem, "_results_queue", "missing") is None:
            # Serve NVRx's module-wide default from our manager, so it never starts one of its own.
            self._installed = nvrx_filesystem._results_queue = self._manager.Queue()
        return self._manager.Queue()

    def close(self, timeout: float = 30.0) -> None:
        if self._installed is not None and getattr(nvrx_filesystem, "_results_queue", None) is self._installed:
            nvrx_filesystem._results_queue = None
        self._installed = None
        self._stop.set()
        self._thread.join(timeout)


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


# --------------------------------------------------------------------------------------------
# The checkpointer
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SaveStats:
    """Where the time of one ``save`` went (seconds); ``blocking_s`` is what the caller waited."""

    step: int
    mode: str  # "async" | "sync"
    blocking_s: float
    settle_s: float  # finishing the previous save + agreeing the writers are ready
    snapshot_s: float  # memcpy into the reused buffers (async only)
    plan_s: float  # DCP planning (a collective) + NVRx write preparation
    schedule_s: float  # handing the shard to the writer process
    snapshot_bytes: int


@dataclasses.dataclass
class _PendingSave:
    step: int
    path: Path
    writer: FileSystemWriterAsync
    metadata: Any
    dist_wrapper: Any
    call_idx: int | None  # None: nothing to write on this rank
    began: float  # time.monotonic() when save() was entered
    scheduled: float
    local_state: int | None = None  # sticky once DONE / FAILED / DEAD
    write_results: list | None = None
    error: str = ""


class AsyncCheckpointer:
    """Asynchronous DCP checkpoints of one run, with the commit protocol of ``CheckpointCatalog``.

    Every method that takes part in the protocol (``save``, ``poll``, ``wait``, and ``close`` while
    a save is pending) is a collective over the bound process group: call it on every rank at the
    same point of the loop. ``abandon_pending``, ``rebind`` and ``writer_pids`` are local.

    Construct it early (before the model): it starts the writer process, which takes seconds. It
    can be built before the process group exists (pass ``rank`` and ``world_size``) and bound to a
    group later with ``rebind``, as an in-process restart does with each new group.

    ``async_save=False`` saves synchronously with ``torch.distributed.checkpoint.save`` through the
    same commit protocol (a baseline for benchmarks, or for hosts where a writer process cannot run).
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
    ):
        if keep < 1:
            raise ValueError(f"keep={keep} must be at least 1")
        self.layout = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
        self.catalog = CheckpointCatalog(self.layout)
        self.events = events
        self.keep = keep
        self.async_save = async_save
        self.device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        self.thread_count = thread_count
        self.write_timeout_s = write_timeout_s
        self.start_timeout_s = start_timeout_s
        self.last_save: SaveStats | None = None

        self._group: dist.ProcessGroup | None = None
        self._rank = rank if rank is not None else (dist.get_rank() if dist.is_initialized() else 0)
        self._world_size = world_size if world_size is not None else (
            dist.get_world_size() if dist.is_initialized() else 1)
        self._collective_device = torch.device("cpu")
        self._pending: _PendingSave | None = None
        self._retention: threading.Thread | None = None
        self._closed = False

        self._buffers = SnapshotBuffers(pin_memory=self.device.type == "cuda")
        self._helpers = _HelperProcesses()
        self._reaper = weakref.finalize(self, _HelperProcesses.stop, self._helpers)
        self._calls: _WriterQueue | None = None
        self._handed_over: dict[str, tuple] = {}  # what the current writer process holds (_SnapshotWriter)
        if process_group is not None or dist.is_initialized():
            self.rebind(process_group)
        if async_save:
            self._start_writer()
            self._helpers.channel = _WriteResultsChannel()

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
        return self._pending.step if self._pending is not None else None

    def writer_pids(self) -> list[int]:
        """PIDs of this rank's writer process(es): what a fault drill kills to crash a save."""
        writer = self._helpers.writer
        return [writer.pid] if writer is not None and writer.alive else []

    def helper_pids(self) -> list[int]:
        """Every process this checkpointer started on this rank (writer and results manager)."""
        pids = self.writer_pids()
        channel = self._helpers.channel
        if channel is not None and channel.pid is not None:
            pids.append(channel.pid)
        return pids

    def rebind(self, process_group: dist.ProcessGroup | None = None) -> None:
        """Use ``process_group`` (None: the default group) from now on, e.g. the new group of an
        in-process restart. A save still pending on the old group is abandoned (stays torn); a
        writer process that died is replaced. Local: no collective."""
        self._require_open()
        if self._pending is not None:
            self.abandon_pending()
        if not dist.is_initialized():
            raise RuntimeError("rebind needs an initialized torch.distributed process group")
        group = process_group if process_group is not None else dist.group.WORLD
        self._group = _protocol_group(group)
        self._rank = dist.get_rank(group)
        self._world_size = dist.get_world_size(group)
        self._collective_device = _collective_device(self._group)
        if self.async_save and self._helpers.writer is not None and not self._helpers.writer.alive:
            log.warning("rank %d: checkpoint writer (pid %s) is gone; starting a new one",
                        self._rank, self._helpers.writer.pid)
            self._start_writer()

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Checkpoint ``state`` as ``step``. Returns once the state is snapshotted and handed to
        the writer (async) or written and committed (sync). Finishes the previous save first and
        raises ``CheckpointWriterError`` if that one failed (this step is then not started; the
        checkpointer is ready for another ``save``). A step that is already committed is skipped.
        """
        self._require_open()
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
                _remove_torn(path)  # a leftover of an earlier attempt; before anyone writes there
        if not self._settle(step, already_committed):
            log.warning("checkpoint %s is already committed; not saving it again", path.name)
            return
        settled = time.monotonic()
        if self.async_save:
            self._save_async(step, state, path, began, settled)
        else:
            self._save_sync(step, state, path, began, settled)

    def poll(self) -> list[CheckpointInfo]:
        """Commit the pending save if every rank finished writing it; never waits for writers.
        Returns what was committed. Raises ``CheckpointWriterError`` if the save failed anywhere."""
        self._require_open()
        return self._finalize(blocking=False) if self._pending is not None else []

    def wait(self) -> list[CheckpointInfo]:
        """Wait for the pending save and commit it (or raise ``CheckpointWriterError``)."""
        self._require_open()
        return self._finalize(blocking=True) if self._pending is not None else []

    def abandon_pending(self) -> int | None:
        """Drop the pending save without any collective (for when the process group is broken or
        replaced). Its folder stays torn: never committed, never loaded. Returns its step."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        # Its request stays in self._calls until the writer reports it done (see forget_up_to).
        log.info("rank %d: abandoned checkpoint step %d (left uncommitted)", self._rank, pending.step)
        return pending.step

    def close(self, wait: bool = True) -> None:
        """Commit the pending save (``wait=True``: a collective) or abandon it, then stop the
        writer and the results manager. No process started here outlives this call."""
        if self._closed:
            return
        try:
            if self._pending is not None:
                if wait:
                    self._finalize(blocking=True)
                else:
                    self.abandon_pending()
        finally:
            self._pending = None
            self._closed = True
            self._join_retention()
            self._reaper()  # stops the helper processes (once)

    def __enter__(self) -> "AsyncCheckpointer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(wait=exc_type is None)

    # -- saving -------------------------------------------------------------------------------
    def _save_async(self, step: int, state: dict[str, Any], path: Path, began: float, settled: float) -> None:
        snapshot = self._buffers.snapshot(state)
        snapped = time.monotonic()
        results_queue = self._helpers.channel.new_queue()  # before planning: see _WriteResultsChannel
        writer = _SnapshotWriter(str(path), handed_over=self._handed_over, thread_count=self.thread_count)
        writer, metadata, dist_wrapper = save_state_dict_async_plan(snapshot, writer, process_group=self._group)
        if writer.results_queue is not None:
            writer.results_queue = results_queue
        save_fn, preload_fn, save_args = writer.get_save_function_and_args()
        self._buffers.wait_copied()  # CUDA: the D2H copies ran while we planned; the writer reads them next
        planned = time.monotonic()
        pending = _PendingSave(step, path, writer, metadata, dist_wrapper, call_idx=None, began=began,
                               scheduled=planned)
        if save_fn is not None:
            request = AsyncRequest(save_fn, tuple(save_args), [], preload_fn=self._staging(preload_fn, save_args))
            try:
                pending.call_idx = self._calls.schedule_async_request(request)
            except _WriterGone as e:
                # Every other rank goes on; the next finalize round makes them all fail this step.
                pending.call_idx = self._calls.call_idx
                pending.local_state, pending.error = _DEAD, str(e)
                self._start_writer()
        self._pending = pending
        scheduled = time.monotonic()
        self._record(SaveStats(step, "async", scheduled - began, settled - began, snapped - settled,
                               planned - snapped, scheduled - planned, self._buffers.nbytes))

    def _save_sync(self, step: int, state: dict[str, Any], path: Path, began: float, settled: float) -> None:
        # dcp.save returns on every rank only after the coordinator wrote .metadata, i.e. after
        # every rank's write finished: the commit condition holds.
        dcp.save(state, checkpoint_id=str(path), process_group=self._group)
        written = time.monotonic()
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
            self.events.emit(Event.CHECKPOINT_BEGIN, step=stats.step, blocking_s=round(stats.blocking_s, 4),
                             mode=stats.mode, snapshot_s=round(stats.snapshot_s, 4))

    # -- the protocol -------------------------------------------------------------------------
    def _agree(self, *values: int) -> list[list[int]]:
        """Every rank's ``values``: row i holds value i of each rank (one all-reduce)."""
        table = torch.zeros((len(values), self._world_size), dtype=torch.int64, device=self._collective_device)
        table[:, self._rank] = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(table, group=self._group)
        return table.tolist()

    def _settle(self, step: int, already_committed: int) -> bool:
        """Agree that every writer is up and every rank saves ``step``; False: skip (committed)."""
        self._require_group()
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            state = _DONE
            if self.async_save:
                state = self._writer_state(deadline)
            states, steps, committed = self._agree(state, step, already_committed)
            if len(set(steps)) != 1:
                raise RuntimeError(f"ranks disagree on the checkpoint step: {steps}; save() must be "
                                   "called with the same step on every rank")
            failed = _failed_ranks(states)
            if failed:
                local = self._helpers.channel.error if self.async_save else None
                why = f"here: {local}" if local else f"not up within {self.start_timeout_s:.0f}s, or died starting"
                raise CheckpointWriterError(step, f"checkpoint writer did not start on rank(s) {failed} ({why})",
                                            tuple(failed))
            if max(states) == _DONE:
                return committed[0] == 0

    def _writer_state(self, deadline: float) -> int:
        """DONE when this rank's writer is up and has finished everything it was given (its boot
        ping, an abandoned save); BUSY until then. Waiting here, in short collective rounds, keeps a
        rank from stalling alone in the staging handshake while the others train on."""
        writer, channel = self._helpers.writer, self._helpers.channel
        if channel.error:
            log.error("rank %d: %s", self._rank, channel.error)
            return _FAILED
        if writer.wait_completed(self._calls.call_idx, _ROUND_S) and channel.ready:
            self._calls.forget_up_to(writer.completed_idx)
            return _DONE
        if not writer.alive:
            log.warning("rank %d: checkpoint writer (pid %s) died; starting a new one", self._rank, writer.pid)
            self._start_writer()
        return _FAILED if time.monotonic() > deadline else _BUSY

    def _finalize(self, blocking: bool) -> list[CheckpointInfo]:
        pending = self._pending
        self._require_group()
        while True:
            state = self._write_state(pending, _ROUND_S if blocking else 0.0)
            states, steps = self._agree(state, pending.step)
            if len(set(steps)) != 1:
                raise RuntimeError(f"ranks are finalizing different checkpoint steps: {steps}")
            failed = _failed_ranks(states)
            if failed:
                self._fail(pending, states, failed)
            if max(states) == _DONE:
                break
            if not blocking:
                return []
        all_results = pending.dist_wrapper.gather_object(pending.write_results)  # on the coordinator

        def finish() -> None:
            pending.writer.finish(pending.metadata, all_results)  # DCP's .metadata

        self._pending = None
        return [self._commit(pending.step, pending.path, pending.began, finish)]

    def _write_state(self, pending: _PendingSave, wait_s: float) -> int:
        """This rank's view of the pending write (sticky once it is final)."""
        if pending.local_state is not None:
            return pending.local_state
        writer = self._helpers.writer
        if pending.call_idx is None or writer.wait_completed(pending.call_idx, wait_s):
            if pending.call_idx is not None:
                self._calls.forget_up_to(pending.call_idx)
            try:
                results = pending.writer.retrieve_write_results()
            except Exception as e:  # 0.4.1 raises what the writer reported instead of results
                results = (e, None)
            if isinstance(results, tuple) and len(results) == 2 and isinstance(results[0], BaseException):
                # 0.7 returns it wrapped, DCP-style: (exception, traceback summary)
                pending.local_state, pending.error = _FAILED, f"{type(results[0]).__name__}: {results[0]}"
            else:
                pending.write_results, pending.local_state = results, _DONE
            return pending.local_state
        if not writer.alive:
            pending.local_state = _DEAD
            pending.error = f"the checkpoint writer process (pid {writer.pid}) died mid-save"
        elif time.monotonic() - pending.scheduled > self.write_timeout_s:
            pending.local_state = _DEAD
            pending.error = (f"the checkpoint writer process (pid {writer.pid}) did not finish within "
                             f"write_timeout_s={self.write_timeout_s:.0f}s; killed")
            writer.close(abort=True)
        if pending.local_state == _DEAD:
            log.error("rank %d: %s (step %d)", self._rank, pending.error, pending.step)
            self._start_writer()  # now, so it boots while training goes on
            return _DEAD
        return _BUSY

    def _fail(self, pending: _PendingSave, states: list[int], failed: list[int]) -> None:
        self._pending = None
        detail = "; ".join(f"rank {r}: {_STATE_NAMES[states[r]]}" for r in failed)
        if pending.error:
            detail += f" (here: {pending.error})"
        raise CheckpointWriterError(pending.step, f"{detail}; {pending.path.name} is left uncommitted", tuple(failed))

    def _commit(self, step: int, path: Path, began: float, finish: Callable[[], None] | None) -> CheckpointInfo:
        """Rank 0: write .metadata (async), the marker and ``latest``; every rank learns whether
        that worked (so all raise or none do). Then rank 0 applies retention in the background."""
        info, error = None, None
        if self._rank == 0:
            try:
                if finish is not None:
                    finish()
                info = self.catalog.commit(step, self._world_size)
            except Exception as e:
                error = e
                log.exception("committing checkpoint step %d failed", step)
        (ok,) = self._agree(int(self._rank != 0 or error is None))
        if not all(ok):
            raise CheckpointWriterError(step, f"rank 0 could not commit {path.name}: {error or 'see rank 0 log'}",
                                        (0,)) from error
        if self._rank == 0:
            if self.events is not None:
                self.events.emit(Event.CHECKPOINT_COMMIT, step=step, checkpoint_id=path.name,
                                 save_s=round(time.monotonic() - began, 4))
            self._start_retention()
        return info or CheckpointInfo(step, path, True, self._world_size)

    def _start_retention(self) -> None:
        """Delete old checkpoints off the critical path: deleting gigabytes (seconds on Lustre)
        would otherwise hold every rank at the next collective. Only folders older than the newest
        committed one are touched, so it never races a newer save; one deletion at a time."""
        self._join_retention()
        self._retention = threading.Thread(target=self._apply_retention, name="ckpt-retention", daemon=True)
        self._retention.start()

    def _apply_retention(self) -> None:
        try:
            deleted = self.catalog.apply_retention(self.keep)
            if deleted:
                log.info("retention removed %s", [p.name for p in deleted])
        except OSError as e:  # a full disk later is worse than a stale folder now
            log.warning("checkpoint retention failed: %s", e)

    def _join_retention(self) -> None:
        if self._retention is not None:
            self._retention.join()
            self._retention = None

    # -- helpers ------------------------------------------------------------------------------
    def _start_writer(self) -> None:
        """Start (or replace) this rank's writer and send it a ping; does not wait for it to boot."""
        old = self._helpers.writer
        if old is not None:
            old.close(abort=True)
        writer = _PersistentWriter(self._rank)
        writer.start()
        self._handed_over.clear()  # a new process holds no buffers yet
        self._helpers.writer = writer
        if self._calls is None:
            self._calls = _WriterQueue(writer)
        else:
            self._calls.persistent_caller = writer
            self._calls.async_calls.clear()
        self._calls.schedule_async_request(AsyncRequest(_noop, (), []))

    def _require_open(self) -> None:
        if self._closed:
            raise RuntimeError("this AsyncCheckpointer is closed")

    def _require_group(self) -> None:
        if self._group is None:
            if not dist.is_initialized():
                raise RuntimeError("checkpointing needs an initialized torch.distributed process group "
                                   "(call rebind() after init_process_group)")
            self.rebind(None)


def _protocol_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """The group the save protocol (planning, settle and finalize rounds, commit) runs on.

    On NCCL every round would be a GPU collective plus a host sync of its result, once per step
    while a save is pending. A gloo group over the same ranks keeps them on the host, off the GPU
    streams, as torch's docs recommend for async checkpointing. Creating it is a collective:
    ``rebind`` is called on every rank at the same point."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" not in backend or "gloo" in backend:
        return group
    ranks = None if group is dist.group.WORLD else dist.get_process_group_ranks(group)
    return dist.new_group(ranks=ranks, backend="gloo")


def _failed_ranks(states: list[int]) -> list[int]:
    return [r for r, s in enumerate(states) if s in (_FAILED, _DEAD)]


def _collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where the protocol's small tensors live: host memory unless the group is NCCL-only."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _remove_torn(path: Path) -> None:
    """Remove an uncommitted leftover folder so the new save starts clean. Writers that may still
    hold files in it (an abandoned save) keep writing to unlinked files, not into the new shards."""
    if path.exists() and not (path / COMMIT_MARKER).exists():
        shutil.rmtree(path, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# Resume
# --------------------------------------------------------------------------------------------


def choose_checkpoint(
    run_dir: str | os.PathLike | RunDir,
    process_group: dist.ProcessGroup | None = None,
    events: EventLog | None = None,
) -> CheckpointInfo | None:
    """The newest committed checkpoint, the same on every rank (rank 0's choice, broadcast), or
    None when nothing is committed yet. Torn folders (no commit marker) are never chosen; each one
    newer than the choice gets a ``checkpoint_skip`` event on rank 0. Call it before building the
    model, so weights a checkpoint will overwrite are never initialised."""
    catalog = CheckpointCatalog(run_dir)
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank(process_group) if distributed else 0
    newest = catalog.latest()
    chosen = newest.step if newest is not None else -1
    if distributed:
        choice = torch.tensor([chosen if rank == 0 else 0], dtype=torch.int64, device=_collective_device(process_group))
        src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
        dist.broadcast(choice, src=src, group=process_group)
        chosen = int(choice.item())
    if rank == 0 and events is not None:
        for torn in catalog.torn():
            if torn.step > chosen:
                events.emit(Event.CHECKPOINT_SKIP, checkpoint_id=torn.checkpoint_id, step=torn.step,
                            reason="no commit marker: the save did not finish on every rank")
    if chosen < 0:
        return None
    info = next((c for c in catalog.committed() if c.step == chosen), None)
    if info is None:  # rank 0 saw it committed; this rank's view of a shared filesystem lags
        info = CheckpointInfo(chosen, catalog.layout.checkpoint_dir(chosen), True)
    return info


def load_checkpoint(info: CheckpointInfo, state: dict[str, Any], process_group: dist.ProcessGroup | None = None) -> None:
    """Load checkpoint ``info`` into ``state`` in place (DCP reshards to this world size)."""
    dcp.load(state, checkpoint_id=str(info.path), process_group=process_group)


def load_latest(
    run_dir: str | os.PathLike | RunDir,
    state: dict[str, Any],
    process_group: dist.ProcessGroup | None = None,
    events: EventLog | None = None,
) -> CheckpointInfo | None:
    """``choose_checkpoint`` then ``load_checkpoint``: the newest committed checkpoint loaded into
    ``state``; returns what was loaded, or None (nothing committed yet)."""
    info = choose_checkpoint(run_dir, process_group, events)
    if info is not None:
        load_checkpoint(info, state, process_group)
    return info
