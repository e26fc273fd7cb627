"""The commit protocol's parts, beside ``AsyncCheckpointer`` (src/fsdp_resilience/training/checkpoint.py) which runs it.

- the per-rank states a settle / finalize round exchanges, what a pending save holds, where a
  save's time went (``SaveStats``), the group the rounds run on, and ``CheckpointWriterError``,
  which every rank raises at the same point when a save fails anywhere;
- ``Committer.commit``: rank 0, once every rank finished writing: DCP's ``.metadata``, then
  ``CheckpointCatalog.commit`` (the rules live in ``fsdp_resilience.training.contract``: the marker lists every
  file with its size and CRC32C, and a checkpoint without every rank's checksums is refused), with
  each rank's model digest in the marker; a save whose model bytes equal the previous commit's
  while the step advanced is flagged (``checkpoint_stale``);
- ``Committer.start_retention``: deletes old checkpoints in the background, never the newest one
  known to verify (the resume point, or the newest own commit);
- ``write_sync_sums`` / ``write_empty_sums``: checksum records the trainer writes itself.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import FileSystemWriterAsync
from torch.distributed.tensor import DTensor

from fsdp_resilience.training.checkpoint_writer import model_digest, read_writer_records, write_writer_record
from fsdp_resilience.training.contract import (
    COMMIT_MARKER,
    CheckpointCatalog,
    CheckpointInfo,
    Event,
    EventLog,
    read_commit_marker,
    write_rank_sums,
)

log = logging.getLogger(__name__)


#: How long one finalize round waits locally before the ranks compare notes (seconds). Short, so
#: a rank that finished early never sits in a collective for long (gloo timeouts can be seconds).
_ROUND_S = 0.05

# Per-rank states exchanged in a finalize / settle round. Larger is worse: any rank's FAILED or
# DEAD fails the save everywhere.
_DONE, _BUSY, _FAILED, _DEAD = 0, 1, 2, 3
_STATE_NAMES = {_DONE: "done", _BUSY: "busy", _FAILED: "write failed", _DEAD: "writer process died or stalled"}


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


class Committer:
    """Rank 0's side of a commit, and retention. ``trusted`` is the newest step known to verify:
    set by ``AsyncCheckpointer.trust`` (the resume point) and by every commit."""

    def __init__(self, catalog: CheckpointCatalog, events: EventLog | None, keep: int):
        self.catalog = catalog
        self.events = events
        self.keep = keep
        self.trusted: int | None = None
        self._retention: threading.Thread | None = None

    def commit(self, step: int, world_size: int, finish: Callable[[], None] | None,
               began: float) -> CheckpointInfo:
        """Write .metadata (``finish``, async saves) and the marker; emit the commit event and, if
        the model did not change since the previous commit, a stale-save event. Raises if the
        commit is refused (missing checksums, a file without one, a size that does not match)."""
        path = self.catalog.layout.checkpoint_dir(step)
        if finish is not None:
            finish()
        records = read_writer_records(path, world_size)
        extra: dict[str, Any] = {}
        if records is not None:
            extra = {"model_crc32c": [r.get("model_crc32c") for r in records],
                     "checksum_s": [r.get("checksum_s") for r in records]}
        previous = [c for c in self.catalog.committed() if c.step < step]
        info = self.catalog.commit(step, world_size, extra=extra)
        if self.events is not None:
            self.events.emit(Event.CHECKPOINT_COMMIT, step=step, checkpoint_id=path.name,
                             save_s=round(time.monotonic() - began, 4))
        same_as = _same_model_as(previous[-1] if previous else None, extra.get("model_crc32c"))
        if same_as is not None:
            log.warning("checkpoint %s holds the same model bytes as %s although the step advanced: a stale "
                        "save (did the optimizer update the model?)", path.name, same_as)
            if self.events is not None:
                self.events.emit(Event.CHECKPOINT_STALE, step=step, checkpoint_id=path.name, same_as=same_as)
        return info

    def start_retention(self) -> None:
        """Delete old checkpoints off the critical path: deleting gigabytes (seconds on Lustre)
        would otherwise hold every rank at the next collective. Only folders older than the newest
        committed one are touched, so it never races a newer save; one deletion at a time."""
        self.join_retention()
        protect = () if self.trusted is None else (self.trusted,)
        self._retention = threading.Thread(target=self._apply_retention, args=(protect,), name="ckpt-retention",
                                           daemon=True)
        self._retention.start()

    def _apply_retention(self, protect: tuple[int, ...]) -> None:
        try:
            deleted = self.catalog.apply_retention(self.keep, protect=protect)
            if deleted:
                log.info("retention removed %s", [p.name for p in deleted])
        except OSError as e:  # a full disk later is worse than a stale folder now
            log.warning("checkpoint retention failed: %s", e)

    def join_retention(self) -> None:
        if self._retention is not None:
            self._retention.join()
            self._retention = None


def _same_model_as(previous: CheckpointInfo | None, digests: list | None) -> str | None:
    """The id of ``previous`` if its recorded model digests equal ``digests`` (same world size)."""
    if previous is None or not digests or None in digests:
        return None
    marker = read_commit_marker(previous.path) or {}
    return previous.checkpoint_id if marker.get("model_crc32c") == digests else None


def write_sync_sums(path: Path, rank: int, state: dict[str, Any]) -> None:
    """After a synchronous ``dcp.save``: this rank's checksum record (DCP names its files
    ``__<index in the group>_<n>.distcp``) and model digest, written by the trainer."""
    began = time.monotonic()
    mine = re.compile(rf"__{rank}_\d+\.distcp")
    sums = write_rank_sums(path, rank, sorted(p.name for p in path.iterdir() if mine.fullmatch(p.name)))
    crc, nbytes = model_digest(_local_model_tensors(state))
    write_writer_record(path, rank, model_crc32c=crc, model_bytes=nbytes,
                        checksum_bytes=sum(s["size"] for s in sums.values()),
                        checksum_s=round(time.monotonic() - began, 6))


def write_empty_sums(path: Path, rank: int) -> None:
    """The records of a rank that had nothing to write in a save: the commit wants every rank's."""
    path.mkdir(parents=True, exist_ok=True)
    write_rank_sums(path, rank, [])
    crc, nbytes = model_digest([])
    write_writer_record(path, rank, model_crc32c=crc, model_bytes=nbytes, checksum_bytes=0, checksum_s=0.0)


def _local_model_tensors(state: dict[str, Any]) -> Iterable[tuple[str, tuple, torch.Tensor]]:
    """``(fqn, offset, host tensor)`` of this rank's model shards."""
    for key, value in (state.get("model") or {}).items():
        if isinstance(value, DTensor):
            value = value.to_local()
        if isinstance(value, torch.Tensor):
            yield f"model.{key}", (), value.detach().cpu()


def remove_torn(path: Path) -> None:
    """Remove an uncommitted leftover folder so the new save starts clean. Writers that may still
    hold files in it (an abandoned save) keep writing to unlinked files, not into the new shards."""
    if path.exists() and not (path / COMMIT_MARKER).exists():
        shutil.rmtree(path, ignore_errors=True)
