"""Which checkpoint the control plane may evaluate, export and publish: the newest committed one
that verifies (``fsdp_resilience.training.contract.verify_checkpoint``), never one that merely has a commit marker.

Verification happens where the bytes are:

- the run dir is readable here (the local backend's folder; FSx mounted in the Airflow worker, as
  on EKS): every file the commit marker lists must exist with its size, and its CRC32C is read
  and compared (``verified="checksums"``);
- only the run dir's S3 export is (``FSDP_CHECKPOINTS_S3``, no mount): the marker must list every
  file with a checksum, and every object must exist with its recorded size (``verified="sizes"``;
  FSx exports no CRC32C with an object, so the bytes are checked where they are loaded).

A checkpoint that fails is skipped, with the reason, in the result and as a ``checkpoint_skip``
event. Only where the run dir is the trainers' own disk (``quarantine=True``: the local backend)
is it also moved to ``checkpoints/quarantine/`` (a ``checkpoint_quarantined`` event), so no
restart layer tries it again: there, the bytes this process reads are the bytes a resume reads.
On EKS an Airflow worker's view of FSx can differ from the pods' (a client-side error, a failed
lazy load from S3, a read-only mount), and renaming folders on a file system linked to S3 moves
objects in S3; the pods verify and quarantine for themselves when they next load a checkpoint.

Torch-free; S3 is read through the amazon provider only when it is needed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fsdp_resilience.training.contract import (
    CHECKSUM_ALGORITHM,
    CheckpointCatalog,
    Event,
    EventLog,
    verify_checkpoint,
)

#: How much of a checkpoint was checked: every byte against its CRC32C, or the marker and sizes.
CHECKSUMS, SIZES = "checksums", "sizes"


class NoTrustedCheckpoint(RuntimeError):
    """No committed checkpoint of the run verifies (or none can be checked from here). The message
    says which failed and why, and what to do; ``skipped`` lists them."""

    def __init__(self, message: str, skipped: list[dict[str, Any]] | None = None):
        super().__init__(message)
        self.skipped = list(skipped or [])


@dataclass(frozen=True)
class CheckpointChoice:
    """The checkpoint to trust, and the newer committed ones passed over on the way to it."""

    checkpoint_id: str
    step: int
    #: Where it is: the checkpoint folder, or its s3:// prefix.
    location: str
    #: ``CHECKSUMS`` or ``SIZES``.
    verified: str
    #: ``{"checkpoint_id", "step", "reason"}`` per newer committed checkpoint that failed, newest
    #: first, with ``quarantined_to`` where it was moved aside.
    skipped: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        how = (
            f"every file's {CHECKSUM_ALGORITHM} checked"
            if self.verified == CHECKSUMS
            else "marker and file sizes checked (the bytes are not readable here)"
        )
        text = f"{self.checkpoint_id} (step {self.step}; {how})"
        if self.skipped:
            text += "; skipped " + "; ".join(_skip_line(s) for s in self.skipped)
        return text


def _skip_line(skip: dict[str, Any]) -> str:
    where = f", quarantined to {skip['quarantined_to']}" if skip.get("quarantined_to") else ""
    return f"{skip['checkpoint_id']}: {skip['reason']}{where}"


def choose_checkpoint(
    run_dir: str | Path,
    *,
    run_id: str,
    task: str,
    quarantine: bool = False,
    s3_uri: str | None = None,
    aws_conn_id: str | None = "aws_default",
) -> CheckpointChoice:
    """The newest committed checkpoint of the run that verifies, read from the run dir if it is
    readable here, else from its S3 export ``s3_uri``. ``task`` names the caller in the events
    (``evaluate``, ``publish``). Raises ``NoTrustedCheckpoint`` when none verifies."""
    if Path(run_dir).is_dir():
        return _choose_in_run_dir(Path(run_dir), run_id=run_id, task=task, quarantine=quarantine)
    if s3_uri:
        return _choose_in_s3(s3_uri, run_id=run_id, aws_conn_id=aws_conn_id)
    raise NoTrustedCheckpoint(
        f"cannot verify any checkpoint of run {run_id}: its run dir {run_dir} is not readable here and no S3 "
        "export of it is configured. Mount FSx in the Airflow workers at FSDP_FSX_MOUNT_PATH (the same path as "
        "in the pods), or set FSDP_CHECKPOINTS_S3 to the S3 side of the runs root"
    )


def _choose_in_run_dir(run_dir: Path, *, run_id: str, task: str, quarantine: bool) -> CheckpointChoice:
    catalog = CheckpointCatalog(run_dir)
    events = EventLog(catalog.layout.events, run_id=run_id, role="control-plane", task=task)
    skipped: list[dict[str, Any]] = []
    for info in reversed(catalog.committed()):
        reason = verify_checkpoint(info.path)
        if reason is None:
            return CheckpointChoice(info.checkpoint_id, info.step, str(info.path), CHECKSUMS, skipped)
        skip: dict[str, Any] = {"checkpoint_id": info.checkpoint_id, "step": info.step, "reason": reason}
        moved = None
        if quarantine:
            try:
                moved = catalog.quarantine(info, reason, by=f"control plane ({task})")
            except OSError as e:  # gone already (a rank quarantined it first), or the folder is read-only
                skip["not_quarantined"] = f"{e.strerror or e}"
        if moved is not None:
            skip["quarantined_to"] = str(moved)
            events.emit(
                Event.CHECKPOINT_QUARANTINED,
                checkpoint_id=info.checkpoint_id,
                step=info.step,
                reason=reason,
                moved_to=str(moved),
            )
        else:
            events.emit(Event.CHECKPOINT_SKIP, checkpoint_id=info.checkpoint_id, step=info.step, reason=reason)
        skipped.append(skip)
    raise _none_verifies(run_id, str(run_dir), skipped)


def _choose_in_s3(s3_uri: str, *, run_id: str, aws_conn_id: str | None) -> CheckpointChoice:
    from fsdp_resilience.control.hooks.s3_checkpoints import S3CheckpointProgress

    export = S3CheckpointProgress(s3_uri, aws_conn_id=aws_conn_id)
    skipped: list[dict[str, Any]] = []
    for info, marker in export.committed():
        reason = verify_listing(marker, export.object_sizes(info))
        if reason is None:
            return CheckpointChoice(info.checkpoint_id, info.step, info.uri, SIZES, skipped)
        skipped.append({"checkpoint_id": info.checkpoint_id, "step": info.step, "reason": reason})
    raise _none_verifies(run_id, s3_uri, skipped)


def verify_listing(marker: dict[str, Any], sizes: dict[str, int]) -> str | None:
    """Why a checkpoint whose files are only listed (name -> size, e.g. S3 objects) cannot be
    trusted, or None: the checks of ``verify_checkpoint`` that need no bytes, with its wording."""
    files = marker.get("files")
    if not isinstance(files, dict) or ".metadata" not in files:
        return "the commit marker lists no checksummed files (written before checksums, or damaged)"
    if marker.get("checksum") != CHECKSUM_ALGORITHM:
        return f"the commit marker's checksum is {marker.get('checksum')!r}, not {CHECKSUM_ALGORITHM}"
    for name, want in sorted(files.items()):
        if not isinstance(want, dict) or not isinstance(want.get("size"), int):
            return f"the commit marker's entry for {name} is damaged"
        if name not in sizes:
            return f"{name} is missing"
        if sizes[name] != want["size"]:
            return f"{name} is {sizes[name]} bytes, the commit recorded {want['size']}"
    return None


def _none_verifies(run_id: str, where: str, skipped: list[dict[str, Any]]) -> NoTrustedCheckpoint:
    if not skipped:
        return NoTrustedCheckpoint(
            f"run {run_id} has no committed checkpoint under {where}: train it first "
            "(torn checkpoints, without a commit marker, never count)"
        )
    return NoTrustedCheckpoint(
        f"no committed checkpoint of run {run_id} verifies ({where}): "
        + "; ".join(_skip_line(s) for s in skipped)
        + ". Nothing was evaluated or published. Train the run again (it resumes from the newest checkpoint that "
        "verifies, or from step 0), and look at checkpoints/quarantine/ for what failed",
        skipped,
    )
