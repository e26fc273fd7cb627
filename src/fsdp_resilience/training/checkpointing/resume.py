"""Choosing and loading a checkpoint to resume from: verify before trust, quarantine, fall back.

On every rank, at the same point (a collective over the process group, or a plain call in one
process, as evaluation runs):

1. ``choose_checkpoint``: candidates are the committed checkpoints, newest first, as rank 0 lists
   them (never the ``latest`` pointer, a hint only). Every rank checks every file's size against
   the commit marker and checksums its share of the files (``contract.checksum_share``: its own
   shards, which its load reads anyway); one all-reduce agrees. A checkpoint that fails anywhere
   is quarantined by rank 0 (``CheckpointCatalog.quarantine``, with the first failing rank's
   reason) after every rank finished, a ``checkpoint_quarantined`` event says why, and the next
   candidate is tried. The first that verifies everywhere is the choice.
2. ``restore_checkpoint``: DCP loads the choice. A load that raises on any rank (agreed, so no
   rank waits for another) quarantines it too, and the next verified checkpoint is loaded instead.
   A checkpoint that holds a different model or optimizer than the one being loaded is not the
   checkpoint's fault: ``CheckpointMismatchError`` is raised and nothing is quarantined.

Nothing is deleted here: a quarantined checkpoint stays under ``checkpoints/quarantine/``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from fsdp_resilience.training.contract import (
    CheckpointCatalog,
    CheckpointInfo,
    Event,
    EventLog,
    RunDir,
    checksum_share,
    read_commit_marker,
    verify_checkpoint,
)

log = logging.getLogger(__name__)

#: How much of a failure reason travels between ranks (bytes of UTF-8).
_REASON_BYTES = 1024


class CheckpointMismatchError(ValueError):
    """The checkpoint holds a different model or optimizer than the state being loaded (keys or
    shapes differ): a configuration error, not damage. Raised on every rank; nothing is
    quarantined."""


def collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where small protocol tensors live: host memory unless the group is NCCL-only."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class _Ranks:
    """The ranks that choose together: a process group, or this one process alone."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world = dist.get_world_size(group) if self.distributed else 1
        self.device = collective_device(group) if self.distributed else torch.device("cpu")

    def _global(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank

    def from_rank0(self, value: int) -> int:
        if not self.distributed:
            return value
        t = torch.tensor([value if self.rank == 0 else 0], dtype=torch.int64, device=self.device)
        dist.broadcast(t, src=self._global(0), group=self.group)
        return int(t.item())

    def first_failure(self, reason: str | None, code: int = 1) -> tuple[int | None, str, int]:
        """Agree on failures: ``(lowest failing rank, its reason, highest code)``, or
        ``(None, "", 0)`` when no rank failed. Every rank gets the same answer."""
        if not self.distributed:
            return (0, reason, code) if reason else (None, "", 0)
        flags = torch.zeros(self.world, dtype=torch.int64, device=self.device)
        flags[self.rank] = code if reason else 0
        dist.all_reduce(flags, group=self.group)
        failed = [r for r, f in enumerate(flags.tolist()) if f]
        if not failed:
            return None, "", 0
        first = failed[0]
        text = torch.zeros(_REASON_BYTES, dtype=torch.uint8, device=self.device)
        if self.rank == first:
            data = reason.encode("utf-8", "replace")[:_REASON_BYTES]
            text[: len(data)] = torch.tensor(list(data), dtype=torch.uint8, device=self.device)
        dist.broadcast(text, src=self._global(first), group=self.group)
        why = bytes(text.cpu().tolist()).rstrip(b"\0").decode("utf-8", "replace")
        if len(failed) > 1:
            why += f" (also failed on rank(s) {failed[1:9]})"
        return first, f"rank {first}: {why}", int(flags.max().item())


def _verify_here(info: CheckpointInfo, ranks: _Ranks) -> str | None:
    """This rank's verdict on ``info``: sizes of every file, checksums of its share."""
    marker = read_commit_marker(info.path)
    files = sorted(marker["files"]) if marker and isinstance(marker.get("files"), dict) else []
    try:
        return verify_checkpoint(info.path, marker, checksum=checksum_share(files, ranks.rank, ranks.world))
    except Exception as e:  # noqa: BLE001 - whatever the reason, this checkpoint is not trusted
        return f"verification failed: {type(e).__name__}: {e}"


def _quarantine(
    catalog: CheckpointCatalog, info: CheckpointInfo, reason: str, ranks: _Ranks, events: EventLog | None, **record: Any
) -> None:
    """Rank 0: move ``info`` aside with ``reason`` and say so; never raises."""
    if ranks.rank != 0:
        return
    try:
        moved_to = str(catalog.quarantine(info, reason, **record))
    except OSError as e:  # e.g. gone meanwhile (retention, a second reader): skipped all the same
        log.error("could not quarantine %s (%s): %s", info.checkpoint_id, reason, e)
        moved_to = None
    log.error("checkpoint %s is not trusted: %s; quarantined at %s", info.checkpoint_id, reason, moved_to)
    if events is not None:
        events.emit(
            Event.CHECKPOINT_QUARANTINED,
            checkpoint_id=info.checkpoint_id,
            step=info.step,
            reason=reason,
            moved_to=moved_to,
        )


def check_checkpoint(
    run_dir: str | os.PathLike | RunDir,
    info: CheckpointInfo,
    process_group: dist.ProcessGroup | None = None,
    events: EventLog | None = None,
) -> str | None:
    """Verify ``info`` on every rank (sizes everywhere, checksums split between the ranks);
    quarantine it if it fails anywhere. Returns the agreed reason, or None when it verifies.
    A collective: call it on every rank with the same checkpoint."""
    ranks = _Ranks(process_group)
    failed_rank, reason, _ = ranks.first_failure(_verify_here(info, ranks))
    if failed_rank is None:
        return None
    # Every rank finished verifying (the all-reduce above) before the folder moves.
    _quarantine(CheckpointCatalog(run_dir), info, reason, ranks, events, phase="verify", failed_rank=failed_rank)
    return reason


def choose_checkpoint(
    run_dir: str | os.PathLike | RunDir,
    process_group: dist.ProcessGroup | None = None,
    events: EventLog | None = None,
    *,
    below: int | None = None,
) -> CheckpointInfo | None:
    """The newest committed checkpoint (older than ``below``, if given) that verifies on every
    rank, the same on every rank; None when none does (training starts from scratch). Failing
    ones are quarantined, with a ``checkpoint_quarantined`` event each; torn folders newer than
    the choice get a ``checkpoint_skip`` event, and so does the end of the search when committed
    checkpoints existed but none verified. Events are emitted on rank 0 only (pass ``events``
    there). Call it before building the model, so weights a checkpoint will overwrite are never
    initialised. A collective over ``process_group``; works without one (one process)."""
    catalog = CheckpointCatalog(run_dir)
    ranks = _Ranks(process_group)
    emit = events if ranks.rank == 0 else None
    limit = below
    rejected: list[CheckpointInfo] = []
    chosen = None
    while True:
        step = -1
        if ranks.rank == 0:
            older = [c for c in catalog.committed() if limit is None or c.step < limit]
            step = older[-1].step if older else -1
        step = ranks.from_rank0(step)
        if step < 0:
            break
        path = catalog.layout.checkpoint_dir(step)
        marker = read_commit_marker(path) or {}
        info = CheckpointInfo(step, path, True, marker.get("world_size"), marker.get("committed_at"))
        if check_checkpoint(run_dir, info, process_group, emit) is None:
            chosen = info
            break
        rejected.append(info)
        limit = step
    if emit is not None:
        newest = chosen.step if chosen is not None else -1
        for torn in catalog.torn():
            if torn.step > newest and (below is None or torn.step < below):
                emit.emit(
                    Event.CHECKPOINT_SKIP,
                    checkpoint_id=torn.checkpoint_id,
                    step=torn.step,
                    reason="no commit marker: the save did not finish on every rank",
                )
        if chosen is None and rejected:
            emit.emit(
                Event.CHECKPOINT_SKIP,
                checkpoint_id=rejected[-1].checkpoint_id,
                step=rejected[-1].step,
                reason=f"no committed checkpoint verifies ({len(rejected)} quarantined, kept under "
                f"{catalog.layout.quarantine}): starting from scratch",
            )
    return chosen


def _check_fits(info: CheckpointInfo, state: dict[str, Any]) -> str | None:
    """Why ``state`` cannot be loaded from ``info`` because they describe different models
    (a key of ``state`` the checkpoint lacks, or a tensor of another shape), or None."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(str(info.path)).read_metadata()
    saved = metadata.state_dict_metadata
    flat, _ = flatten_state_dict(state)
    missing = sorted(k for k in flat if k not in saved)
    if missing:
        return f"{info.checkpoint_id} has no {missing[:3]}{' ...' if len(missing) > 3 else ''}"
    for key, value in flat.items():
        md = saved[key]
        if isinstance(md, TensorStorageMetadata) and isinstance(value, torch.Tensor) and md.size != value.size():
            return f"{info.checkpoint_id} holds {key} of shape {tuple(md.size)}, this model's is {tuple(value.size())}"
    return None


def _load_error(e: BaseException) -> str:
    """One line per failing rank instead of DCP's tracebacks (they would fill the record)."""
    failures = getattr(e, "failures", None)
    if not isinstance(failures, dict):
        return f"{type(e).__name__}: {e}"[:500]
    parts = []
    for rank, wrapped in sorted(failures.items()):
        exc = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        first_line = (str(exc).strip().splitlines() or [""])[0]
        parts.append(f"rank {rank}: {type(exc).__name__}: {first_line[:160]}")
    return f"DCP's read failed on rank(s) {sorted(failures)}: " + "; ".join(parts)


def load_checkpoint(
    info: CheckpointInfo, state: dict[str, Any], process_group: dist.ProcessGroup | None = None
) -> None:
    """Load checkpoint ``info`` into ``state`` in place (DCP reshards to this world size). No
    verification: prefer ``restore_checkpoint``."""
    dcp.load(state, checkpoint_id=str(info.path), process_group=process_group)


def restore_checkpoint(
    run_dir: str | os.PathLike | RunDir,
    state: dict[str, Any],
    first: CheckpointInfo | None,
    process_group: dist.ProcessGroup | None = None,
    events: EventLog | None = None,
) -> CheckpointInfo | None:
    """Load ``first`` (a ``choose_checkpoint`` result) into ``state``; if the load fails on any
    rank, quarantine it and load the next verified checkpoint instead. Returns what was loaded,
    or None (nothing left: ``state`` may then hold partly loaded values; start from scratch with a
    freshly built one). Raises ``CheckpointMismatchError`` on every rank when the checkpoint
    holds another model (nothing is quarantined). A collective, like ``choose_checkpoint``."""
    ranks = _Ranks(process_group)
    emit = events if ranks.rank == 0 else None
    info = first
    while info is not None:
        mismatch = error = None
        try:
            mismatch = _check_fits(info, state)
        except Exception as e:  # noqa: BLE001 - an unreadable .metadata is the checkpoint's fault
            error = f"{type(e).__name__}: {e}"
        _, why, _ = ranks.first_failure(mismatch)
        if why:
            raise CheckpointMismatchError(
                f"cannot resume from {info.checkpoint_id}: {why}; the run's model or "
                "optimizer changed since it was saved: restore the config, or start "
                "a new run"
            )
        if error is None:
            try:
                load_checkpoint(info, state, process_group)
            except (Exception, CheckpointException) as e:  # DCP's is a BaseException, raised on every rank
                error = _load_error(e)
        failed_rank, reason, _ = ranks.first_failure(error)
        if failed_rank is None:
            return info
        _quarantine(
            CheckpointCatalog(run_dir),
            info,
            f"load failed: {reason}"[:2000],
            ranks,
            emit,
            phase="load",
            failed_rank=failed_rank,
        )
        info = choose_checkpoint(run_dir, process_group, events, below=info.step)
    return None


def load_latest(
    run_dir: str | os.PathLike | RunDir,
    state: dict[str, Any],
    process_group: dist.ProcessGroup | None = None,
    events: EventLog | None = None,
) -> CheckpointInfo | None:
    """``choose_checkpoint`` then ``restore_checkpoint``: the newest checkpoint that verifies and
    loads, loaded into ``state``; returns it, or None (nothing committed verifies)."""
    return restore_checkpoint(run_dir, state, choose_checkpoint(run_dir, process_group, events), process_group, events)
