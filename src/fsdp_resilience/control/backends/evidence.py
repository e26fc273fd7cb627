"""What a backend reads from the run dir to judge a job: which node(s) to blame when restarts ran
out, and why a running job was stopped. Shared by every backend, since every backend's nodes
write the same run contract (``src/fsdp_resilience/training/contract/``: events log, checkpoint catalog).

Torch-free: the control plane imports this module.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Iterator

from fsdp_resilience.control.backends.base import JobStatus
from fsdp_resilience.training.contract import CheckpointCatalog, Event, FailureClass, read_events

#: A fault_detected error with one of these comes from a peer's failure (a collective or the
#: network gave up waiting), so it does not blame the node that logged it (as
#: src/fsdp_resilience/training/restart/fault_kinds.py).
PEER_SYMPTOMS = (
    "gloo",
    "nccl",
    "connection",
    "timed out",
    "timeout",
    "socket",
    "peer",
    "broken pipe",
    "rendezvous",
    "store",
)
#: fault_detected's ``failure_class`` when the fault points at the machine (older logs have none).
MACHINE_FAULT_CLASSES = (None, FailureClass.RESTARTS_EXHAUSTED.value)
#: Drills that fake a fault of the code or the data, not of the machine they fire on.
NOT_MACHINE_DRILLS = ("nan", "user_bug")


def when(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def _launch_records(run_dir: str | Path, launch_id: str, event: Event) -> Iterator[dict[str, Any]]:
    """The ``event`` records of one launch that name their node. Parses only the lines that can be
    one, so polling stays cheap on a long run's events log."""
    needle = json.dumps(launch_id)  # as it appears in the line, quotes and escapes included
    marker = json.dumps(event.value)
    try:
        with open(Path(run_dir) / "events.jsonl", errors="replace") as f:
            for line in f:
                if marker not in line or needle not in line:
                    continue
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # a torn line
                if (
                    isinstance(rec, dict)
                    and rec.get("event") == event.value
                    and rec.get("launch_id") == launch_id
                    and isinstance(rec.get("node_rank"), int)
                ):
                    yield rec
    except FileNotFoundError:
        return


def final_events(run_dir: str | Path, launch_id: str) -> dict[int, dict[str, Any]]:
    """node rank -> its launcher's ``final`` event for this launch."""
    return {rec["node_rank"]: rec for rec in _launch_records(run_dir, launch_id, Event.FINAL)}


def trained_nodes(run_dir: str | Path, launch_id: str) -> set[int]:
    """Node indices (as launched) whose workers began training in this launch: a ``train_begin``
    of this launch id from a rank on that node. How a spare that stood by is told from one that
    took a lost node's place."""
    return {rec["node_rank"] for rec in _launch_records(run_dir, launch_id, Event.TRAIN_BEGIN)}


def blame_from_events(
    run_dir: str | Path, launch_id: str, status: JobStatus, node_ids: list[str]
) -> tuple[list[str], list[str]]:
    """The node(s) to blame for restarts running out (or no progress), and why.

    Worker events carry no launch id, so this launch's events are those from its first
    ``launch_begin`` up to the next launch's. In order of trust: drills that fired (ground
    truth; a ``nan`` or ``user_bug`` drill fakes the data or the code, not the machine); faults a
    rank detected that are not a peer's symptom (a collective that timed out blames whoever it
    waited for, not the node that logged it) and point at the machine — if every one points at a
    file, the storage, the data or the code (their ``failure_class``), nobody is blamed; else the
    nodes whose launcher reported the failure; else every node of the job (the share rule keeps
    that in check).
    """
    events = read_events(Path(run_dir) / "events.jsonl")
    begins = [r["ts"] for r in events if r.get("event") == Event.LAUNCH_BEGIN.value and r.get("launch_id") == launch_id]
    if begins:
        start = min(begins)
        later = [
            r["ts"]
            for r in events
            if r.get("event") == Event.LAUNCH_BEGIN.value and r.get("launch_id") != launch_id and r["ts"] > start
        ]
        end = min(later, default=float("inf"))
        window = [r for r in events if start <= r.get("ts", 0) < end and r.get("node_id") in node_ids]
    else:
        window = []

    def summary(rs: list[dict[str, Any]]) -> list[str]:
        return [
            f"{r['node_id']}: {r['event']} {r.get('kind')} at step {r.get('step')} "
            f"(rank {r.get('rank')}, attempt {r.get('attempt')})"
            + (f": {str(r['error'])[:200]}" if r.get("error") else "")
            for r in rs[:20]
        ]

    injected = [
        r for r in window if r.get("event") == Event.FAULT_INJECTED.value and r.get("kind") not in NOT_MACHINE_DRILLS
    ]
    if injected:
        bad = sorted({r["node_id"] for r in injected})
        return bad, [f"faults injected in this launch on {bad}:"] + summary(injected)
    detected = [r for r in window if r.get("event") == Event.FAULT_DETECTED.value]
    machine = [
        r
        for r in detected
        if r.get("failure_class") in MACHINE_FAULT_CLASSES
        and not any(m in f"{r.get('kind', '')} {r.get('error', '')}".lower() for m in PEER_SYMPTOMS)
    ]
    if machine:
        bad = sorted({r["node_id"] for r in machine})
        return bad, [f"faults detected in this launch on {bad} (not a peer's symptom):"] + summary(machine)
    elsewhere = [r for r in detected if r.get("failure_class") not in MACHINE_FAULT_CLASSES]
    if elsewhere:
        # They point at a file, the storage, the data or the code: another machine would read the
        # same file and fail the same way, so no node is blamed.
        classes = sorted({str(r.get("failure_class")) for r in elsewhere})
        return [], [
            f"the faults detected in this launch point at {', '.join(classes)}, not at a machine: no node is blamed"
        ] + summary(elsewhere)
    reporting = sorted({n.node_id for n in status.nodes if n.failure_class == status.failure_class and n.node_id})
    if reporting:
        return reporting, [
            f"no fault events name a node; the launcher(s) on {reporting} reported {status.failure_class}"
        ]
    return sorted(node_ids), [f"no events name a node; every node of the job is suspect: {sorted(node_ids)}"]


def verdict_at_cancel(
    run_dir: str | Path, launched_at: float, stall_timeout_s: float, state: str, now: float | None = None
) -> dict[str, Any]:
    """Why a running job is being stopped, as far as the backend can tell: a stall (no new committed
    checkpoint for ``stall_timeout_s`` since the launch or the last commit, the watch's rule), or
    simply a cancel. ``{"at", "failure_class", "message"}``."""
    now = time.time() if now is None else now
    latest = CheckpointCatalog(run_dir).latest()
    last_progress = max(launched_at, (latest.committed_at or 0.0) if latest else 0.0)
    idle = now - last_progress
    if idle > stall_timeout_s:
        newest = latest.checkpoint_id if latest else "none"
        return {
            "at": now,
            "failure_class": FailureClass.NO_PROGRESS.value,
            "message": f"cancelled after no new committed checkpoint for {idle:.0f}s "
            f"(stall_timeout_s={stall_timeout_s:.0f}; newest: {newest})",
        }
    return {
        "at": now,
        "failure_class": FailureClass.UNKNOWN.value,
        "message": f"cancelled at {when(now)} while {state}",
    }
