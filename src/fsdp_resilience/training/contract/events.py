"""The events log (``events.jsonl``): the event kinds (``Event``), one ``TypedDict`` per kind
saying what its records hold (``EVENT_TYPES`` maps each kind to it), the writer (``EventLog``) and
the reader (``read_events``).

Every line is one JSON object: the fields of ``EventRecord`` (the writer's context) and those of
its kind. Field types are ``Annotated`` with what the field means; the reference generator
(``fsdp_resilience.training.contract.reference``) renders them.
"""

import enum
import errno
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Annotated, Any, NotRequired, TypedDict


class Event(str, enum.Enum):
    """Event kinds in ``events.jsonl``; what each record holds is its ``EVENT_TYPES`` entry."""

    LAUNCH_BEGIN = "launch_begin"
    TRAIN_BEGIN = "train_begin"
    STEP = "step"
    CHECKPOINT_BEGIN = "checkpoint_begin"
    CHECKPOINT_COMMIT = "checkpoint_commit"
    CHECKPOINT_SKIP = "checkpoint_skip"
    CHECKPOINT_QUARANTINED = "checkpoint_quarantined"
    CHECKPOINT_STALE = "checkpoint_stale"
    FAULT_INJECTED = "fault_injected"
    FAULT_DETECTED = "fault_detected"
    RESTART_BEGIN = "restart_begin"
    RESTART_END = "restart_end"
    TRAIN_END = "train_end"
    FINAL = "final"
    EVAL = "eval"
    ESCALATION = "escalation"
    TIMEOUTS_DERIVED = "timeouts_derived"
    SPARE_PROMOTED = "spare_promoted"
    SPARE_ADDED = "spare_added"
    WAITING_FOR_NODES = "waiting_for_nodes"
    HEALTH_CHECK_FAILED = "health_check_failed"


class EventRecord(TypedDict):
    """Every record: the writer's context (``EventLog``'s, plus what it was bound to)."""

    ts: Annotated[float, "unix seconds, when the record was written"]
    event: Annotated[str, "the event kind (an ``Event`` value)"]
    run_id: Annotated[str, "the run"]
    host: Annotated[str, "the writer's host name"]
    node_id: Annotated[str, "the machine (or local slot) the writer runs on (``TRAINING_NODE_ID``)"]
    pid: Annotated[int, "the writer's process id"]
    rank: NotRequired[Annotated[int, "global rank (training processes)"]]
    node_rank: NotRequired[Annotated[int, "node index as launched"]]
    attempt: NotRequired[Annotated[int, "launcher restart round (0: the first)"]]
    iteration: NotRequired[Annotated[int, "in-process restart round (the Wrapper's)"]]
    launch_id: NotRequired[Annotated[str, "the (re)launch the writer belongs to"]]
    role: NotRequired[Annotated[str, "the writer when not a rank: launcher, evaluate, control-plane, bench"]]
    task: NotRequired[Annotated[str, "the control plane's task that wrote it"]]


class LaunchBegin(EventRecord):
    """A node launcher started (one per node per launch)."""

    nodes: Annotated[int, "training nodes"]
    spare_nodes: Annotated[int, "hot spares"]
    procs_per_node: Annotated[int, "ranks per node"]
    restart_mode: Annotated[str, "the restart layers (``RunConfig.restart_mode``)"]
    rdzv_host: Annotated[str | None, "the rendezvous host"]
    command: Annotated[str, "the NVRx launcher command line"]
    standby: Annotated[bool, "a spare: it waits in the rendezvous until a node is lost"]


class TrainBegin(EventRecord):
    """A rank starts training (each attempt and in-process iteration)."""

    start_step: Annotated[int, "the first step it trains (0: from scratch)"]
    world_size: Annotated[int, "ranks training"]
    device: Annotated[str, "the torch device"]
    model: Annotated[str, "the model preset"]
    resumed_from: Annotated[str | None, "the checkpoint id it resumed from, or null"]
    rng: Annotated[
        str,
        "each rank's RNG state: seeded (from the seed), restored (from the checkpoint), or "
        "reseeded (the seed again, the world size changed)",
    ]


