"""The state a checkpoint holds, and the one copy of it a save makes.

- ``app_state`` / ``restore_app_state``: what the training loop saves and how it is applied back;
- ``SnapshotBuffers``: every tensor copied into host buffers allocated once and reused by every
  save (pinned on CUDA, shared memory everywhere, so the writer process maps them instead of
  receiving a copy);
- ``structure_key``: what a save plan depends on, so a cached plan is reused only while it holds;
- ``_SnapshotWriter``: NVRx's async file writer over those buffers (on NVRx 0.7 they are handed to
  the writer once per writer process, never cloned);
- ``_cpu_safe_preload``: NVRx's staging step without its unconditional CUDA sync.
"""

from __future__ import annotations

import concurrent.futures
import copy
import functools
import inspect
import logging
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from nvidia_resiliency_ext.checkpointing.async_ckpt import filesystem_async as nvrx_filesystem
from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import FileSystemWriterAsync
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

log = logging.getLogger(__name__)

#: NVRx 0.7 builds the write buckets in the writer process: ``preload_tensors`` takes
#: ``(checkpoint_dir, (identifier, data))``. 0.4.1 builds them in the trainer.
_BUCKETS_IN_WRITER = hasattr(nvrx_filesystem, "ConsistentDataIdentifier")


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
        log.warning(
            "could not pin a %s checkpoint buffer (%s); copies into it will be pageable", tuple(buffer.shape), e
        )


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
        #: Bumped whenever a buffer is (re)allocated: a writer holding buffers of an older
        #: generation must be handed the new ones (an address alone could be reused).
        self.generation = 0
        self._stream = None  # CUDA: the side stream the device-to-host copies run on
        self._copied = None  # CUDA: an event recorded after the last snapshot's copies
        self._copier: concurrent.futures.ThreadPoolExecutor | None = None  # CPU: the overlapped copies' thread
        self._copying: concurrent.futures.Future | None = None  # CPU: the copy in flight

    @property
    def buffers(self) -> list[torch.Tensor]:
        return list(self._buffers.values())

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    @torch.no_grad()
    def snapshot(self, state: Any, *, overlap: bool = False) -> Any:
        """A copy of ``state`` with the same structure: tensors (DTensor shards included) copied
        into the buffers, other values deep-copied (those at once, whatever ``overlap`` says).

        ``overlap=False``: the state may change as soon as this returns. On CUDA the copies run on
        a side stream after the work already queued on the current stream (the optimizer step
        that wrote the parameters), and the current stream waits for them; call ``wait_copied``
        before the host reads the buffers.

        ``overlap=True``: the tensor copies may still be running when this returns (on CPU in a
        copy thread, on CUDA on the side stream with nothing waiting for it), so they overlap the
        next forward and backward, which read the parameters and optimizer state but never write
        them. The caller must call ``wait_copied`` before anything writes the state again (the
        next ``optimizer.step``)."""
        self.wait_copied()  # a buffer is never refilled while an earlier copy into it runs
        if self.pin_memory:
            current = torch.cuda.current_stream()
            if self._stream is None:
                self._stream = torch.cuda.Stream()
            self._stream.wait_stream(current)
            with torch.cuda.stream(self._stream):
                copied = self._copy(state, (), None)
                self._copied = torch.cuda.Event()
                self._copied.record(self._stream)
            if not overlap:
                current.wait_stream(self._stream)
            return copied
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        copied = self._copy(state, (), pairs)
        if not overlap:
            _copy_pairs(pairs)
            return copied
        if self._copier is None:
            # Started at the first overlapped save, long after the writer process was forked
            # (fork_is_safe wants no thread before that).
            self._copier = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="snapshot-copy")
        self._copying = self._copier.submit(_copy_pairs, pairs)
        return copied

    def wait_copied(self) -> float:
        """Block the host until the last snapshot's copies have landed; returns how long that
        took. Raises what a copy thread raised."""
        began = time.perf_counter()
        copying, self._copying = self._copying, None
        if copying is not None:
            copying.result()
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        return time.perf_counter() - began

    def close(self) -> None:
        """Wait for any copy in flight and stop the copy thread."""
        try:
            self.wait_copied()
        finally:
            if self._copier is not None:
                self._copier.shutdown(wait=True)
                self._copier = None

    def _copy(self, obj: Any, path: tuple[Any, ...], pairs: list | None) -> Any:
        """``obj`` with its tensors replaced by their buffers. ``pairs`` collects (buffer,
        source) for a later copy; None copies each tensor here (on the CUDA side stream)."""
        if isinstance(obj, DTensor):
            local = self._copy_tensor(obj.to_local(), path, pairs)
            # Same sharding spec, local shard in the host buffer: what DCP plans and writes. (The
            # public from_local would move the shard back to the mesh's device.)
            return DTensor(local, obj._spec, requires_grad=False)
        if isinstance(obj, torch.Tensor):
            return self._copy_tensor(obj.detach(), path, pairs)
        if isinstance(obj, Mapping):
            return {k: self._copy(v, path + (k,), pairs) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            items = [self._copy(v, path + (i,), pairs) for i, v in enumerate(obj)]
            return items if isinstance(obj, list) else type(obj)(items)
        return copy.deepcopy(obj)  # ints, floats, strings: frozen now, not when the writer runs

    def _copy_tensor(self, src: torch.Tensor, path: tuple[Any, ...], pairs: list | None) -> torch.Tensor:
        buffer = self._buffers.get(path)
        if buffer is None or buffer.shape != src.shape or buffer.dtype != src.dtype:
            buffer = torch.empty(src.shape, dtype=src.dtype)
            self.generation += 1
            if buffer.numel() > 0:
                buffer.share_memory_()
                if self.pin_memory:
                    _pin(buffer)
            self._buffers[path] = buffer
        if pairs is None:
            buffer.copy_(src, non_blocking=self.pin_memory and src.is_cuda)
        else:
            pairs.append((buffer, src))
        return buffer


def _copy_pairs(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy each source into its buffer: one call into torch, which holds no GIL while it copies
    (so a copy thread does not slow the training thread's Python)."""
    if pairs:
        buffers, sources = zip(*pairs)
        torch._foreach_copy_(list(buffers), list(sources))


def structure_key(state: Any) -> int:
    """A hash of everything a DCP save plan depends on: each leaf's path and kind, a tensor's
    shape and dtype, a DTensor's sharding spec (mesh, placements, global shape) and this rank's
    shard. Values do not count (a plan never holds them). Compared only with this rank's own
    earlier keys, so Python's per-process string hashing is fine."""
    leaves: list[tuple[Any, ...]] = []

    def walk(obj: Any, path: tuple[Any, ...]) -> None:
        if isinstance(obj, DTensor):
            local = obj._local_tensor
            leaves.append(
                (
                    path,
                    "dtensor",
                    hash(obj._spec),
                    tuple(local.shape),
                    local.dtype,
                    obj.device_mesh.get_coordinate() and tuple(obj.device_mesh.get_coordinate()),
                )
            )
        elif isinstance(obj, torch.Tensor):
            leaves.append((path, "tensor", tuple(obj.shape), obj.dtype))
        elif isinstance(obj, Mapping):
            for k, v in obj.items():
                walk(v, path + (k,))
        elif isinstance(obj, (list, tuple)):
            leaves.append((path, type(obj).__name__, len(obj)))
            for i, v in enumerate(obj):
                walk(v, path + (i,))
        else:
            leaves.append((path, type(obj).__name__))

    walk(state, ())
    return hash(tuple(leaves))


# --------------------------------------------------------------------------------------------
# NVRx's file writer over the snapshot
# --------------------------------------------------------------------------------------------


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
        args = args[:position] + (False,) + args[position + 1 :]
        return functools.partial(preload_fn.func, *args, **preload_fn.keywords)
    return functools.partial(preload_fn.func, *args, **{**preload_fn.keywords, "non_blocking": False})


#: In the writer process: the snapshot buffers it was handed, ``(key, tensors)`` (0.4.1 path).
_held_buffers: tuple[Any, list[torch.Tensor]] | None = None


def _write_with_held_buffers(
    job: Callable, key: Any, tensors: list[torch.Tensor] | None, rank: int, buckets: Any, results_queue: Any
) -> None:
    """In the writer process (NVRx 0.4.1): ``job`` over ``buckets`` whose tensors are indices
    into the buffers this process holds. A request that carries ``tensors`` hands them over (the
    first save, or after the buffers changed); later ones carry none, so nothing is pickled or
    passed per tensor (no file descriptor per buffer, no trainer thread serving them)."""
    global _held_buffers
    if tensors is not None:
        _held_buffers = (key, tensors)
    if _held_buffers is None or _held_buffers[0] != key:
        raise RuntimeError(
            f"the checkpoint writer does not hold the snapshot buffers {key!r} this save refers to "
            "(a writer restarted without being handed them); the next save hands them over again"
        )
    held = _held_buffers[1]
    resolved = [
        (file_path, file_name, (bytes_data, [(item, held[i]) for item, i in tensor_refs]))
        for file_path, file_name, (bytes_data, tensor_refs) in buckets
    ]
    job(rank, resolved, results_queue)


class _SnapshotWriter(FileSystemWriterAsync):
    """NVRx's async file writer over our snapshot buffers: one copy of the state per save.

    On NVRx 0.7 the stock ``prepare_write_data`` clones every CPU tensor (a second copy of the
    state in private memory), and sending the clones to the writer moves each into fresh shared
    memory (a third): an 8b save on 2x8 GPUs would need about twice its size in ``/dev/shm``. Our
    snapshot already is a stable copy in shared memory, reused by every save and left untouched
    until the save that read it is finalized. So here the buffers are handed to the writer as they
    are, and only once per writer process: the writer keeps them under NVRx's plan-shape key
    (``ConsistentDataIdentifier``) and later saves send no tensor at all, only the plan.

    On 0.4.1 the buckets are built here and carry the tensors; pickling them for the writer
    passes one file descriptor per buffer, every save. So the buckets' tensors are replaced by
    indices, the buffers travel with the first request only, and the job resolves the indices in
    the writer (``wrap_job``, ``_write_with_held_buffers``).

    ``handed_over`` maps a plan key to the buffers' storage addresses (and ``generation``, see
    ``SnapshotBuffers``) the current writer process holds; ``AsyncCheckpointer`` clears it whenever
    it starts a writer.
    """

    def __init__(self, path: str, *, handed_over: dict[Any, tuple], generation: int = 0, **kwargs: Any):
        super().__init__(path, **kwargs)
        self.handed_over = handed_over
        self.generation = generation
        self._held_key: Any = None
        self._hand_over: list[torch.Tensor] | None = None

    def wrap_job(self, job: Callable) -> Callable:
        """The writer's job for this save: as is on 0.7; on 0.4.1 resolving buffer indices."""
        if _BUCKETS_IN_WRITER or self._held_key is None:
            return job
        return functools.partial(_write_with_held_buffers, job, self._held_key, self._hand_over)

    def prepare_write_data(self, plan, planner) -> None:
        if not _BUCKETS_IN_WRITER:
            super().prepare_write_data(plan, planner)
            tensors = [t for _, _, (_, tensor_data) in self.write_buckets for _, t in tensor_data]
            not_shared = [t.shape for t in tensors if t.numel() and not t.untyped_storage().is_shared()]
            if not tensors or not_shared:  # nothing to hand over, or not only our snapshot: stock path
                return
            buckets, index = [], 0
            for file_path, file_name, (bytes_data, tensor_data) in self.write_buckets:
                refs = [(item, index + i) for i, (item, _) in enumerate(tensor_data)]
                index += len(refs)
                buckets.append((file_path, file_name, (bytes_data, refs)))
            self.write_buckets = buckets
            storages = (self.generation, tuple((t.data_ptr(), tuple(t.shape)) for t in tensors))
            self._held_key = ("held", self.generation, hash(storages))
            if self.handed_over.get("held") != storages:
                self._hand_over = tensors
                self.handed_over.clear()  # the writer keeps one set of buffers
                self.handed_over["held"] = storages
            return
        tensor_items = [item for item in plan.items if item.type != WriteItemType.BYTE_IO]
        byte_items = [item for item in plan.items if item.type == WriteItemType.BYTE_IO]
        tensors = [planner.resolve_data(item).detach() for item in tensor_items]
        not_shared = [
            item.index.fqn
            for item, t in zip(tensor_items, tensors)
            if t.numel() and not t.untyped_storage().is_shared()
        ]
        if not_shared:  # only our snapshot may be handed over uncopied
            raise RuntimeError(f"_SnapshotWriter writes snapshot buffers only; not in shared memory: {not_shared[:3]}")
        self.consistent_data_identifier = None
        self.cached_tensor_data = None
        if tensor_items:
            key = nvrx_filesystem._compute_data_structure_key_from_plan(tensor_items)
            storages = (
                self.generation,
                tuple((t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)) for t in tensors),
            )
            self.consistent_data_identifier = nvrx_filesystem.ConsistentDataIdentifier(key)
            if self.handed_over.get(key) != storages:
                self.cached_tensor_data = (tensor_items, tensors)
                self.handed_over[key] = storages
        self.uncached_tensor_data = None
        self.byte_io_data = (byte_items, [planner.resolve_data(item) for item in byte_items]) if byte_items else None
        self.storage_plan = plan.storage_data
        self.has_data_to_write = len(plan.items) > 0
        self.results_queue = nvrx_filesystem.get_write_results_queue() if self.has_data_to_write else None
