"""Whether the run dir takes writes: its folders created, a write probed, and a storage stop of an
earlier launch cleared once writes work again."""

from __future__ import annotations

import errno
from pathlib import Path

from fsdp_resilience.training.contract import ConfigError, FailureClass, RunDir, clear_stop, probe_writable


class StorageError(Exception):
    """The run dir cannot take writes."""


def create_run_dir(layout: RunDir) -> None:
    """The run dir's folders. A path that cannot be a folder (a part of it is a file or a broken
    link) is a config error; anything else that refuses the writes is storage."""
    try:
        layout.create()
    except OSError as e:
        where = Path(e.filename or layout.root)
        if e.errno in (errno.ENOTDIR, errno.EEXIST):
            what = "is a link to nothing" if where.is_symlink() and not where.exists() else "is not a folder"
            raise ConfigError(
                f"run_dir={layout.root} cannot be created: {where} {what}; choose a folder path"
            ) from None
        if e.errno in (errno.ENAMETOOLONG, errno.ELOOP):
            raise ConfigError(f"run_dir={layout.root} cannot be created: {e.strerror}; choose a folder path") from None
        raise StorageError(
            f"the run dir {layout.root} cannot be created: {e.strerror or e} (errno {e.errno})"
        ) from None


def storage_problem(layout: RunDir) -> str | None:
    """Why the run dir cannot take a write now (full, read-only, no permission), or None."""
    return probe_writable(layout.checkpoints)


STORAGE_ADVICE = "free space or fix the mount, then launch again"


def clear_storage_stop(layout: RunDir) -> bool:
    """A storage stop from an earlier launch no longer holds once the run dir takes writes again
    (space was freed, the mount fixed): move the marker aside (kept for the record) and go on."""
    if clear_stop(layout, FailureClass.STORAGE_ERROR) is None:
        return False  # none, another class, or another node's launcher moved it first
    print(
        f"[launch] {layout.stop_marker} recorded a storage error; the run dir takes writes again: cleared", flush=True
    )
    return True
