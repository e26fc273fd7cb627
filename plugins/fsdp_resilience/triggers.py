"""Deferrable triggers: watch a training launch, and wait for node capacity, from the triggerer,
holding no worker slot."""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator

from airflow.triggers.base import BaseTrigger, TriggerEvent

from fsdp_resilience.backends import JobHandle, get_backend
from fsdp_resilience.progress import judge_progress, latest_checkpoint


class TrainingProgressTrigger(BaseTrigger):
    """Fires once when the launch succeeded (final step committed), failed (with the run
    contract's failure class), or made no progress for ``stall_timeout_s``.

    Small and serialisable: everything it needs is in its kwargs, and it keeps no state between
    polls (see ``fsdp_resilience.progress``), so a restarted triggerer resumes it as it was.
    """

    def __init__(self, *, backend: dict[str, Any], handle: dict[str, Any], run_dir: str, final_step: int,
                 stall_timeout_s: float, launched_at: float, poll_interval_s: float = 5.0,
                 checkpoints_s3: str | None = None, aws_conn_id: str | None = None):
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

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{type(self).__module__}.{type(self).__qualname__}", {
            "backend": self.backend, "handle": self.handle, "run_dir": self.run_dir,
            "final_step": self.final_step, "stall_timeout_s": self.stall_timeout_s,
            "launched_at": self.launched_at, "poll_interval_s": self.poll_interval_s,
            "checkpoints_s3": self.checkpoints_s3, "aws_conn_id": self.aws_conn_id,
        })

    async def run(self) -> AsyncIterator[TriggerEvent]:
        backend = get_backend(**self.backend)
        handle = JobHandle.from_dict(self.handle)
        while True:
            # The job's state first (the backend's async client where it has one: the EKS
            # backend's AsyncKubernetesHook), then the checkpoint (a file or S3 read: off the event
            # loop); judge_progress says why in that order.
            status = await backend.status_async(handle)
            latest = await asyncio.to_thread(latest_checkpoint, self.run_dir, self.checkpoints_s3, self.aws_conn_id)
            progress = judge_progress(status, latest, handle, final_step=self.final_step,
                                      stall_timeout_s=self.stall_timeout_s, launched_at=self.launched_at)
            if progress.outcome is not None:
                yield TriggerEvent(progress.to_dict())
                return
            self.log.info("%s", progress.message)
            await asyncio.sleep(self.poll_interval_s)


class NodeCapacityTrigger(BaseTrigger):
    """Fires once the backend's node pool can take a job of ``nodes`` nodes (enough healthy,
    schedulable nodes, or a platform that provisions on demand), or after ``timeout_s`` with the
    capacity last seen. Stateless like the progress trigger: it only polls ``capacity()``."""

    def __init__(self, *, backend: dict[str, Any], nodes: int, timeout_s: float, started_at: float,
                 poll_interval_s: float = 10.0):
        super().__init__()
        self.backend = backend
        self.nodes = nodes
        self.timeout_s = timeout_s
        self.started_at = started_at
        self.poll_interval_s = poll_interval_s

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{type(self).__module__}.{type(self).__qualname__}", {
            "backend": self.backend, "nodes": self.nodes, "timeout_s": self.timeout_s,
            "started_at": self.started_at, "poll_interval_s": self.poll_interval_s})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        backend = get_backend(**self.backend)
        while True:
            capacity = await asyncio.to_thread(backend.capacity)  # a few API calls: off the loop
            waited = time.time() - self.started_at
            if capacity.fits(self.nodes) or waited > self.timeout_s:
                yield TriggerEvent({"ready": capacity.fits(self.nodes), "waited_s": round(waited, 1),
                                    "capacity": capacity.to_dict()})
                return
            self.log.info("%d of %d node(s) healthy; %d needed (out of service: %s)", capacity.healthy,
                          capacity.total, self.nodes, capacity.quarantined)
            await asyncio.sleep(self.poll_interval_s)
