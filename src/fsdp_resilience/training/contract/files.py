"""Durable writes to the run dir: whole-file replacement, and a probe for a dir that takes none."""

from __future__ import annotations

import os
from pathlib import Path


def atomic_write_text(path: Path, text: str, durable: bool = True) -> None:
    """Write ``text`` to ``path`` so a reader sees the old file or the whole new one, never part.
    ``durable`` false: no fsync (a record rewritten every second, worthless after a crash, need
    not cost a round trip to the file system's servers each time)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if not durable:
        return
    try:  # make the rename durable (matters on a crash, not for correctness of readers)
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def probe_writable(folder: str | os.PathLike) -> str | None:
    """Why ``folder`` cannot take a small durable write (full, read-only, no permission), or None.
    A real write and fsync, not ``os.access``: a full disk or a read-only mount passes that."""
    folder = Path(folder)
    probe = folder / f".write-probe.{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        return f"{folder} is not writable: {e.strerror or e} (errno {e.errno})"
    finally:
        try:
            probe.unlink()
        except OSError:
            pass
    return None
