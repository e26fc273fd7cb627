"""``MembershipWatch``: how long a training node waits for a lost node's replacement.

After a node loss ft_launcher stops this node's workers and waits in the rendezvous for a full
round. A parked spare completes it in seconds. With no spare left the wait lasts until the
rendezvous' ``join_timeout`` (600 s), unless something ends it: this watch, polled by the node's
launcher, ends the launch as soon as it is clear that nothing is coming (control plane's word,
``contract.replacements``), and logs ``waiting_for_nodes`` either way.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable

from fsdp_resilience.training.contract import Event, EventLog, RunDir
from fsdp_resilience.training.contract.replacements import (
    beat_launcher,
    live_launchers,
    read_membership_deadline,
)

#: How long this node's workers must have been down before the watch looks at the membership: an
#: in-job restart with every node present has them back in a few seconds.
WORKERS_DOWN_S = 3.0


class MembershipWatch:
    """Polled once a second by a node's launcher (``poll``): beats for this node, and returns why
    the launch must end when its workers are down, nodes of the training membership are gone, no
    parked spare covers them, and no replacement is announced (or its deadline passed)."""

    def __init__(
        self,
        layout: RunDir,
        events: EventLog,
        launch_id: str,
        node_rank: int,
        *,
        standby: bool,
        workers_alive: Callable[[], bool],
    ):
        self.layout, self.events, self.launch_id, self.node_rank = layout, events, launch_id, node_rank
        self.standby = standby
        self.workers_alive = workers_alive
        self.trained = False  # this node's workers ran in this launch
        self.down_since: float | None = None
        self.announced: tuple | None = None  # what the last waiting_for_nodes said

    def poll(self, now: float | None = None) -> str | None:
        now = time.time() if now is None else now
        beat_launcher(self.layout.control, self.node_rank, launch_id=self.launch_id, standby=self.standby)
        if self.workers_alive():
            self.trained, self.down_since, self.announced = True, None, None
            return None
        if not self.trained:
            return None  # a parked spare, or a node that never trained: nothing to decide
        self.down_since = self.down_since or now
        if now - self.down_since < WORKERS_DOWN_S:
            return None
        members = self._members()
        alive = live_launchers(self.layout.control, self.launch_id, now)
        missing = [(rank, node) for rank, node in members if rank not in alive and rank != self.node_rank]
        if not missing:
            return None  # every node is there: a slow round, not a loss
        spares = [rank for rank in alive if rank not in {r for r, _ in members}]
        if len(spares) >= len(missing):
            return None  # parked spares take the lost nodes' places in the rendezvous
        deadline = read_membership_deadline(self.layout.control, self.launch_id)
        until = deadline.wait_until(now) if deadline is not None else None
        uncovered = len(missing) - len(spares)
        if until is not None:
            why = f"a replacement is coming: {deadline.why}"
        elif deadline is not None:
            why = f"no replacement is coming: {deadline.why}" + (" (its deadline passed)" if deadline.coming else "")
        else:
            why = "no spare left and no replacement announced (control/membership-deadline.json)"
        said = (tuple(missing), until)
        if said != self.announced:
            self.announced = said
            self.events.emit(
                Event.WAITING_FOR_NODES,
                missing=uncovered,
                nodes=[node for _, node in missing],
                missing_node_ranks=[rank for rank, _ in missing],
                until=until,
                why=why,
            )
        if until is not None:
            return None
        lost = ", ".join(f"{node} (node {rank})" for rank, node in missing)
        return f"node(s) {lost} lost and no spare left to take their place; {why}"

    def _members(self) -> list[tuple[int, str]]:
        """(node index, node id) of every node training in the newest attempt of this launch."""
        try:
            record: Any = json.loads(self.layout.membership.read_text())
        except (OSError, ValueError):
            return []
        if not isinstance(record, dict) or record.get("launch_id", "") != self.launch_id:
            return []
        return sorted({(int(rank), str(node)) for rank, node in record.get("members") or []})
