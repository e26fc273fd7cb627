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
from pathlib import Path
from typing import Any, Callable

from fsdp_resilience.training.contract import Event, EventLog, RunDir, read_events_since
from fsdp_resilience.training.contract.replacements import (
    LAUNCHER_STALE_S,
    beat_launcher,
    launcher_beats,
    read_membership_deadline,
)

#: How long this node's workers must have been down before the watch looks at the membership: an
#: in-job restart with every node present has them back in a few seconds.
WORKERS_DOWN_S = 3.0


class MembershipWatch:
    """Polled once a second by a node's launcher (``poll``): beats for this node, and returns why
    the launch must end when nodes of the training membership are gone (their launchers stopped
    beating), no parked spare covers them, and no replacement is announced (or its deadline
    passed).

    It looks once this node's workers are down (they wait in the rendezvous), or at once when a
    rank of the launch logged a fault after a gone node's last beat: the survivors' in-process
    layer otherwise holds its ranks until its heartbeat timeout (``hang_timeout_s``, 60 s by
    default) before it gives up on a peer that is gone for good."""

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
        self.fault_ts: float | None = None  # a fault of this launch that training has not got past
        self.events_offset = _size(layout.events)  # what came before this launcher is not its

    def poll(self, now: float | None = None) -> str | None:
        now = time.time() if now is None else now
        beat_launcher(self.layout.control, self.node_rank, launch_id=self.launch_id, standby=self.standby)
        self._read_events()
        if self.workers_alive():
            self.trained, self.down_since = True, None
        elif self.trained:
            self.down_since = self.down_since or now
        if not self.trained:
            return None  # a parked spare, or a node that never trained: nothing to decide
        down = self.down_since is not None and now - self.down_since >= WORKERS_DOWN_S
        if not down and self.fault_ts is None:
            self.announced = None
            return None
        members = self._members()
        beats = launcher_beats(self.layout.control, self.launch_id)
        missing = [
            (rank, node)
            for rank, node in members
            if rank != self.node_rank
            and now - beats.get(rank, 0.0) > LAUNCHER_STALE_S
            and (down or beats.get(rank, 0.0) < (self.fault_ts or 0.0))  # gone before the fault
        ]
        if not missing:
            return None  # every node is there: a slow round or a rank's fault, not a loss
        member_ranks = {rank for rank, _ in members}
        spares = [rank for rank, ts in beats.items() if rank not in member_ranks and now - ts <= LAUNCHER_STALE_S]
        if len(spares) >= len(missing):
            return None  # parked spares take the lost nodes' places in the rendezvous
        deadline = read_membership_deadline(self.layout.control, self.launch_id)
        until = deadline.wait_until(now, beats) if deadline is not None else None
        if until is not None:
            why = f"a replacement is coming: {deadline.why}"
        elif deadline is not None and deadline.coming:
            spent = deadline.until is not None and deadline.until > now  # the spares announced came
            why = f"no replacement is coming: {deadline.why} ({'it came' if spent else 'its deadline passed'})"
        elif deadline is not None:
            why = f"no replacement is coming: {deadline.why}"
        else:
            why = "no spare left and no replacement announced (control/membership-deadline.json)"
        # Said again when what is awaited changes; not for each renewal of the keeper's notice.
        said = (tuple(missing), why, None if deadline is not None and deadline.standing else until)
        if said != self.announced:
            self.announced = said
            self.events.emit(
                Event.WAITING_FOR_NODES,
                missing=len(missing) - len(spares),
                nodes=[node for _, node in missing],
                missing_node_ranks=[rank for rank, _ in missing],
                until=until,
                why=why,
            )
        if until is not None:
            return None
        lost = ", ".join(f"{node} (node {rank})" for rank, node in missing)
        return f"node(s) {lost} lost and no spare left to take their place; {why}"

    def _read_events(self) -> None:
        """Follow the launch's faults: the newest ``fault_detected`` of this launch, until training
        got past it (a ``train_begin`` or ``step`` after it)."""
        records, self.events_offset = read_events_since(self.layout.events, self.events_offset)
        for record in records:
            if record.get("launch_id", "") != self.launch_id:
                continue
            event = record.get("event")
            if event == Event.FAULT_DETECTED.value:
                self.fault_ts = float(record.get("ts") or 0.0)
            elif event in (Event.TRAIN_BEGIN.value, Event.STEP.value) and self.fault_ts is not None:
                if float(record.get("ts") or 0.0) > self.fault_ts:
                    self.fault_ts = None

    def _members(self) -> list[tuple[int, str]]:
        """(node index, node id) of every node training in the newest attempt of this launch."""
        try:
            record: Any = json.loads(self.layout.membership.read_text())
        except (OSError, ValueError):
            return []
        if not isinstance(record, dict) or record.get("launch_id", "") != self.launch_id:
            return []
        return sorted({(int(rank), str(node)) for rank, node in record.get("members") or []})


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
