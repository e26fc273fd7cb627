"""The spare pool's watch, from the triggerer: fires when a node of a running launch is out of
the job (a spare must stand in for it), or when the launch has ended."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any, AsyncIterator

from airflow.triggers.base import BaseTrigger, TriggerEvent

from fsdp_resilience.control.backends import LOST, JobHandle, JobStatus, get_backend
from fsdp_resilience.control.progress import CHANGE_TICK_S, LaunchChanges
from fsdp_resilience.control.triggers.base import LAUNCH_ENDED, NODES_OUT, trigger_event, until_next_check
from fsdp_resilience.training.contract import RunDir
from fsdp_resilience.training.contract.replacements import announce_keeper_watching

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
    already dealt with), or once the launch has ended. The event: status ``nodes_out_of_job`` or
    ``launch_ended``, ``state`` and ``message`` (the job's), ``nodes`` (the nodes to handle,
    ``NodeStatus`` dicts) and ``handled`` (as given).

    Polls the job's status every ``poll_interval_s`` and, in between, looks for the changes the
    progress watch looks for (``LaunchChanges``: a launcher's ``final`` event, a rewritten job
    file, which is how the local backend shows a lost node). Stateless between polls like the
    progress trigger: a restarted triggerer resumes it from its kwargs.

    ``standby_s`` > 0 (the keeper can still add a spare): at each poll it renews the keeper's
    standing notice in the run dir (``announce_keeper_watching``, ``standby_s`` ahead), so
    survivors of a loss no spare covers wait for the keeper's word on it instead of ending the
    launch first; it lapses within ``standby_s`` of the keeper stopping."""

    def __init__(
        self,
        *,
        backend: dict[str, Any],
        handle: dict[str, Any],
        run_dir: str,
        handled: list[str],
        poll_interval_s: float = 5.0,
        checkpoints_s3: str | None = None,
        change_tick_s: float = CHANGE_TICK_S,
        standby_s: float = 0.0,
        standby_why: str = "",
    ):
        super().__init__()
        self.backend = backend
        self.handle = handle
        self.run_dir = run_dir
        self.handled = sorted(str(k) for k in handled)
        self.poll_interval_s = poll_interval_s
        self.checkpoints_s3 = checkpoints_s3
        self.change_tick_s = change_tick_s
        self.standby_s = standby_s
        self.standby_why = standby_why

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "backend": self.backend,
                "handle": self.handle,
                "run_dir": self.run_dir,
                "handled": self.handled,
                "poll_interval_s": self.poll_interval_s,
                "checkpoints_s3": self.checkpoints_s3,
                "change_tick_s": self.change_tick_s,
                "standby_s": self.standby_s,
                "standby_why": self.standby_why,
            },
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        backend = get_backend(**self.backend)
        handle = JobHandle.from_dict(self.handle)
        changes = None
        if self.change_tick_s > 0 and not self.checkpoints_s3:  # the run dir is readable here
            changes = await asyncio.to_thread(
                LaunchChanges, self.run_dir, handle.launch_id, backend.change_paths(handle)
            )
        while True:
            if self.standby_s > 0 and not self.checkpoints_s3:  # the run dir is there to write to
                await asyncio.to_thread(
                    announce_keeper_watching,
                    RunDir(Path(self.run_dir)).control,
                    handle.launch_id,
                    until=time.time() + self.standby_s,
                    why=self.standby_why,
                )
            status = await backend.status_async(handle)
            out = nodes_to_handle(status, self.handled)
            if status.done or out:
                yield trigger_event(
                    LAUNCH_ENDED if status.done else NODES_OUT,
                    status.message,
                    state=status.state,
                    nodes=out,
                    handled=self.handled,
                )
                return
            await until_next_check(changes, self.poll_interval_s, self.change_tick_s, self.log)
