"""Whether the survivors of a lost node wait for a replacement: what the control plane announces
(``control/membership-deadline.json``) and which launchers are alive (``control/launchers/``).

A node loss that a parked spare covers is the rendezvous' business. One that no spare covers ends
the launch within seconds, so the ladder relaunches, unless the control plane announced that a
replacement is on its way (the pool keeper started a new spare; on EKS, capacity exists for the
pod the Job recreates) and until when it may take. Nothing announced, or the time passed: nothing
is coming. The rendezvous' own ``join_timeout`` stays only as the outer bound.

Launchers beat (``beat_launcher``: one small file per node, rewritten every poll) so that the
others can tell a node that is gone, or hangs, from one that is merely slow to rejoin.
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
    (unix seconds), or none is (``coming`` false); ``why`` in words, for the events log."""

    launch_id: str
    coming: bool
    until: float | None
    why: str
    nodes: tuple[str, ...] = ()

    def wait_until(self, now: float | None = None) -> float | None:
        """Until when the survivors wait, or None when nothing is coming (any more)."""
        now = time.time() if now is None else now
        if not self.coming or self.until is None or self.until <= now:
            return None
        return self.until


def announce_replacement(control: Path, launch_id: str, *, until: float, why: str, nodes: list[str] = ()) -> None:
    """A replacement for a lost node of ``launch_id`` is on its way: wait for it until ``until``."""
    _write(control, MembershipDeadline(launch_id, True, float(until), why, tuple(nodes)))


def announce_no_replacement(control: Path, launch_id: str, *, why: str) -> None:
    """Nothing is coming for ``launch_id`` (replacements used up, no capacity, the keeper gone)."""
    _write(control, MembershipDeadline(launch_id, False, None, why))


def _write(control: Path, deadline: MembershipDeadline) -> None:
    control.mkdir(parents=True, exist_ok=True)
    record = {
        "launch_id": deadline.launch_id,
        "coming": deadline.coming,
        "until": deadline.until,
        "why": deadline.why,
        "nodes": list(deadline.nodes),
        "ts": time.time(),
    }
    atomic_write_text(deadline_path(control), json.dumps(record) + "\n")


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
    )


def beat_launcher(control: Path, node_rank: int, **state: Any) -> None:
    """This node's launcher is alive (and ``state``: its launch id, whether it is a parked spare)."""
    folder = launchers_dir(control)
    folder.mkdir(parents=True, exist_ok=True)
    record = {"node_rank": node_rank, "pid": os.getpid(), "ts": time.time(), **state}
    atomic_write_text(folder / f"node{node_rank}.json", json.dumps(record) + "\n")


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
