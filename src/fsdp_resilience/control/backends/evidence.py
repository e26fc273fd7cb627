"""What a backend reads from the run dir to judge a job: which node(s) to blame when restarts ran
out, and why a running job was stopped. Shared by every backend, since every backend's nodes
write the same run contract (``src/fsdp_resilience/training/contract/``: events log, checkpoint catalog).

Torch-free: the control plane imports this module.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from fsdp_resilience.control.backends.base import Diagnosis, JobStatus
from fsdp_resilience.training.contract import (
    REPLACEABLE_FAILURES,
    CheckpointCatalog,
    Event,
    FailureClass,
    read_events,
    what_to_do,
)

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
#: Failure classes a node's own bad health can explain: besides the replaceable ones, what the
#: code (a CUDA error raised in user code), the data (NaN from a failing GPU), the storage (an I/O
#: error of a node's mount) or nobody (``unknown``: the workers never started, a launcher refused
#: at rendezvous by a health check) reported. Not a config error, nor a launcher that did nothing.
HEALTH_EXPLAINED_FAILURES = REPLACEABLE_FAILURES | frozenset(
    c.value
    for c in (FailureClass.USER_ERROR, FailureClass.STORAGE_ERROR, FailureClass.NON_FINITE, FailureClass.UNKNOWN)
)


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


def launch_window(events: list[dict[str, Any]], launch_id: str, node_ids: list[str]) -> list[dict[str, Any]]:
    """The records of one launch from the given nodes. Worker events carry no launch id, so this
    launch's events are those from its first ``launch_begin`` up to the next launch's."""
    begins = [r["ts"] for r in events if r.get("event") == Event.LAUNCH_BEGIN.value and r.get("launch_id") == launch_id]
    if not begins:
        return []
    start = min(begins)
    later = [
        r["ts"]
        for r in events
        if r.get("event") == Event.LAUNCH_BEGIN.value and r.get("launch_id") != launch_id and r["ts"] > start
    ]
    end = min(later, default=float("inf"))
    return [r for r in events if start <= r.get("ts", 0) < end and r.get("node_id") in node_ids]


def health_check_signal(record: dict[str, Any]) -> str:
    """One ``health_check_failed`` record, as a signal against its node."""
    return (
        f"NVRx {record.get('check')} health check failed ({record.get('source')}, NVRx "
        f"{record.get('nvrx_version')}): {str(record.get('message', ''))[:200]}"
    )


def health_check_signals(run_dir: str | Path, launch_id: str, node_ids: list[str]) -> dict[str, list[str]]:
    """node id -> NVRx's failed health checks on it in this launch (``health_check_failed``)."""
    window = launch_window(read_events(Path(run_dir) / "events.jsonl"), launch_id, node_ids)
    out: dict[str, list[str]] = {}
    for r in window:
        if r.get("event") == Event.HEALTH_CHECK_FAILED.value:
            signal = health_check_signal(r)
            if signal not in out.setdefault(r["node_id"], []):
                out[r["node_id"]].append(signal)
    return out


def merge_signals(*sources: dict[str, list[str]]) -> dict[str, list[str]]:
    """node id -> every signal against it, from several sources, in order, without repeats."""
    out: dict[str, list[str]] = {}
    for source in sources:
        for node, signals in source.items():
            for signal in signals:
                if signal not in out.setdefault(node, []):
                    out[node].append(signal)
    return {n: s for n, s in out.items() if s}


def health_aware_diagnosis(
    failure: str | None,
    health: dict[str, list[str]],
    evidence: list[str],
    blame_replaceable: Callable[[], Diagnosis],
) -> Diagnosis:
    """The one rule every backend applies to a failed launch, given what each node of the job
    says of its own health (``health``: node id -> signals against it: a monitoring agent's
    condition, a failed NVRx health check):

    - a failure a relaunch can help (``REPLACEABLE_FAILURES``) is blamed by the backend
      (``blame_replaceable``), whose evidence puts those signals first;
    - any other fault a machine can have caused (``HEALTH_EXPLAINED_FAILURES``) blames the
      nodes that say they are unhealthy: a CUDA error raised in the user's code, NaN, an I/O
      error are what a failing GPU, NIC or disk looks like from above;
    - the same fault on nodes healthy by every signal blames nobody and replaces nothing:
      another machine would fail the same way.
    """
    if failure in REPLACEABLE_FAILURES:
        return blame_replaceable()
    unhealthy = {n: s for n, s in health.items() if s}
    if unhealthy and failure in HEALTH_EXPLAINED_FAILURES:
        head = f"{failure} on node(s) that say they are unhealthy: they are blamed, not the code or the data"
        return blamed(failure, unhealthy, evidence + [head])
    return Diagnosis(
        failure,
        [],
        False,
        evidence
        + [
            "every node of the job is healthy by every signal it reports: no node is blamed or replaced",
            f"{failure}: {what_to_do(failure)}",
        ],
    )


