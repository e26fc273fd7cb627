"""Rank 0's side of the commit protocol, beside ``AsyncCheckpointer`` (``checkpointer``) and its
collective rounds (``rounds``), which decide when it runs.

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

import logging
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from fsdp_resilience.training.checkpointing.write_job import model_digest, read_writer_records, write_writer_record
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


class Committer:
    """Rank 0's side of a commit, and retention. ``trusted`` is the newest step known to verify:
    set by ``AsyncCheckpointer.trust`` (the resume point) and by every commit."""

    def __init__(self, catalog: CheckpointCatalog, events: EventLog | None, keep: int):
        self.catalog = catalog
        self.events = events
        self.keep = keep
        self.trusted: int | None = None
        self._retention: threading.Thread | None = None

    def commit(self, step: int, world_size: int, finish: Callable[[], None] | None, began: float) -> CheckpointInfo:
        """Write .metadata (``finish``, async saves) and the marker; emit the commit event and, if
        the model did not change since the previous commit, a stale-save event. Raises if the
        commit is refused (missing checksums, a file without one, a size that does not match)."""
        path = self.catalog.layout.checkpoint_dir(step)
        if finish is not None:
            finish()
        records = read_writer_records(path, world_size)
        extra: dict[str, Any] = {}
        if records is not None:
            extra = {
                "model_crc32c": [r.get("model_crc32c") for r in records],
                "checksum_s": [r.get("checksum_s") for r in records],
            }
        previous = [c for c in self.catalog.committed() if c.step < step]
        info = self.catalog.commit(step, world_size, extra=extra)
        if self.events is not None:
            self.events.emit(
                Event.CHECKPOINT_COMMIT, step=step, checkpoint_id=path.name, save_s=round(time.monotonic() - began, 4)
            )
        same_as = _same_model_as(previous[-1] if previous else None, extra.get("model_crc32c"))
        if same_as is not None:
            log.warning(
                "checkpoint %s holds the same model bytes as %s although the step advanced: a stale "
                "save (did the optimizer update the model?)",
                path.name,
                same_as,
            )
            if self.events is not None:
                self.events.emit(Event.CHECKPOINT_STALE, step=step, checkpoint_id=path.name, same_as=same_as)
        return info

    def start_retention(self) -> None:
        """Delete old checkpoints off the critical path: deleting gigabytes (seconds on Lustre)
        would otherwise hold every rank at the next collective. Only folders older than the newest
        committed one are touched, so it never races a newer save; one deletion at a time."""
        self.join_retention()
        protect = () if self.trusted is None else (self.trusted,)
        self._retention = threading.Thread(
            target=self._apply_retention, args=(protect,), name="ckpt-retention", daemon=True
        )
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
    write_writer_record(
        path,
        rank,
        model_crc32c=crc,
        model_bytes=nbytes,
        checksum_bytes=sum(s["size"] for s in sums.values()),
        checksum_s=round(time.monotonic() - began, 6),
    )


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