class Step(EventRecord):
    """A training step finished (rank 0, every ``log_interval`` steps)."""

    step: Annotated[int, "the step"]
    loss: Annotated[float, "the mean loss over ranks"]
    step_s: Annotated[float, "wall seconds of the step"]
    tokens_per_s: Annotated[float, "tokens trained per second, all ranks"]


class CheckpointBegin(EventRecord):
    """A save started (the training loop goes on while it is written)."""

    step: Annotated[int, "the step saved"]
    blocking_s: Annotated[
        float,
        "seconds the training loop was stopped in the save itself; the rest of the snapshot copy, "
        "which runs during the next forward and backward, is waited for before the next optimizer "
        "step and shows in that step's time",
    ]
    mode: Annotated[str, "how the save was taken"]
    snapshot_s: Annotated[float, "seconds the save spent on the snapshot before it returned (starting the copy)"]


class CheckpointCommit(EventRecord):
    """A checkpoint was committed (its commit marker written)."""

    step: Annotated[int, "the step saved"]
    checkpoint_id: Annotated[str, "the checkpoint folder's name"]
    save_s: Annotated[float, "begin -> commit, wall seconds"]


class CheckpointSkip(EventRecord):
    """A checkpoint was passed over at resume or evaluation: torn, or no checkpoint verifies."""

    checkpoint_id: Annotated[str, "the checkpoint folder's name"]
    step: Annotated[int, "its step"]
    reason: Annotated[str, "why it was passed over"]


class CheckpointQuarantined(EventRecord):
    """A checkpoint failed verification or its load: moved to checkpoints/quarantine/, never tried again."""

    checkpoint_id: Annotated[str, "the checkpoint folder's name"]
    step: Annotated[int, "its step"]
    reason: Annotated[str, "why it cannot be trusted"]
    moved_to: Annotated[str, "where it is now"]


class CheckpointStale(EventRecord):
    """A checkpoint's model bytes equal an earlier checkpoint's although steps advanced: the save
    wrote stale state."""

    step: Annotated[int, "the step saved"]
    checkpoint_id: Annotated[str, "the checkpoint folder's name"]
    same_as: Annotated[str, "the earlier checkpoint with the same model bytes"]


class FaultInjected(EventRecord):
    """A fault drill fired (written before the fault happens)."""

    kind: Annotated[str, "the drill's kind (``FaultDrill.kind``)"]
    step: Annotated[int, "the step it fired at"]


class FaultDetected(EventRecord):
    """A rank caught a fault."""

    layer: Annotated[str, "the layer that handles it: inprocess or injob; for non_finite rollback or none"]
    kind: Annotated[str, "the exception's type"]
    step: Annotated[int, "the step it happened at"]
    error: Annotated[str, "the error message (first 500 characters)"]
    signature: Annotated[str, "the error's signature, to recognise it again"]
    repeated: Annotated[bool, "the same error at the same step seen before: a user error"]
    failure_class: Annotated[
        str | None,
        "what the fault points at: restarts_exhausted for the machine; user_error, "
        "non_finite, storage_error, or checkpoint for a restore that failed on a "
        "file",
    ]
    restoring: NotRequired[Annotated[bool, "it happened while restoring a checkpoint"]]
    first_step: NotRequired[Annotated[int, "non_finite (rank 0): the first step that went NaN/inf"]]
    ranks: NotRequired[Annotated[list[int], "non_finite: the ranks that went NaN/inf"]]
    rollbacks_before: NotRequired[Annotated[int, "non_finite: rollbacks done before this one"]]
    max_rollbacks: NotRequired[Annotated[int, "non_finite: ``max_nonfinite_rollbacks``"]]


#: ``health_check_failed``'s ``check``: what NVRx found unhealthy on the node.
HEALTH_CHECKS = ("gpu", "nvlink", "nic", "storage", "node")