def blamed(failure: str | None, signals: dict[str, list[str]], evidence: list[str]) -> Diagnosis:
    """A replaceable diagnosis that blames the nodes of ``signals``, one evidence line per node."""
    bad = sorted(n for n, s in signals.items() if s)
    return Diagnosis(
        failure,
        bad,
        bool(bad),
        evidence + [f"node {n}: {'; '.join(signals[n])}" for n in bad],
        {n: list(signals[n]) for n in bad},
    )


def blame_from_events(
    run_dir: str | Path, launch_id: str, status: JobStatus, node_ids: list[str]
) -> tuple[list[str], list[str]]:
    """``events_blame`` without the signals per node."""
    bad, evidence, _ = events_blame(run_dir, launch_id, status, node_ids)
    return bad, evidence


def events_blame(
    run_dir: str | Path, launch_id: str, status: JobStatus, node_ids: list[str]
) -> tuple[list[str], list[str], dict[str, list[str]]]:
    """The node(s) to blame for restarts running out (or no progress), why, and the signals
    against each.

    Worker events carry no launch id, so this launch's events are those from its first
    ``launch_begin`` up to the next launch's. In order of trust: NVRx health checks that failed
    on a node; drills that fired (ground truth; a ``nan`` or ``user_bug`` drill fakes the data or
    the code, not the machine); faults a rank detected that are not a peer's symptom (a
    collective that timed out blames whoever it waited for, not the node that logged it) and
    point at the machine — if every one points at a file, the storage, the data or the code
    (their ``failure_class``), nobody is blamed; else the nodes whose launcher reported the
    failure; else every node of the job (the share rule keeps that in check).
    """
    window = launch_window(read_events(Path(run_dir) / "events.jsonl"), launch_id, node_ids)

    def summary(rs: list[dict[str, Any]]) -> list[str]:
        return [f"{r['node_id']}: {describe(r)}" for r in rs[:20]]

    def by_node(rs: list[dict[str, Any]]) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for r in rs:
            if len(out.setdefault(r["node_id"], [])) < 5:
                out[r["node_id"]].append(describe(r))
        return out

    checks = [r for r in window if r.get("event") == Event.HEALTH_CHECK_FAILED.value]
    if checks:
        bad = sorted({r["node_id"] for r in checks})
        return bad, [f"NVRx health checks failed in this launch on {bad}:"] + summary(checks), by_node(checks)
    injected = [
        r for r in window if r.get("event") == Event.FAULT_INJECTED.value and r.get("kind") not in NOT_MACHINE_DRILLS
    ]
    if injected:
        bad = sorted({r["node_id"] for r in injected})
        return bad, [f"faults injected in this launch on {bad}:"] + summary(injected), by_node(injected)
    detected = [r for r in window if r.get("event") == Event.FAULT_DETECTED.value]
    machine = [
        r
        for r in detected
        if r.get("failure_class") in MACHINE_FAULT_CLASSES
        and not any(m in f"{r.get('kind', '')} {r.get('error', '')}".lower() for m in PEER_SYMPTOMS)
    ]
    if machine:
        bad = sorted({r["node_id"] for r in machine})
        return (
            bad,
            [f"faults detected in this launch on {bad} (not a peer's symptom):"] + summary(machine),
            by_node(machine),
        )
    elsewhere = [r for r in detected if r.get("failure_class") not in MACHINE_FAULT_CLASSES]
    if elsewhere:
        # They point at a file, the storage, the data or the code: another machine would read the
        # same file and fail the same way, so no node is blamed.
        classes = sorted({str(r.get("failure_class")) for r in elsewhere})
        return (
            [],
            [f"the faults detected in this launch point at {', '.join(classes)}, not at a machine: no node is blamed"]
            + summary(elsewhere),
            {},
        )
    reporting = reporting_nodes(status)
    if reporting:
        return (
            sorted(reporting),
            [f"no fault events name a node; the launcher(s) on {sorted(reporting)} reported {status.failure_class}"],
            reporting,
        )
    every = sorted(node_ids)
    return (
        every,
        [f"no events name a node; every node of the job is suspect: {every}"],
        {n: ["every node of the job is suspect (no event names one)"] for n in every},
    )


def reporting_nodes(status: JobStatus) -> dict[str, list[str]]:
    """node id -> its launcher's report, for the nodes whose launcher reported the job's failure."""
    out: dict[str, list[str]] = {}
    for n in status.nodes:
        if n.failure_class == status.failure_class and n.node_id:
            code = f" (exit {n.exit_code})" if n.exit_code is not None else ""
            out.setdefault(n.node_id, []).append(f"node {n.index} reported {n.failure_class}{code}: {n.message[:200]}")
    return out


def describe(record: dict[str, Any]) -> str:
    """One drill, fault or health-check record, for a human."""
    if record.get("event") == Event.HEALTH_CHECK_FAILED.value:
        return health_check_signal(record)
    what = "drill" if record.get("event") == Event.FAULT_INJECTED.value else record.get("event")
    return (
        f"{what} {record.get('kind')} at step {record.get('step')} "
        f"(rank {record.get('rank')}, attempt {record.get('attempt')})"
        + (f": {str(record['error'])[:200]}" if record.get("error") else "")
    )


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
