"""The checkpoints of one run, readable without torch: listing, commit, quarantine, retention."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Iterator

from fsdp_resilience.training.contract.checkpoints import (
    CHECKSUM_ALGORITHM,
    COMMIT_MARKER,
    QUARANTINE_RECORD,
    CheckpointInfo,
    checkpoint_files,
    checkpoint_step,
    file_checksum,
    read_commit_marker,
    read_rank_sums,
    verify_checkpoint,
)
from fsdp_resilience.training.contract.files import atomic_write_text
from fsdp_resilience.training.contract.rundir import RunDir
from fsdp_resilience.training.contract.version import CONTRACT_VERSION


class CheckpointCatalog:
    """The checkpoints of one run and the commit protocol, readable without torch.

    Protocol: every rank's writer writes its shard files into ``step_N/`` and then their sizes and
    CRC32C into ``step_N/.sums/``; when all ranks have finished (the save's finalize synchronises
    them) rank 0 writes DCP's ``.metadata``, then the commit marker atomically, listing every file
    with its size and checksum, then moves ``latest``. A folder without the marker is torn: never
    loaded, never counted. A marker without checksums is not a commit.

    Trust: the marker, not ``latest``, is the source of truth (``latest`` is a hint for humans
    and tools that cannot list a folder), and a committed checkpoint is loaded only after
    ``verify_checkpoint``. One that fails is moved to ``quarantine/`` with the reason, so no
    restart layer tries it again, and the newest earlier one that verifies is used instead.
    """

    def __init__(self, run_dir: str | os.PathLike | RunDir):
        self.layout = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)

    def _scan(self) -> Iterator[CheckpointInfo]:
        root = self.layout.checkpoints
        if not root.is_dir():
            return
        for p in root.iterdir():
            step = checkpoint_step(p.name)
            if step is None or not p.is_dir():
                continue
            marker = read_commit_marker(p)
            if marker is None:
                yield CheckpointInfo(step, p, committed=False)
            else:
                yield CheckpointInfo(step, p, True, marker.get("world_size"), marker.get("committed_at"))

    def all(self) -> list[CheckpointInfo]:
        return sorted(self._scan(), key=lambda c: c.step)

    def committed(self) -> list[CheckpointInfo]:
        return [c for c in self.all() if c.committed]

    def torn(self) -> list[CheckpointInfo]:
        return [c for c in self.all() if not c.committed]

    def latest(self) -> CheckpointInfo | None:
        """The newest committed checkpoint, or None. Not yet verified: see ``verify_checkpoint``."""
        committed = self.committed()
        return committed[-1] if committed else None

    def latest_hint(self) -> str | None:
        """What the ``latest`` pointer names, if it names a checkpoint folder; None if the pointer
        is missing or garbage. A hint only: ``latest()`` never reads it."""
        try:
            name = self.layout.latest_pointer.read_text(errors="replace").strip()
        except OSError:
            return None
        return name if checkpoint_step(name) is not None else None

    def commit(self, step: int, world_size: int, extra: dict[str, Any] | None = None) -> CheckpointInfo:
        """Mark ``step`` committed and move ``latest`` (rank 0 only, after every rank finished).

        The marker lists every data file with the size and checksum its writer recorded, plus
        ``.metadata``'s, checksummed here. Refuses (raises) when a rank's checksums are missing or
        a file in the folder has none: a checkpoint without its checksums is not committed."""
        path = self.layout.checkpoint_dir(step)
        if not (path / ".metadata").is_file():
            raise RuntimeError(f"cannot commit {path}: DCP .metadata is missing (the save did not finish)")
        files = read_rank_sums(path, world_size)
        files[".metadata"] = file_checksum(path / ".metadata")
        unlisted = sorted(set(checkpoint_files(path)) - set(files))
        if unlisted:
            raise RuntimeError(f"cannot commit {path.name}: no checksum for {unlisted[:5]}")
        reason = verify_checkpoint(path, {"files": files, "checksum": CHECKSUM_ALGORITHM}, checksum=[])
        if reason:
            raise RuntimeError(f"cannot commit {path.name}: {reason}")
        now = time.time()
        marker = {
            "step": step,
            "world_size": world_size,
            "committed_at": now,
            "contract_version": CONTRACT_VERSION,
            "checksum": CHECKSUM_ALGORITHM,
            "files": files,
            **(extra or {}),
        }
        atomic_write_text(path / COMMIT_MARKER, json.dumps(marker, sort_keys=True))
        atomic_write_text(self.layout.latest_pointer, path.name + "\n")
        atomic_write_text(self.layout.latest_step, f"{step}\n")
        return CheckpointInfo(step, path, True, world_size, now)

    def quarantine(self, info: CheckpointInfo, reason: str, **record: Any) -> Path:
        """Move a checkpoint that failed verification out of the catalog, with why, and return
        where it went. Never deletes: a user may still want to inspect or salvage it."""
        dest_root = self.layout.quarantine
        dest_root.mkdir(parents=True, exist_ok=True)
        dest = dest_root / f"{info.path.name}.{int(time.time() * 1000)}"
        os.rename(info.path, dest)
        atomic_write_text(
            dest / QUARANTINE_RECORD,
            json.dumps(
                {
                    "checkpoint_id": info.checkpoint_id,
                    "step": info.step,
                    "reason": reason,
                    "quarantined_at": time.time(),
                    **record,
                },
                sort_keys=True,
                default=str,
            ),
        )
        if self.latest_hint() == info.path.name:
            newest = self.latest()
            if newest is not None:
                atomic_write_text(self.layout.latest_pointer, newest.path.name + "\n")
                atomic_write_text(self.layout.latest_step, f"{newest.step}\n")
            else:
                for pointer in (self.layout.latest_pointer, self.layout.latest_step):
                    try:
                        pointer.unlink()
                    except FileNotFoundError:
                        pass
        return dest

    def quarantined(self) -> list[dict[str, Any]]:
        """The quarantine's records (``path`` added), oldest first."""
        out = []
        root = self.layout.quarantine
        if root.is_dir():
            for p in sorted(root.iterdir()):
                try:
                    rec = json.loads((p / QUARANTINE_RECORD).read_text())
                except (OSError, ValueError):
                    rec = {"checkpoint_id": p.name.split(".")[0], "reason": "unknown (no readable record)"}
                out.append({**rec, "path": str(p)})
        return sorted(out, key=lambda r: r.get("quarantined_at", 0))

    def apply_retention(self, keep: int, protect: tuple[int, ...] | set[int] = ()) -> list[Path]:
        """Delete all but the newest ``keep`` committed checkpoints, and torn folders older than the
        newest committed one (they can never be loaded). Newer torn folders are left alone: a save
        may still be writing them. Returns what was deleted.

        Never deleted: the steps in ``protect`` (the caller's newest verified checkpoint), and,
        when none of the kept ones passes the size check of ``verify_checkpoint``, the newest
        older one that does, so damaged newer checkpoints never take the last good one with them."""
        committed = self.committed()
        if not committed:
            return []
        newest = committed[-1].step
        kept, older = committed[-keep:], committed[:-keep] if len(committed) > keep else []
        spared = {c.step for c in older if c.step in set(protect)}
        if older and not any(verify_checkpoint(c.path, checksum=[]) is None for c in kept):
            fallback = next((c for c in reversed(older) if verify_checkpoint(c.path, checksum=[]) is None), None)
            if fallback is not None:
                spared.add(fallback.step)
        doomed = [c.path for c in older if c.step not in spared]
        doomed += [c.path for c in self.torn() if c.step < newest]
        for p in doomed:
            # Remove the marker first so a crash mid-delete leaves a torn (ignored) folder.
            try:
                (p / COMMIT_MARKER).unlink()
            except FileNotFoundError:
                pass
            shutil.rmtree(p, ignore_errors=True)
        return doomed