class HealthCheckFailed(EventRecord):
    """An NVRx health check failed on this node (``node_id``): the node, not the code, is suspect.
    Written by a rank whose in-process restart was refused by the Wrapper's restart health check
    (NVRx 0.6+ on CUDA: GPU and NIC; its NVLink check only logs), or by the node's launcher when
    ft_launcher's rendezvous turned the node away (GPU on every version; NIC and storage on 0.6+
    when enabled) and its log is a file there (the local backend)."""

    check: Annotated[str, "what failed: gpu, nvlink, nic, storage or node (``HEALTH_CHECKS``)"]
    source: Annotated[str, "who ran it: inprocess_wrapper (before a restart) or ft_launcher (at rendezvous)"]
    message: Annotated[str, "NVRx's message (first 500 characters)"]
    nvrx_version: Annotated[str, "the installed nvidia-resiliency-ext"]


class RestartBegin(EventRecord):
    """A restart layer restarts training."""

    layer: Annotated[str, "inprocess, injob, relaunch, or rollback (non-finite state, restored in place)"]
    reason: Annotated[str, "why"]
    fault_ts: NotRequired[Annotated[float, "unix seconds of the fault (or of the last step before it)"]]


class RestartEnd(EventRecord):
    """The first step completed after a restart."""

    layer: Annotated[str, "the layer that restarted"]
    step: Annotated[int, "the step completed"]
    latency_s: Annotated[float, "the fault, or the last step before it, -> this step, seconds"]


class TrainEnd(EventRecord):
    """A rank trained every step."""

    step: Annotated[int, "the last step"]
    status: Annotated[str, "completed"]


class Final(EventRecord):
    """A launcher ended (one per launcher, per node): the run's outcome (``final_status``)."""

    failure_class: Annotated[str, "a ``FailureClass`` value"]
    exit_code: Annotated[int, "the launcher's exit code (``ExitCode``)"]
    launcher_exit_code: Annotated[int | None, "the NVRx launcher's own exit code"]
    step: Annotated[int, "the newest committed checkpoint's step (0: none)"]
    checkpoint_id: Annotated[str | None, "the newest committed checkpoint, or null"]
    message: Annotated[str, "what happened, for a human"]
    launch_uid: NotRequired[
        Annotated[str, "the launch's incarnation (``TRAINING_LAUNCH_UID``: on EKS its Job's UID); absent locally"]
    ]


class Eval(EventRecord):
    """A checkpoint was evaluated (``fsdp_resilience.training.evaluate``)."""

    checkpoint_id: Annotated[str, "the checkpoint evaluated"]
    step: Annotated[int, "its step"]
    val_loss: Annotated[float, "the validation loss"]
    perplexity: Annotated[float, "exp(val_loss)"]


class Escalation(EventRecord):
    """The control plane replaced nodes and relaunched (a rung of the ladder)."""

    rung: Annotated[int, "the rung (1-based)"]
    from_launch: Annotated[str, "the launch that failed"]
    to_launch: Annotated[str, "the next launch"]
    failure_class: Annotated[str | None, "the diagnosis' failure class"]
    nodes: Annotated[list[str], "node ids replaced"]
    reason: Annotated[str, "the diagnosis' evidence"]
    signals: NotRequired[
        Annotated[
            dict[str, list[str]],
            "blamed node id -> the signals against it (a node condition, an NVRx health check, a drill, a "
            "fault, a pod's exit)",
        ]
    ]
    stop_cleared: NotRequired[
        Annotated[
            str,
            "where control/STOP.json was moved aside (``clear_stop``) and why: the stop a rank declared was "
            "blamed on a node its own health signals call unhealthy, and that node was replaced",
        ]
    ]


class TimeoutsDerived(EventRecord):
    """ft_launcher's timeouts were derived (rank 0; once per attempt and in-process iteration, after
    its warm steps and second save): the step and ``DerivedTimeouts``' fields."""

    step: Annotated[int, "the step they were derived at"]
    heartbeat_s: Annotated[float, "the derived heartbeat timeout, seconds"]
    sections: Annotated[dict[str, float], "the section timeouts, seconds"]
    initial_heartbeat_s: Annotated[float, "the configured initial heartbeat timeout (never derived)"]
    floor_s: Annotated[float, "the lowest timeout the restart layers' order allows"]
    ceiling_s: Annotated[float, "the configured heartbeat timeout (never exceeded)"]
    safety_factor: Annotated[float, "``timeout_safety_factor``"]
    measured_heartbeat_interval_s: Annotated[float, "the longest interval between heartbeats"]
    measured_section_s: Annotated[dict[str, float], "the longest time each section was open"]


