"""Whether the survivors of a lost node wait for a replacement: what the control plane announces
(``control/membership-deadline.json``) and which launchers are alive (``control/launchers/``).

A node loss that a parked spare covers is the rendezvous' business. One that no spare covers ends
the launch within seconds, so the ladder relaunches, unless the control plane announced that a
replacement is on its way (the pool keeper started a new spare; on EKS, capacity exists for the
pod the Job recreates) and until when it may take. Nothing announced, or the time passed: nothing
is coming. The rendezvous' own ``join_timeout`` stays only as the outer bound.

The newest word wins (one file, rewritten): a replacement announced for spares that have since
started (their launchers beat after the announcement) is spent, so a later loss does not wait for
it. While the pool keeper watches a launch with node replacements left, it renews a standing
notice (``announce_keeper_watching``, a minute ahead): it bridges the seconds between a loss and
the keeper's word on it, so survivors do not end a launch the keeper is about to rescue, and it
lapses by itself when the keeper stops.

Launchers beat (``beat_launcher``: one small file per node, rewritten every poll) so that the
others can tell a node that is gone, or hangs, from one that is merely slow to rejoin. A beat is a
create and a rename, with no fsync (it is worthless after a crash): on FSx for Lustre a few
metadata operations a second per node, far below what one metadata server serves. The beats are
read only while a node's workers are down or a fault is pending.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdp_resilience.training.contract.files import atomic_write_text

#: A launcher whose beat is older than this is gone (lost, or hanging). Launchers beat every
#: second; a loaded node may miss a few.
LAUNCHER_STALE_S = 5.0


def deadline_path(control: Path) -> Path:
    return control / "membership-deadline.json"


def launchers_dir(control: Path) -> Path:
    return control / "launchers"


@dataclass(frozen=True)
class MembershipDeadline:
    """What the control plane announced for a launch: a replacement is coming until ``until``
    (unix seconds), or none is (``coming`` false); ``why`` in words, for the events log.
    ``node_ranks``: the spares announced (their launchers' node indexes, when known); ``ts``: when
    it was written; ``standing``: the keeper's standing notice, not a word on a given loss."""

    launch_id: str
    coming: bool
    until: float | None
    why: str
    nodes: tuple[str, ...] = ()
    node_ranks: tuple[int, ...] = ()
    ts: float = 0.0
    standing: bool = False

    def wait_until(self, now: float | None = None, beats: dict[int, float] | None = None) -> float | None:
        """Until when the survivors wait, or None when nothing is coming (any more): nothing was
        announced, the deadline passed, or the spares announced have come (``beats``: when each
        launcher last beat, ``launcher_beats``), so a later loss has nothing to wait for."""
        now = time.time() if now is None else now
        if not self.coming or self.until is None or self.until <= now:
            return None
        if self.node_ranks and beats is not None and all(beats.get(r, 0.0) >= self.ts for r in self.node_ranks):
            return None
        return self.until


def announce_replacement(
    control: Path,
    launch_id: str,
    *,
    until: float,
    why: str,
    nodes: list[str] = (),
    node_ranks: list[int] = (),
) -> bool:
    """A replacement for a lost node of ``launch_id`` is on its way (the spares ``node_ranks``):
    wait for it until ``until``. False when the run dir is not there (not mounted here): nothing
    is announced, and survivors do not wait."""
    return _write(control, MembershipDeadline(launch_id, True, float(until), why, tuple(nodes), tuple(node_ranks)))


def announce_keeper_watching(control: Path, launch_id: str, *, until: float, why: str) -> bool:
    """The pool keeper watches ``launch_id`` and can still add a spare: a loss no spare covers is
    waited for until ``until`` (renewed while the keeper runs), by when the keeper has its word on
    it (``announce_replacement`` or ``announce_no_replacement``)."""
    return _write(control, MembershipDeadline(launch_id, True, float(until), why, standing=True))


def announce_no_replacement(control: Path, launch_id: str, *, why: str) -> bool:
    """Nothing more is coming for ``launch_id`` (replacements used up, no capacity, the keeper
    gone). A spare announced earlier that has not come yet stays announced: survivors still wait
    for it, until its deadline. False when nothing was written (that, or no run dir here)."""
    earlier = read_membership_deadline(control, launch_id)
    if (
        earlier is not None
        and not earlier.standing
        and earlier.wait_until(beats=launcher_beats(control, launch_id)) is not None
    ):
        return False
    return _write(control, MembershipDeadline(launch_id, False, None, why))


def _write(control: Path, deadline: MembershipDeadline) -> bool:
    if not control.parent.is_dir():  # the run dir is not readable here: never create a stand-in
        return False
    control.mkdir(exist_ok=True)
    record = {
        "launch_id": deadline.launch_id,
        "coming": deadline.coming,
        "until": deadline.until,
        "why": deadline.why,
        "nodes": list(deadline.nodes),
        "node_ranks": list(deadline.node_ranks),
        "standing": deadline.standing,
        "ts": time.time(),
    }
    atomic_write_text(deadline_path(control), json.dumps(record) + "\n")
    return True


def read_membership_deadline(control: Path, launch_id: str) -> MembershipDeadline | None:
    """What was announced for ``launch_id``; None when nothing was (or for another launch, or the
    file cannot be read: then nothing is known to be coming)."""
    try:
        data = json.loads(deadline_path(control).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("launch_id", "") != launch_id:
        return None
    until = data.get("until")
    return MembershipDeadline(
        launch_id=launch_id,
        coming=data.get("coming") is True,
        until=float(until) if isinstance(until, (int, float)) else None,
        why=str(data.get("why") or ""),
        nodes=tuple(str(n) for n in data.get("nodes") or ()),
        node_ranks=tuple(int(r) for r in data.get("node_ranks") or () if isinstance(r, int)),
        ts=float(data["ts"]) if isinstance(data.get("ts"), (int, float)) else 0.0,
        standing=data.get("standing") is True,
    )


def beat_launcher(control: Path, node_rank: int, **state: Any) -> None:
    """This node's launcher is alive (and ``state``: its launch id, whether it is a parked spare)."""
    folder = launchers_dir(control)
    folder.mkdir(parents=True, exist_ok=True)
    record = {"node_rank": node_rank, "pid": os.getpid(), "ts": time.time(), **state}
    atomic_write_text(folder / f"node{node_rank}.json", json.dumps(record) + "\n", durable=False)


def launcher_beats(control: Path, launch_id: str) -> dict[int, float]:
    """When each launcher of ``launch_id`` last beat (unix seconds), by node index."""
    beats = {}
    for path in sorted(launchers_dir(control).glob("node*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if (
            isinstance(record, dict)
            and record.get("launch_id", "") == launch_id
            and isinstance(record.get("ts"), (int, float))
            and isinstance(record.get("node_rank"), int)
        ):
            beats[record["node_rank"]] = float(record["ts"])
    return beats
