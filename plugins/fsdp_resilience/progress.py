"""Is a training launch done, failed, stalled, or still going? One check, used by the deferrable
trigger (in the triggerer) and by the sensor's poke mode (in a worker).

The check keeps no state of its own: progress is read from the run dir (the newest committed
checkpoint and its commit time) and the job's state from the backend. A trigger that is restarted
— the triggerer moved, Airflow upgraded — picks the run up exactly where it was.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from training.contract import CheckpointCatalog, FailureClass

from fsdp_resilience.backends import JobHandle, JobStatus, TrainingBackend

SUCCESS, FAILED, NO_PROGRESS = "success", "failed", "no_progress"


@dataclass(frozen=True)
class Progress:
    """What a watch saw: ``outcome`` is None while the launch is still healthy and running."""

    outcome: str | None
    failure_class: str | None
    message: str
    step: int  # newest committed step (0: none yet)
    checkpoint_id: str | None
    launch_id: str
    handle: dict[str, Any]  # the launch's JobHandle, so the escalation ladder can act on it
    job_state: str
    last_progress_at: float
    nodes: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def latest_checkpoint(run_dir: str, checkpoints_s3: str | None = None, aws_conn_id: str | None = None) -> Any:
    """The run's newest committed checkpoint: from the run dir (FSx mounted here), or from its S3
    export when ``checkpoints_s3`` is set (a triggerer without the mount). Same rules either way."""
    if checkpoints_s3:
        from fsdp_resilience.fsx_staging import latest_committed_in_s3

        return latest_committed_in_s3(checkpoints_s3, aws_conn_id=aws_conn_id or "aws_default")
    return CheckpointCatalog(run_dir).latest()


def check_progress(backend: TrainingBackend, handle: JobHandle, *, run_dir: str, final_step: int,
                   stall_timeout_s: float, launched_at: float, now: float | None = None,
                   checkpoints_s3: str | None = None, aws_conn_id: str | None = None) -> Progress:
    """One look at a launch: its job's state, then its newest committed checkpoint."""
    status = backend.status(handle)
    latest = latest_checkpoint(run_dir, checkpoints_s3, aws_conn_id)
    return judge_progress(status, latest, handle, final_step=final_step,
                          stall_timeout_s=stall_timeout_s, launched_at=launched_at, now=now)


def judge_progress(status: JobStatus, latest: Any, handle: JobHandle, *, final_step: int, stall_timeout_s: float,
                   launched_at: float, now: float | None = None) -> Progress:
    """The verdict from a job's state and its run's newest committed checkpoint (``latest``: what
    ``CheckpointCatalog.latest()`` returns, or None). Read the job's state first, then the
    checkpoint: a job seen done has committed everything it ever will, so the checkpoint read after
    it sees the final commit (read the other way round, a commit landing between the two reads
    would make a finished run look short)."""
    now = time.time() if now is None else now
    step = latest.step if latest else 0
    checkpoint_id = latest.checkpoint_id if latest else None
    # A commit from an earlier launch is not progress of this one: count from the launch.
    last_progress_at = max(launched_at, (latest.committed_at or 0.0) if latest else 0.0)

    def result(outcome: str | None, failure_class: str | None, message: str) -> Progress:
        return Progress(outcome, failure_class, message, step, checkpoint_id, handle.launch_id,
                        handle.to_dict(), status.state, last_progress_at, list(status.nodes))

    if status.state == "succeeded":
        if step >= final_step:
            return result(SUCCESS, FailureClass.SUCCESS.value, f"step {final_step} committed as {checkpoint_id}")
        return result(FAILED, FailureClass.UNKNOWN.value,
                      f"the job ended successfully but the newest committed step is {step}, not {final_step}")
    if status.state == "failed":
        return result(FAILED, status.failure_class or FailureClass.UNKNOWN.value, status.message)
    stalled_for = now - last_progress_at
    if stalled_for > stall_timeout_s:
        return result(NO_PROGRESS, FailureClass.NO_PROGRESS.value,
                      f"no new committed checkpoint for {stalled_for:.0f}s (stall timeout {stall_timeout_s:.0f}s); "
                      f"newest committed step {step}")
    return result(None, None, f"{status.state}: newest committed step {step} of {final_step}")