class SparePromoted(EventRecord):
    """A spare trains now in a lost node's place (global rank 0, at the start of the first attempt
    a spare trains in; from the membership record control/membership.json). ``node_id`` and
    ``node_rank`` name the spare, not the writer."""

    replaces: Annotated[list[str], "node ids that trained in the attempt before and not in this one"]
    replaced_node_ranks: Annotated[list[int], "their node indices"]
    members: Annotated[list[str], "node ids training now"]
    previous_attempt: Annotated[int | None, "the attempt of the membership record before"]


class SpareAdded(EventRecord):
    """The control plane refilled the spare pool while training went on. ``node_id`` and
    ``node_rank`` name the new spare."""

    lost_node_id: Annotated[str, "the lost node"]
    lost_node_rank: Annotated[int, "its node index"]
    quarantined: Annotated[list[str], "node ids quarantined"]
    reason: Annotated[str, "why"]


class WaitingForNodes(EventRecord):
    """A training node's launcher found its workers down while the rendezvous waits for nodes that
    are gone (their launchers stopped beating) and no parked spare is left to take their place.
    ``until`` is how long it waits (a replacement announced in control/membership-deadline.json),
    or null: nothing is coming, and the launch ends now (``final``: restarts_exhausted)."""

    missing: Annotated[int, "how many nodes the rendezvous waits for"]
    nodes: Annotated[list[str], "their node ids"]
    missing_node_ranks: Annotated[list[int], "their node indices"]
    until: Annotated[float | None, "unix seconds it waits until; null: it does not wait"]
    why: Annotated[str, "why it waits, or why nothing is coming"]


#: Every event kind and the TypedDict of its records.
EVENT_TYPES: dict[str, type] = {
    Event.LAUNCH_BEGIN.value: LaunchBegin,
    Event.TRAIN_BEGIN.value: TrainBegin,
    Event.STEP.value: Step,
    Event.CHECKPOINT_BEGIN.value: CheckpointBegin,
    Event.CHECKPOINT_COMMIT.value: CheckpointCommit,
    Event.CHECKPOINT_SKIP.value: CheckpointSkip,
    Event.CHECKPOINT_QUARANTINED.value: CheckpointQuarantined,
    Event.CHECKPOINT_STALE.value: CheckpointStale,
    Event.FAULT_INJECTED.value: FaultInjected,
    Event.FAULT_DETECTED.value: FaultDetected,
    Event.RESTART_BEGIN.value: RestartBegin,
    Event.RESTART_END.value: RestartEnd,
    Event.TRAIN_END.value: TrainEnd,
    Event.FINAL.value: Final,
    Event.EVAL.value: Eval,
    Event.ESCALATION.value: Escalation,
    Event.TIMEOUTS_DERIVED.value: TimeoutsDerived,
    Event.SPARE_PROMOTED.value: SparePromoted,
    Event.SPARE_ADDED.value: SpareAdded,
    Event.WAITING_FOR_NODES.value: WaitingForNodes,
    Event.HEALTH_CHECK_FAILED.value: HealthCheckFailed,
}


#: Set by the backend for every process of a node: the Kubernetes node name on EKS (downward
#: API ``spec.nodeName``), the slot name on the local backend. Diagnosis maps faults to nodes by it.
NODE_ID_ENV = "TRAINING_NODE_ID"
#: Set by the EKS backend for every pod (downward API ``metadata.uid``): the pod's UID. A pod the
#: Job recreates for an index keeps the lost pod's host name but gets a UID of its own, so the
#: launch lock tells a predecessor by it (unset locally: host and pid as before).
POD_UID_ENV = "TRAINING_POD_UID"
#: Set by the EKS backend for every pod (downward API, the Job controller's
#: ``batch.kubernetes.io/controller-uid`` label): the incarnation of the launch, its Job's UID. A
#: launch id is reused when a run is triggered again under the same name; the UID is not, so
#: whether a launch ended (``launch_ended_by``) is read only from its own incarnation's records.
LAUNCH_UID_ENV = "TRAINING_LAUNCH_UID"


