"""The run dir: its layout (``RunDir``) and the records the ranks and launchers leave in it
besides the events log and the checkpoints: which nodes train (the membership record), the stop
marker (``declare_stop``, ``read_stop``, ``clear_stop``), the run's outcome (``final_status``) and whether a launch
ended (``launch_ended_by``)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from fsdp_resilience.training.contract.checkpoints import CHECKPOINT_PREFIX, QUARANTINE_DIR
from fsdp_resilience.training.contract.events import Event, EventLog, read_events
from fsdp_resilience.training.contract.failures import LAUNCH_ENDING_FAILURES, STOP_CLASSES, FailureClass
from fsdp_resilience.training.contract.files import atomic_write_text


class RunDir:
    """The layout of one run's folder (a local folder, or FSx for Lustre on EKS)::

    <run_dir>/
      run.json                 the config as launched
      events.jsonl             append-only events log (schema: EVENT_TYPES, one TypedDict per Event)
      eval.json                written by fsdp_resilience.training.evaluate
      timeouts.json            ft_launcher's timeouts as derived from the measured steps and
                               saves (DerivedTimeouts), by rank 0 at each derivation; run.json
                               keeps what was asked for
      control/STOP.json        written by the first rank that hits a fault no restart can fix
                               (user error, non-finite state, storage): every layer stops;
                               moved aside as STOP.cleared.<ms>.json once it no longer holds
      control/launch-node<N>.lock  held (flock) by the one fsdp_resilience.training.launch of node N
      control/membership.json  which nodes train in the newest attempt (with spares: rank 0)
      control/membership-deadline.json  the control plane's word on a lost node's replacement:
                               coming until T, or none (contract.replacements)
      control/launchers/node<N>.json  node N's launcher beat (rewritten every second)
      logs/                    launcher logs, one per node
      launches/<launch_id>.json the config of each (re)launch, written by the backend
      checkpoints/
        latest                 name of the newest committed checkpoint (atomic rename)
        latest_step            its step as a bare integer (NVRx 0.7's progress tracking reads it)
        step_00000010/         one DCP checkpoint: a shard file per rank + .metadata
          .sums/rank_00000.json each rank's shard files, sizes and CRC32C (its writer wrote them)
          COMMITTED.json       the commit marker, written last, by rank 0: every file's size
                               and CRC32C
        quarantine/step_00000020.<ts>/  a checkpoint that failed verification, moved aside with
          QUARANTINED.json     why (never loaded, never deleted by retention)
    """

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    config = property(lambda self: self.root / "run.json")
    events = property(lambda self: self.root / "events.jsonl")
    eval_result = property(lambda self: self.root / "eval.json")
    derived_timeouts = property(lambda self: self.root / "timeouts.json")
    control = property(lambda self: self.root / "control")
    stop_marker = property(lambda self: self.root / "control" / "STOP.json")
    membership = property(lambda self: self.root / "control" / "membership.json")
    logs = property(lambda self: self.root / "logs")
    launches = property(lambda self: self.root / "launches")
    checkpoints = property(lambda self: self.root / "checkpoints")
    latest_pointer = property(lambda self: self.root / "checkpoints" / "latest")
    latest_step = property(lambda self: self.root / "checkpoints" / "latest_step")
    quarantine = property(lambda self: self.root / "checkpoints" / QUARANTINE_DIR)

    def launch_lock(self, node_rank: int) -> Path:
        return self.control / f"launch-node{node_rank}.lock"

    def create(self) -> None:
        for d in (self.root, self.control, self.logs, self.checkpoints):
            d.mkdir(parents=True, exist_ok=True)

    def launch_config(self, launch_id: str) -> Path:
        return self.launches / f"{launch_id}.json"

    def checkpoint_dir(self, step: int) -> Path:
        return self.checkpoints / f"{CHECKPOINT_PREFIX}{step:08d}"


def record_membership(
    layout: RunDir, events: EventLog, launch_id: str, attempt: int, members: list[tuple[int, str]]
) -> list[dict[str, Any]]:
    """Record which nodes train in this attempt (``members``: (node index as launched, node id)
    of every rank) and emit ``spare_promoted`` for each node that trains now and did not in the
    attempt before of the same launch: a spare that took a lost node's place. Global rank 0 calls
    it once per attempt, after every rank joined the process group. Which launcher ends up a spare
    is decided by the rendezvous, not by its index, so this is observed, never assumed. Returns
    the events emitted."""
    now = sorted({(int(rank), str(node)) for rank, node in members})
    try:
        before = json.loads(layout.membership.read_text())
    except (OSError, ValueError):
        before = None
    emitted = []
    # Any earlier record of the same launch is the round before (on NVRx 0.4.1 a round that
    # replaces a lost node by a spare can be a membership change, which keeps the restart count).
    if isinstance(before, dict) and before.get("launch_id") == launch_id:
        previous = sorted({(int(rank), str(node)) for rank, node in before.get("members") or []})
        left = [m for m in previous if m not in now]
        for rank, node in (m for m in now if m not in previous):
            emitted.append(
                events.emit(
                    Event.SPARE_PROMOTED,
                    node_id=node,
                    node_rank=rank,
                    replaces=[n for _, n in left],
                    replaced_node_ranks=[r for r, _ in left],
                    members=[n for _, n in now],
                    previous_attempt=before.get("attempt"),
                )
            )
    try:
        layout.control.mkdir(parents=True, exist_ok=True)
        atomic_write_text(
            layout.membership,
            json.dumps({"launch_id": launch_id, "attempt": attempt, "members": now, "ts": time.time()}) + "\n",
        )
    except OSError as e:  # a full run dir: the next attempt compares with an older record
        print(f"[events] cannot record membership in {layout.membership}: {e}", file=sys.stderr, flush=True)
    return emitted


def declare_stop(layout: RunDir, failure: FailureClass, **record: Any) -> bool:
    """Record that the run must stop on every node and every restart layer (``STOP_CLASSES``).
    The first rank wins (the marker is linked into place whole, so it is complete or absent, and
    a later rank's link fails); returns whether this call wrote it. Best effort: on a full or
    read-only run dir nothing can be written, and the launcher finds the storage fault by probing."""
    if failure not in STOP_CLASSES:
        raise ValueError(f"{failure} is not a stop class; use one of {[c.value for c in STOP_CLASSES]}")
    tmp = layout.control / f".{layout.stop_marker.name}.{os.getpid()}.{time.monotonic_ns()}"
    try:
        layout.control.mkdir(parents=True, exist_ok=True)
        with open(tmp, "w") as f:
            json.dump({"failure_class": failure.value, "ts": time.time(), **record}, f, default=str)
            f.flush()
            os.fsync(f.fileno())
        os.link(tmp, layout.stop_marker)
        return True
    except OSError:  # FileExistsError: another rank was first; else the run dir takes no writes
        return False
    finally:
        try:
            tmp.unlink()
        except OSError:
            pass


def read_stop(layout: RunDir) -> dict[str, Any] | None:
    """The stop marker, if a rank wrote one: ``failure_class`` plus what the rank recorded. An
    unreadable marker (a rank died writing it) reads as a user error, the conservative stop."""
    try:
        text = layout.stop_marker.read_text()
    except FileNotFoundError:
        return None
    except OSError:
        text = ""
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if not isinstance(data, dict) or data.get("failure_class") not in {c.value for c in STOP_CLASSES}:
        return {"failure_class": FailureClass.USER_ERROR.value, "error": f"unreadable {layout.stop_marker.name}"}
    return data


def clear_stop(layout: RunDir, failure: FailureClass) -> Path | None:
    """Move a stop marker that no longer holds aside, kept for the record as
    ``control/STOP.cleared.<ms>.json``: only one that records ``failure`` (a storage stop once the
    run dir takes writes again; a stop the control plane blamed on a node it replaced). Returns
    where it went, or None when there was no such marker (none, another class, or another
    launcher or the control plane moved it first)."""
    stop = read_stop(layout)
    if stop is None or stop.get("failure_class") != failure.value:
        return None
    cleared = layout.control / f"STOP.cleared.{int(time.time() * 1000)}.json"
    try:
        os.rename(layout.stop_marker, cleared)
    except FileNotFoundError:
        return None
    return cleared


def final_status(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The run's outcome: the last ``final`` record (the worst across nodes if several ended the
    same launch), or None while it is still running."""
    return final_of(read_events(RunDir(run_dir).events, Event.FINAL))


def final_of(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """``final_status`` of records already read (the events log, in its order)."""
    finals = [r for r in events if r.get("event") == Event.FINAL.value]
    if not finals:
        return None
    last_launch = finals[-1].get("launch_id", "")  # the log is in time order
    same = [r for r in finals if r.get("launch_id", "") == last_launch]
    failed = [r for r in same if r.get("failure_class") != FailureClass.SUCCESS.value]
    return (failed or same)[-1]


def launch_ended_by(run_dir: str | os.PathLike, launch_id: str, launch_uid: str) -> dict[str, Any] | None:
    """The ``final`` record that ended launch ``launch_id`` in its incarnation ``launch_uid`` (on
    EKS the Job's UID, ``LAUNCH_UID_ENV``), or None while it has not ended. A launch ends with the
    first ``final`` of a class in ``LAUNCH_ENDING_FAILURES`` (success, or a failure that fails the
    whole launch); an ``unknown`` one (a node killed, a spare dropped) leaves it running. Without
    a launch id or an incarnation (the local backend, a launcher run by hand) nothing is known to
    have ended: a run dir may hold an earlier launch of the same id (a run triggered again under
    the same name), and without its incarnation that one cannot be told from this one."""
    if not launch_id or not launch_uid:
        return None
    for record in read_events(RunDir(run_dir).events, Event.FINAL):
        if (
            record.get("launch_id", "") == launch_id
            and record.get("launch_uid") == launch_uid
            and record.get("failure_class") in LAUNCH_ENDING_FAILURES
        ):
            return record
    return None
