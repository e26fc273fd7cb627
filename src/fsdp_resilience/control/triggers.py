"""Deferrable triggers: watch a training launch, watch its nodes for one a spare must stand in for,
and wait for node capacity, from the triggerer, holding no worker slot."""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator

from airflow.triggers.base import BaseTrigger, TriggerEvent

from fsdp_resilience.control.backends import LOST, JobHandle, JobStatus, get_backend
from fsdp_resilience.control.progress import CHANGE_TICK_S, LaunchChanges, judge_progress, latest_checkpoint


class TrainingProgressTrigger(BaseTrigger):
    """Fires once when the launch succeeded (final step committed), failed (with the run
    contract's failure class), or made no progress for ``stall_timeout_s``.

    It checks the launch every ``poll_interval_s``, and in between looks every ``change_tick_s``
    for what says the launch has ended (``LaunchChanges``: a launcher's ``final`` event, a lost
    node in the backend's job record), so an ended launch is seen in a fraction of a second, not
    at the next poll. That look only stats files and reads appended lines. Without the run dir
    here (``checkpoints_s3``: read from its S3 export), or with ``change_tick_s=0``, only the poll.

    Small and serialisable: everything it needs is in its kwargs, and it keeps no state between
    polls (see ``fsdp_resilience.control.progress``), so a restarted triggerer resumes it as it was.
    """

    def __init__(self, *, backend: dict[str, Any], handle: dict[str, Any], run_dir: str, final_step: int,
                 stall_timeout_s: float, launched_at: float, poll_interval_s: float = 5.0,
                 checkpoints_s3: str | None = None, aws_conn_id: str | None = None,
                 change_tick_s: float = CHANGE_TICK_S):
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
        return (f"{type(self).__module__}.{type(self).__qualname__}", {
            "backend": self.backend, "handle": self.handle, "run_dir": self.run_dir,
            "final_step": self.final_step, "stall_timeout_s": self.stall_timeout_s,
            "launched_at": self.launched_at, "poll_interval_s": self.poll_interval_s,
            "checkpoints_s3": self.checkpoints_s3, "aws_conn_id": self.aws_conn_id,
            "change_tick_s": self.change_tick_s,
        })

    async def run(self) -> AsyncIterator[TriggerEvent]:
        backend = get_backend(**self.backend)
        handle = JobHandle.from_dict(self.handle)
        changes = None
        if self.change_tick_s > 0 and not self.checkpoints_s3:
            # Before the first check: what is appended or rewritten after it is then seen.
            changes = await asyncio.to_thread(LaunchChanges, self.run_dir, handle.launch_id,
                                              backend.change_paths(handle))
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
            await self._until_next_check(changes)

    async def _until_next_check(self, changes: LaunchChanges | None) -> None:
        await until_next_check(changes, self.poll_interval_s, self.change_tick_s, self.log)


async def until_next_check(changes: LaunchChanges | None, poll_interval_s: float, change_tick_s: float,
                           log: Any) -> None:
    """Wait out the poll interval, or less: until ``changes`` says the launch may have changed (a
    ``final`` event, a rewritten job file)."""
    if changes is None:
        await asyncio.sleep(poll_interval_s)
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + poll_interval_s
    while (left := deadline - loop.time()) > 0:
        await asyncio.sleep(min(change_tick_s, left))
        why = await asyncio.to_thread(changes.poll)  # a stat on a network mount may block
        if why:
            log.info("checking now: %s", why)
            return


#: Node states that leave a running job short of a node the spare pool must make up for: a lost
#: node (a spare takes its place at the next in-job restart), or a node that ended by itself
#: while the job trains on (a spare dropped, e.g. by a failed health check).
OUT_OF_JOB = (LOST, "failed")


def nodes_to_handle(status: JobStatus, handled: list[str]) -> list[dict[str, Any]]:
    """The nodes of a running job that are out of it (``OUT_OF_JOB``) and not in ``handled``
    (``NodeStatus.key``s), as ``NodeStatus`` dicts with their ``key``. None once the job has
    ended: its launch is over."""
    if status.done:
        return []
    return [{**n.to_dict(), "key": n.key} for n in status.nodes if n.state in OUT_OF_JOB and n.key not in handled]


class SparePoolTrigger(BaseTrigger):
    """Fires once a running launch shows a node out of the job (lost, or a spare dropped) that is
    not in ``handled`` (``NodeStatus.key``s: index and machine, the nodes the spare pool keeper
    already dealt with), or once the launch
    has ended. The event: ``ended`` (bool), ``state`` and ``message`` (the job's), ``nodes`` (the
    nodes to handle, ``NodeStatus`` dicts) and ``handled`` (as given).

    Polls the job's status every ``poll_interval_s`` and, in between, looks for the changes the
    progress watch looks for (``LaunchChanges``: a launcher's ``final`` event, a rewritten job
    file, which is how the local backend shows a lost node). Stateless between polls like the
    progress trigger: a restarted triggerer resumes it from its kwargs."""

    def __init__(self, *, backend: dict[str, Any], handle: dict[str, Any], run_dir: str, handled: list[str],
                 poll_interval_s: float = 5.0, checkpoints_s3: str | None = None,
                 change_tick_s: float = CHANGE_TICK_S):
        super().__init__()
        self.backend = backend
        self.handle = handle
        self.run_dir = run_dir
        self.handled = sorted(str(k) for k in handled)
        self.poll_interval_s = poll_interval_s
        self.checkpoints_s3 = checkpoints_s3
        self.change_tick_s = change_tick_s

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{type(self).__module__}.{type(self).__qualname__}", {
            "backend": self.backend, "handle": self.handle, "run_dir": self.run_dir, "handled": self.handled,
            "poll_interval_s": self.poll_interval_s, "checkpoints_s3": self.checkpoints_s3,
            "change_tick_s": self.change_tick_s})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        backend = get_backend(**self.backend)
        handle = JobHandle.from_dict(self.handle)
        changes = None
        if self.change_tick_s > 0 and not self.checkpoints_s3:  # the run dir is readable here
            changes = await asyncio.to_thread(LaunchChanges, self.run_dir, handle.launch_id,
                                              backend.change_paths(handle))
        while True:
            status = await backend.status_async(handle)
            out = nodes_to_handle(status, self.handled)
            if status.done or out:
                yield TriggerEvent({"ended": status.done, "state": status.state, "message": status.message,
                                    "nodes": out, "handled": self.handled})
                return
            await until_next_check(changes, self.poll_interval_s, self.change_tick_s, self.log)


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
