"""The wait for an FSx for Lustre data repository task, from the triggerer."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, AsyncIterator

from airflow.triggers.base import BaseTrigger, TriggerEvent

from fsdp_resilience.control.triggers.base import FAILURE, SUCCESS, event_payload, trigger_event

if TYPE_CHECKING:
    from fsdp_resilience.control.hooks.fsx import FsxHook


class FsxDataRepositoryTaskTrigger(BaseTrigger):
    """Fires once, when data repository task ``task_id`` has ended: ``{"status": "success" |
    "failure", "message": ..., "task": task_summary or None}``.

    Stateless between polls, so a restarted triggerer resumes it as it was. The sync hook runs in
    a thread (``asyncio.to_thread``): connection lookup and botocore block, and the triggerer's
    event loop must not.
    """

    def __init__(
        self,
        *,
        task_id: str,
        file_system_id: str,
        aws_conn_id: str | None = "aws_default",
        region_name: str | None = None,
        poll_interval_s: float = 30.0,
    ):
        super().__init__()
        self.task_id = task_id
        self.file_system_id = file_system_id
        self.aws_conn_id = aws_conn_id
        self.region_name = region_name
        self.poll_interval_s = poll_interval_s

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "task_id": self.task_id,
                "file_system_id": self.file_system_id,
                "aws_conn_id": self.aws_conn_id,
                "region_name": self.region_name,
                "poll_interval_s": self.poll_interval_s,
            },
        )

    def _hook(self) -> "FsxHook":
        from fsdp_resilience.control.hooks.fsx import FsxHook

        return FsxHook(aws_conn_id=self.aws_conn_id, region_name=self.region_name)

    async def run(self) -> AsyncIterator[TriggerEvent]:
        hook = await asyncio.to_thread(self._hook)  # first, so boto3 is imported off the event loop
        from fsdp_resilience.control.fsx import RUNNING, FsxStagingError, task_outcome, task_summary

        while True:
            try:
                task = await asyncio.to_thread(hook.describe_task, self.task_id)
            except FsxStagingError as e:
                if not e.retryable:
                    yield trigger_event(FAILURE, str(e), task=None)
                    return
                self.log.warning("%s; polling again in %ss", e, self.poll_interval_s)
            else:
                status, message = task_outcome(task)
                if status != RUNNING:
                    yield TriggerEvent(task_event(status, message, task_summary(task)))
                    return
                self.log.info("%s", message)
            await asyncio.sleep(self.poll_interval_s)


def task_event(status: str, message: str, summary: dict[str, Any] | None) -> dict[str, Any]:
    """The event of an ended data repository task (``fsx.task_outcome``'s status and message, and
    its ``task_summary``): status ``success`` or ``failure``."""
    from fsdp_resilience.control.fsx import SUCCEEDED

    return event_payload(SUCCESS if status == SUCCEEDED else FAILURE, message, task=summary)
