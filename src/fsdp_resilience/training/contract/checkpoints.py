"""The checkpoint layout and the rules a checkpoint must pass: names, the commit marker, the
per-rank checksum records, and verification. The catalog (commit, quarantine, retention) is in
``checkpoint_catalog``.

A checkpoint is a folder ``checkpoints/step_NNNNNNNN/`` holding one DCP checkpoint (a shard file
per rank and ``.metadata``), each rank's checksum record under ``.sums/``, and, written last by
rank 0, the commit marker ``COMMITTED.json`` listing every file's size and CRC32C. A folder
without a readable marker is torn: never loaded. One that fails verification is moved to
``checkpoints/quarantine/`` with a ``QUARANTINED.json`` saying why.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdp_resilience.training.contract.files import atomic_write_text

#: A checkpoint folder's name: this prefix and the step as 8 digits (``step_00000020``).
CHECKPOINT_PREFIX = "step_"
#: The commit marker, written last, by rank 0: a checkpoint without it is torn.
COMMIT_MARKER = "COMMITTED.json"
#: Where checkpoints that failed verification go, under ``checkpoints/``.
QUARANTINE_DIR = "quarantine"
#: Why a checkpoint was quarantined, inside its quarantined folder.
QUARANTINE_RECORD = "QUARANTINED.json"
#: Per-rank checksum records inside a checkpoint folder, written by each rank's writer.
SUMS_DIR = ".sums"
#: The checksum of every checkpoint file: CRC32C (hardware-accelerated, the one S3 also offers).
CHECKSUM_ALGORITHM = "crc32c"
_CHUNK = 8 << 20


def file_checksum(path: str | os.PathLike) -> dict[str, Any]:
    """``{"size": bytes, "crc32c": hex}`` of a file's bytes on disk (CRC32C releases the GIL and
    runs at several GiB/s here, so a writer or a background thread can afford it)."""
    # a small C extension, installed on both planes; imported late to keep this module's import stdlib-only
    import crc32c

    value, size = 0, 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            value = crc32c.crc32c(view[:n], value)
            size += n
    return {"size": size, CHECKSUM_ALGORITHM: f"{value:08x}"}


def checkpoint_files(path: str | os.PathLike) -> list[str]:
    """The data files of a checkpoint folder (shards and ``.metadata``), relative names, sorted:
    everything but the protocol's own records."""
    root = Path(path)
    out = []
    for p in root.rglob("*"):
        rel = p.relative_to(root)
        if p.is_file() and rel.parts[0] not in (SUMS_DIR, COMMIT_MARKER, QUARANTINE_RECORD):
            out.append(rel.as_posix())
    return sorted(out)


def write_rank_sums(path: str | os.PathLike, rank: int, names: list[str]) -> dict[str, dict[str, Any]]:
    """Checksum ``names`` (the files rank ``rank`` wrote into checkpoint ``path``) and record them
    in ``.sums/rank_NNNNN.json`` for the commit. Run by the rank's writer, after its write."""
    root = Path(path)
    sums = {name: file_checksum(root / name) for name in names}
    (root / SUMS_DIR).mkdir(exist_ok=True)
    atomic_write_text(root / SUMS_DIR / f"rank_{rank:05d}.json", json.dumps(sums, sort_keys=True))
    return sums


def read_rank_sums(path: str | os.PathLike, world_size: int) -> dict[str, dict[str, Any]]:
    """Every rank's checksum record merged; raises if a rank's is missing or unreadable."""
    files: dict[str, dict[str, Any]] = {}
    missing = []
    for rank in range(world_size):
        record = Path(path) / SUMS_DIR / f"rank_{rank:05d}.json"
        try:
            data = json.loads(record.read_text())
        except (OSError, ValueError):
            missing.append(rank)
            continue
        files.update(data)
    if missing:
        raise RuntimeError(f"cannot commit {Path(path).name}: no checksums from rank(s) {missing[:8]}")
    return files


def verify_checkpoint(
    path: str | os.PathLike, marker: dict[str, Any] | None = None, checksum: list[str] | None = None
) -> str | None:
    """Why checkpoint ``path`` cannot be trusted, or None when it verifies.

    Always checks that the marker lists every file with a checksum, and that each file exists
    with its recorded size (a ``stat`` each). Reads and checksums the files named in ``checksum``
    (None: all of them), so ranks can split the reading between them."""
    path = Path(path)
    if marker is None:
        marker = read_commit_marker(path)
    if marker is None:
        return "no readable commit marker"
    files = marker.get("files")
    if not isinstance(files, dict) or ".metadata" not in files:
        return "the commit marker lists no checksummed files (written before checksums, or damaged)"
    if marker.get("checksum") != CHECKSUM_ALGORITHM:
        return f"the commit marker's checksum is {marker.get('checksum')!r}, not {CHECKSUM_ALGORITHM}"
    for name, want in files.items():
        if not isinstance(want, dict) or not isinstance(want.get("size"), int):
            return f"the commit marker's entry for {name} is damaged"
        try:
            size = (path / name).stat().st_size
        except FileNotFoundError:
            return f"{name} is missing"
        except OSError as e:
            return f"{name} is unreadable: {e.strerror or e}"
        if size != want["size"]:
            return f"{name} is {size} bytes, the commit recorded {want['size']}"
    for name in sorted(files) if checksum is None else checksum:
        if name not in files:
            continue
        try:
            got = file_checksum(path / name)
        except OSError as e:
            return f"{name} is unreadable: {e.strerror or e}"
        if got != files[name]:
            return (
                f"{name} fails its {CHECKSUM_ALGORITHM} check (recorded {files[name].get(CHECKSUM_ALGORITHM)}, "
                f"read {got[CHECKSUM_ALGORITHM]}, {got['size']} bytes)"
            )
    return None


def checksum_share(files: list[str], rank: int, world_size: int) -> list[str]:
    """The files rank ``rank`` checksums when ``world_size`` ranks verify one checkpoint together:
    its own shards (``__<rank>_*``: in the page cache, and read by its load anyway), ``.metadata``
    on rank 0, and shards of ranks that no longer exist, round-robin."""
    mine = []
    orphans = []
    for name in files:
        owner = _shard_owner(name)
        if owner is None:
            if rank == 0:
                mine.append(name)
        elif owner < world_size:
            if owner == rank:
                mine.append(name)
        else:
            orphans.append(name)
    mine += [n for i, n in enumerate(orphans) if i % world_size == rank]
    return mine


def _shard_owner(name: str) -> int | None:
    """DCP names shard files ``__<rank>_<n>.distcp``."""
    match = re.match(r"__(\d+)_\d+\.distcp$", Path(name).name)
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: Path
    committed: bool
    world_size: int | None = None
    committed_at: float | None = None

    @property
    def checkpoint_id(self) -> str:
        return self.path.name


def parse_commit_marker(text: str | bytes) -> dict[str, Any] | None:
    """A commit marker's content: a JSON object, or None (unreadable: the checkpoint is torn).
    Wherever the marker was read from (the run dir, its S3 export)."""
    try:
        data = json.loads(text)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def read_commit_marker(path: Path) -> dict[str, Any] | None:
    try:
        text = (Path(path) / COMMIT_MARKER).read_bytes()
    except OSError:
        return None
    return parse_commit_marker(text)


def checkpoint_step(name: str) -> int | None:
    """The step of a checkpoint folder's name (``step_00000020`` -> 20); None if it is not one."""
    if not name.startswith(CHECKPOINT_PREFIX):
        return None
    try:
        return int(name[len(CHECKPOINT_PREFIX) :])
    except ValueError:
        return None
