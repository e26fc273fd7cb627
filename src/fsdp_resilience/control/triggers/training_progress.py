"""The watch of a training launch, from the triggerer: fires when the launch succeeded, failed or stalled."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

from airflow.triggers.base import BaseTrigger, TriggerEvent

from fsdp_resilience.control.backends import JobHandle, get_backend
from fsdp_resilience.control.progress import (
    CHANGE_TICK_S,
    LaunchChanges,
    judge_progress,
    latest_checkpoint,
    waiting_verdict,
)
from fsdp_resilience.control.progress import SUCCESS as PROGRESS_SUCCESS
from fsdp_resilience.control.triggers.base import FAILURE, SUCCESS, trigger_event, until_next_check


class TrainingProgressTrigger(BaseTrigger):
    """Fires once when the launch succeeded (final step committed), failed (with the run
    contract's failure class), or made no progress for ``stall_timeout_s``. The event: status
    ``success`` or ``failure`` (failed or stalled), and what the watch saw (``Outcome.to_dict()``,
    its ``message`` among it).

    It checks the launch every ``poll_interval_s``, and in between looks every ``change_tick_s``
    for what says the launch has ended (``LaunchChanges``: a launcher's ``final`` event, a lost
    node in the backend's job record), so an ended launch is seen in a fraction of a second, not
    at the next poll. That look only stats files and reads appended lines. Without the run dir
    here (``checkpoints_s3``: read from its S3 export), or with ``change_tick_s=0``, only the poll.

    Small and serialisable: everything it needs is in its kwargs, and it keeps no state between
    polls (see ``fsdp_resilience.control.progress``), so a restarted triggerer resumes it as it was.
    """

    def __init__(
        self,
        *,
        backend: dict[str, Any],
        handle: dict[str, Any],
        run_dir: str,
        final_step: int,
        stall_timeout_s: float,
        launched_at: float,
        poll_interval_s: float = 5.0,
        checkpoints_s3: str | None = None,
        aws_conn_id: str | None = None,
        change_tick_s: float = CHANGE_TICK_S,
    ):
        super().__init__()
        self.backend = backend
        self.handle = handle
        self.run_dir = run_dir
        self.final_step = final_step
        self.stall_timeout_s = stall_timeout_s
        self.launched_at = launched_at
        self.poll_interval_s = poll_interval_s
        self.checkpoints_s3 = checkpoints_s3
        self.aws_conn_id = aws_conn_id
        self.change_tick_s = change_tick_s

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "backend": self.backend,
                "handle": self.handle,
                "run_dir": self.run_dir,
                "final_step": self.final_step,
                "stall_timeout_s": self.stall_timeout_s,
                "launched_at": self.launched_at,
                "poll_interval_s": self.poll_interval_s,
                "checkpoints_s3": self.checkpoints_s3,
                "aws_conn_id": self.aws_conn_id,
                "change_tick_s": self.change_tick_s,
            },
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        backend = get_backend(**self.backend)
        handle = JobHandle.from_dict(self.handle)
        changes = None
        if self.change_tick_s > 0 and not self.checkpoints_s3:
            # Before the first check: what is appended or rewritten after it is then seen.
            changes = await asyncio.to_thread(
                LaunchChanges, self.run_dir, handle.launch_id, backend.change_paths(handle)
            )
        while True:
            # The job's state first (the backend's async client where it has one: the EKS
            # backend's AsyncKubernetesHook), then the checkpoint (a file or S3 read: off the event
            # loop); judge_progress says why in that order.
            status = await backend.status_async(handle)
            latest = await asyncio.to_thread(latest_checkpoint, self.run_dir, self.checkpoints_s3, self.aws_conn_id)
            progress = judge_progress(
                status,
                latest,
                handle,
                final_step=self.final_step,
                stall_timeout_s=self.stall_timeout_s,
                launched_at=self.launched_at,
            )
            ended, waiting = waiting_verdict(progress, changes.waiting if changes is not None else None)
            progress = ended or progress
            if progress.outcome is not None:
                yield trigger_event(SUCCESS if progress.outcome == PROGRESS_SUCCESS else FAILURE, **progress.to_dict())
                return
            self.log.info("%s", waiting or progress.message)
            await self._until_next_check(changes)

    async def _until_next_check(self, changes: LaunchChanges | None) -> None:
        await until_next_check(changes, self.poll_interval_s, self.change_tick_s, self.log)
