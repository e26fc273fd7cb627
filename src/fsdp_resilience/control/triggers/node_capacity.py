"""The wait for node capacity, from the triggerer: fires when the backend can place a launch's nodes."""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator

from airflow.triggers.base import BaseTrigger, TriggerEvent

from fsdp_resilience.control.backends import Capacity, get_backend
from fsdp_resilience.control.triggers.base import SUCCESS, TIMEOUT, event_payload


class NodeCapacityTrigger(BaseTrigger):
    """Fires once the backend's node pool can take a job of ``nodes`` nodes (enough healthy,
    schedulable nodes, or a platform that provisions on demand), or after ``timeout_s`` with the
    capacity last seen (``capacity_event``: status ``success`` or ``timeout``). Stateless like the
    progress trigger: it only polls ``capacity()``."""

    def __init__(
        self, *, backend: dict[str, Any], nodes: int, timeout_s: float, started_at: float, poll_interval_s: float = 10.0
    ):
        super().__init__()
        self.backend = backend
        self.nodes = nodes
        self.timeout_s = timeout_s
        self.started_at = started_at
        self.poll_interval_s = poll_interval_s

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "backend": self.backend,
                "nodes": self.nodes,
                "timeout_s": self.timeout_s,
                "started_at": self.started_at,
                "poll_interval_s": self.poll_interval_s,
            },
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        backend = get_backend(**self.backend)
        while True:
            capacity = await asyncio.to_thread(backend.capacity)  # a few API calls: off the loop
            waited = time.time() - self.started_at
            if capacity.fits(self.nodes) or waited > self.timeout_s:
                yield TriggerEvent(capacity_event(capacity, self.nodes, waited))
                return
            self.log.info(
                "%d of %d node(s) healthy; %d needed (out of service: %s)",
                capacity.healthy,
                capacity.total,
                self.nodes,
                capacity.quarantined,
            )
            await asyncio.sleep(self.poll_interval_s)


def capacity_event(capacity: Capacity, nodes: int, waited_s: float) -> dict[str, Any]:
    """What the capacity wait saw: status ``success`` when ``capacity`` fits ``nodes`` nodes, else
    ``timeout``; ``waited_s`` and ``capacity`` (``Capacity.to_dict()``)."""
    message = (
        f"{capacity.healthy} of {capacity.total} node(s) healthy, out of service {capacity.quarantined}, "
        f"after {round(waited_s, 1)}s"
    )
    return event_payload(
        SUCCESS if capacity.fits(nodes) else TIMEOUT, message, waited_s=round(waited_s, 1), capacity=capacity.to_dict()
    )