def node_id() -> str:
    """The identity of the machine (or local slot) this process runs on."""
    return os.environ.get(NODE_ID_ENV) or socket.gethostname()


class EventLog:
    """Append-only JSON-lines log. Each record is written with one ``write`` on an ``O_APPEND``
    descriptor, so lines from concurrent processes never interleave.

    It never raises into training: when the run dir cannot take the line (full, read-only, gone)
    the record goes to stderr instead, and a partial write is completed or never started (a line
    is written whole or, on a full disk, not at all), so the log stays parseable."""

    def __init__(self, path: str | os.PathLike, **context: Any):
        self.path = Path(path)
        self.context = {"host": socket.gethostname(), "node_id": node_id(), "pid": os.getpid(), **context}

    def bind(self, **context: Any) -> "EventLog":
        log = EventLog(self.path)
        log.context = {**self.context, **context}
        return log

    def emit(self, event: Event | str, **fields: Any) -> dict[str, Any]:
        name = event.value if isinstance(event, Event) else Event(event).value
        record = {"ts": round(time.time(), 6), "event": name, **self.context, **fields}
        line = (json.dumps(record, sort_keys=True, default=str) + "\n").encode()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                written = os.write(fd, line)
                if written != len(line):  # a full disk took part of it: end the torn line
                    os.write(fd, b"\n")
                    raise OSError(errno.ENOSPC, "short write")
            finally:
                os.close(fd)
        except OSError as e:
            print(
                f"[events] cannot append to {self.path} ({e.strerror or e}): {line.decode().strip()}",
                file=sys.stderr,
                flush=True,
            )
        return record


def read_events(path: str | os.PathLike, event: Event | str | None = None) -> list[dict[str, Any]]:
    """All records (optionally of one type). A torn last line (writer killed mid-write) is skipped."""
    want = None if event is None else (event.value if isinstance(event, Event) else event)
    out = []
    try:
        with open(path, errors="replace") as f:
            for line in f:
                rec = _parse_event_line(line.strip())
                if rec is not None and (want is None or rec.get("event") == want):
                    out.append(rec)
    except FileNotFoundError:
        pass
    return out


def parse_event_lines(data: bytes) -> tuple[list[dict[str, Any]], int]:
    """The records in ``data`` (bytes of the events log from some offset on), and how many bytes
    they took: whole lines only, so a line still being written is read next time from
    ``offset + consumed``. What ``read_events_since`` and a reader of an S3 copy share."""
    consumed = data.rfind(b"\n") + 1
    out = []
    for line in data[:consumed].decode(errors="replace").splitlines():
        rec = _parse_event_line(line.strip())
        if rec is not None:
            out.append(rec)
    return out, consumed


def read_events_since(path: str | os.PathLike, offset: int = 0) -> tuple[list[dict[str, Any]], int]:
    """The records appended to the log since byte ``offset``, and the offset to read from next: a
    log that grows is read once, however often it is looked at. A log that is missing, or shorter
    than ``offset`` (replaced), reads as nothing new."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return [], offset
    records, consumed = parse_event_lines(data)
    return records, offset + consumed


def _parse_event_line(line: str) -> dict[str, Any] | None:
    """One record; if a killed writer left a partial record in front of it on the same line, the
    complete record that ends the line."""
    if not line:
        return None
    try:
        rec = json.loads(line)
        return rec if isinstance(rec, dict) else None
    except ValueError:
        pass
    decoder = json.JSONDecoder()
    start = line.find("{", 1)
    while start != -1:
        try:
            rec, end = decoder.raw_decode(line, start)
            if end == len(line) and isinstance(rec, dict) and "event" in rec:
                return rec
        except ValueError:
            pass
        start = line.find("{", start + 1)
    return None
