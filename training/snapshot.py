"""The state a checkpoint holds, and the one copy of it a save makes.

- ``app_state`` / ``restore_app_state``: what the training loop saves and how it is applied back;
- ``SnapshotBuffers``: every tensor copied into host buffers allocated once and reused by every
  save (pinned on CUDA, shared memory everywhere, so the writer process maps them instead of
  receiving a copy);
- ``_SnapshotWriter``: NVRx's async file writer over those buffers (on NVRx 0.7 they are handed to
  the writer once per writer process, never cloned);
- ``_cpu_safe_preload``: NVRx's staging step without its unconditional CUDA sync.
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
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
        args = args[:position] + (False,) + args[position + 1:]
        return functools.partial(preload_fn.func, *args, **preload_fn.keywords)
    return functools.partial(preload_fn.func, *args, **{**preload_fn.keywords, "non_blocking": False})


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
