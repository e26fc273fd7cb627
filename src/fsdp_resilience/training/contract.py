"""The run contract: what the control plane (Airflow) and the data plane (training) agree on.

This module is the seam between the two planes. It imports only the standard library, so the
Airflow image can use it without torch. It defines:

- ``RunConfig``: the validated run configuration (JSON round-trip, clear errors on bad values);
- ``RunDir``: the run-dir layout (config, events log, checkpoints, evaluation result);
- the checkpoint layout and commit protocol (``CheckpointCatalog``);
- the events-log schema (``EventLog``, ``Event``);
- exit codes and failure classes (``ExitCode``, ``FailureClass``).

Change it deliberately: both planes, and runs already on disk, depend on it.
"""

from __future__ import annotations

import dataclasses
import enum
import errno
import json
import os
import re
import socket
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

CONTRACT_VERSION = 1


# --------------------------------------------------------------------------------------------
# Exit codes and failure classes
# --------------------------------------------------------------------------------------------


class FailureClass(str, enum.Enum):
    """Why a run ended; decides what the control plane does next."""

    SUCCESS = "success"
    #: The user's code or config is wrong. Never retried, never replaces a node.
    USER_ERROR = "user_error"
    #: In-job restarts ran out: suspect hardware. The control plane may replace the node.
    RESTARTS_EXHAUSTED = "restarts_exhausted"
    #: Training ran but made no progress (no new committed checkpoint / steps) in time.
    NO_PROGRESS = "no_progress"
    #: The run dir is full or read-only: not a node fault. Free space or fix the mount, relaunch.
    STORAGE_ERROR = "storage_error"
    #: The loss or gradient norm became NaN/inf again after ``max_nonfinite_rollbacks`` rollbacks to
    #: the newest verified checkpoint: the run diverges. Lower lr or fix the data; never retried.
    NON_FINITE = "non_finite"
    #: Another ``fsdp_resilience.training.launch`` of this run already holds this node's launch lock. The refused
    #: launcher did nothing, and its exit never changes the run's status.
    ALREADY_RUNNING = "already_running"
    #: The launcher itself failed in a way not covered above (e.g. killed from outside).
    UNKNOWN = "unknown"

    @property
    def retryable(self) -> bool:
        """Whether relaunching (possibly on a replaced node) can help."""
        return self in (FailureClass.RESTARTS_EXHAUSTED, FailureClass.NO_PROGRESS)


class ExitCode(enum.IntEnum):
    """Exit codes of ``python -m fsdp_resilience.training.launch``: the pod's, and so the Job's, exit code."""

    SUCCESS = 0
    UNKNOWN = 1
    #: Bad config or arguments: rejected before anything expensive starts.
    CONFIG_ERROR = 2
    #: sysexits EX_TEMPFAIL: restarts exhausted, a relaunch elsewhere may succeed.
    RESTARTS_EXHAUSTED = 75
    #: sysexits EX_CONFIG-adjacent: the user's code failed deterministically; do not retry.
    USER_ERROR = 78
    #: The same code NVRx 0.7's ft_launcher uses for "no progress".
    NO_PROGRESS = 93
    #: sysexits EX_DATAERR: training state became non-finite and rollbacks did not help.
    NON_FINITE = 65
    #: sysexits EX_CANTCREAT: another launcher of this run holds the node's launch lock.
    ALREADY_RUNNING = 73
    #: sysexits EX_IOERR: the run dir is full or read-only.
    STORAGE_ERROR = 74


_EXIT_TO_CLASS = {
    ExitCode.SUCCESS: FailureClass.SUCCESS,
    ExitCode.CONFIG_ERROR: FailureClass.USER_ERROR,
    ExitCode.USER_ERROR: FailureClass.USER_ERROR,
    ExitCode.RESTARTS_EXHAUSTED: FailureClass.RESTARTS_EXHAUSTED,
    ExitCode.NO_PROGRESS: FailureClass.NO_PROGRESS,
    ExitCode.NON_FINITE: FailureClass.NON_FINITE,
    ExitCode.ALREADY_RUNNING: FailureClass.ALREADY_RUNNING,
    ExitCode.STORAGE_ERROR: FailureClass.STORAGE_ERROR,
}

_CLASS_TO_EXIT = {
    FailureClass.SUCCESS: ExitCode.SUCCESS,
    FailureClass.USER_ERROR: ExitCode.USER_ERROR,
    FailureClass.RESTARTS_EXHAUSTED: ExitCode.RESTARTS_EXHAUSTED,
    FailureClass.NO_PROGRESS: ExitCode.NO_PROGRESS,
    FailureClass.STORAGE_ERROR: ExitCode.STORAGE_ERROR,
    FailureClass.NON_FINITE: ExitCode.NON_FINITE,
    FailureClass.ALREADY_RUNNING: ExitCode.ALREADY_RUNNING,
    FailureClass.UNKNOWN: ExitCode.UNKNOWN,
}

#: Failure classes a rank declares in the stop marker (``declare_stop``): every restart layer stops.
STOP_CLASSES = (FailureClass.USER_ERROR, FailureClass.NON_FINITE, FailureClass.STORAGE_ERROR)

#: Failure classes for which replacing the blamed node(s) and relaunching can help
#: (``FailureClass.retryable``). Never ``user_error``: a bug fails the same way on any machine.
REPLACEABLE_FAILURES = frozenset(c.value for c in FailureClass if c.retryable)

#: Failure classes a launcher ends with by its own decision (not killed, not lost): its node's exit
#: fails the whole job at once (the EKS Job's podFailurePolicy FailJob rules), since no other pod
#: of the same job can do better.
FINAL_FAILURES = frozenset(c.value for c in FailureClass if c not in (FailureClass.SUCCESS, FailureClass.UNKNOWN))

#: When the nodes of one job fail differently, the job is reported with the most telling class.
#: First the classes that must never be retried, most specific first: another launcher owns the
#: run (whatever else our nodes report follows from that), the storage, the training state, the
#: user's code; then the restart layers giving up (or a lost node), then no progress; ``unknown``
#: (e.g. a node stopped because a peer failed) tells least.
FAILURE_PRIORITY = (FailureClass.ALREADY_RUNNING.value, FailureClass.STORAGE_ERROR.value,
                    FailureClass.NON_FINITE.value, FailureClass.USER_ERROR.value,
                    FailureClass.RESTARTS_EXHAUSTED.value, FailureClass.NO_PROGRESS.value,
                    FailureClass.UNKNOWN.value)

#: What the user should do about a launch that ended with a class no node replacement can fix.
#: Diagnosis, the ladder and the DAG's failure message all say it the same way.
WHAT_TO_DO = {
    FailureClass.USER_ERROR.value:
        "a user error fails the same way on any node: fix the code or config, then trigger the run again; "
        "no node was touched",
    FailureClass.STORAGE_ERROR.value:
        "the run dir is full or read-only (storage, not a node fault): free space on it or fix its mount, "
        "then trigger the run again (it resumes from the newest verified checkpoint); no node was touched",
    FailureClass.NON_FINITE.value:
        "the loss or gradient norm became NaN/inf again after max_nonfinite_rollbacks rollbacks to the newest "
        "verified checkpoint: the run diverges. Lower lr (or grad_clip), or check the data, then trigger the "
        "run again; no node was touched",
    FailureClass.ALREADY_RUNNING.value:
        "another fsdp_resilience.training.launch of this run holds its launch lock: the run is being trained by another "
        "launcher. This launch did nothing; that launcher was left alone and the run's status is unchanged. "
        "Watch it (events.jsonl), or stop it before triggering this run again, or pick another run_name",
    FailureClass.UNKNOWN.value:
        "not a failure that replacing a node fixes; read the launch's logs (backend.logs)",
}


def what_to_do(failure_class: str | None) -> str:
    """The advice for a failure class that is never retried (see ``WHAT_TO_DO``)."""
    return WHAT_TO_DO.get(failure_class or FailureClass.UNKNOWN.value, WHAT_TO_DO[FailureClass.UNKNOWN.value])


def most_telling_failure(classes: list[str | None]) -> str | None:
    """The failure class that describes a job whose nodes failed with ``classes``."""
    present = [c for c in classes if c and c != FailureClass.SUCCESS.value]
    if not present:
        return None
    rank = {c: i for i, c in enumerate(FAILURE_PRIORITY)}
    return min(present, key=lambda c: rank.get(c, len(rank)))


#: errnos that mean "the run dir cannot take writes": storage, not the node or the code.
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EFBIG})


def storage_errno(exc: BaseException | None) -> int | None:
    """The storage errno (``STORAGE_ERRNOS``) behind ``exc`` or anything in its cause chain, else
    None. Writers in other processes report errors as text: ``[Errno 28] ...`` counts too."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in STORAGE_ERRNOS:
            return exc.errno
        match = re.search(r"\[Errno (\d+)\]", str(exc))
        if match and int(match.group(1)) in STORAGE_ERRNOS:
            return int(match.group(1))
        exc = exc.__cause__ or exc.__context__
    return None


def probe_writable(folder: str | os.PathLike) -> str | None:
    """Why ``folder`` cannot take a small durable write (full, read-only, no permission), or None.
    A real write and fsync, not ``os.access``: a full disk or a read-only mount passes that."""
    folder = Path(folder)
    probe = folder / f".write-probe.{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        return f"{folder} is not writable: {e.strerror or e} (errno {e.errno})"
    finally:
        try:
            probe.unlink()
        except OSError:
            pass
    return None


def failure_class_for_exit(code: int) -> FailureClass:
    """The failure class a launcher exit code stands for (unknown codes -> UNKNOWN)."""
    try:
        return _EXIT_TO_CLASS.get(ExitCode(code), FailureClass.UNKNOWN)
    except ValueError:
        return FailureClass.UNKNOWN


def exit_code_for(failure: FailureClass) -> ExitCode:
    return _CLASS_TO_EXIT[failure]


# --------------------------------------------------------------------------------------------
# Run configuration
# --------------------------------------------------------------------------------------------


class ConfigError(ValueError):
    """A run config value is wrong. The message names the field and what to do."""


RESTART_MODES = ("layered", "injob", "inprocess", "none")
DEVICES = ("auto", "cpu", "cuda")
#: Model presets; the shapes live in src/fsdp_resilience/training/model.py (which needs torch).
MODEL_PRESETS = ("tiny", "tiny-dropout", "small", "1b", "8b")
FAULT_KINDS = (
    "exception",  # a Python exception in one rank (recovered in-process)
    "hang",  # a Python-level busy hang in one rank (soft timeout)
    "sigstop",  # SIGSTOP of one rank: the process freezes (hard timeout / heartbeat)
    "sigkill",  # SIGKILL of one rank
    "oom",  # exit 137, as the kernel's OOM killer would
    "node_loss",  # every rank of one node dies at once
    "checkpoint_crash",  # the async checkpoint writer dies mid-save
    "writer_hang",  # the async checkpoint writer is SIGSTOPped mid-save (frozen, not dead)
    "nan",  # the loss of one rank becomes NaN (a diverging run, bad data)
    "user_bug",  # raises on every attempt: must end as USER_ERROR, never retried
)
_RUN_ID_RE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


@dataclass(frozen=True)
class FaultDrill:
    """A deterministic fault: ``kind`` at training step ``step`` in global rank ``rank``.

    ``attempt`` is the launcher restart round it fires in (0 = the first launch; null = every
    round, as a faulty machine would); ``once`` (with ``attempt`` null): it fires the first time
    any round reaches it and never again, whatever the rounds are numbered (with spares on NVRx
    0.4.1 a round that swaps a spare in is a membership change, which keeps the round); ``node``
    (for ``node_loss``, with spares) may be null: the training node that holds the highest global
    rank outside node 0, which hosts the rendezvous store (with spares, which node trains is the
    rendezvous' choice, so an index may be parked when the step comes); ``node`` selects the node for ``node_loss`` (rank is
    ignored there); ``node_id``, when set, limits the drill to processes on that node or local
    slot (``TRAINING_NODE_ID``), so a "bad node" drill stops once the node is replaced. A
    ``user_bug`` fires on every attempt, by definition.
    """

    kind: str
    step: int
    rank: int = 0
    attempt: int | None = 0
    node: int | None = 0
    node_id: str | None = None
    once: bool = False

    def validate(self, cfg: "RunConfig", where: str) -> None:
        if self.kind not in FAULT_KINDS:
            raise ConfigError(f"{where}.kind={self.kind!r} is not a fault kind; use one of {', '.join(FAULT_KINDS)}")
        if not 1 <= self.step <= cfg.steps:
            raise ConfigError(f"{where}.step={self.step} must be between 1 and steps={cfg.steps}")
        if not 0 <= self.rank < cfg.world_size:
            raise ConfigError(f"{where}.rank={self.rank} must be a global rank in [0, {cfg.world_size})")
        if self.node is None:
            if self.kind != "node_loss" or not cfg.spare_nodes or cfg.nodes < 2:
                raise ConfigError(f"{where}.node=null (a training node other than node 0) is for a node_loss in a run "
                                  "with spare_nodes and at least 2 nodes; give a node index otherwise")
        elif not 0 <= self.node < cfg.launch_nodes:
            raise ConfigError(f"{where}.node={self.node} must be a node index in [0, {cfg.launch_nodes}) "
                              f"(nodes {cfg.nodes} + spare_nodes {cfg.spare_nodes})")
        if self.attempt is not None and (isinstance(self.attempt, bool) or not isinstance(self.attempt, int)
                                         or not 0 <= self.attempt <= 100):
            raise ConfigError(f"{where}.attempt={self.attempt!r} must be between 0 and 100, or null for every attempt")
        if not isinstance(self.once, bool) or (self.once and (self.attempt is not None or self.kind == "user_bug")):
            raise ConfigError(f"{where}.once={self.once!r}: once is true or false, and a drill that fires once "
                              "takes attempt null (any round) and is not a user_bug (which fires every time)")
        if self.node_id is not None and (not isinstance(self.node_id, str) or not self.node_id):
            raise ConfigError(f"{where}.node_id must be a node name or null, got {self.node_id!r}")


#: Spare nodes a run may ask for, and spares the control plane may add to one launch after
#: promotions (node indices ``launch_nodes`` .. ``node_rank_limit - 1``).
MAX_SPARE_NODES = 8
MAX_SPARE_REFILLS = 16

#: The collective timeout on gloo when the run config leaves it unset.
DEFAULT_GLOO_COLLECTIVE_TIMEOUT_S = 30.0
#: How far a derived heartbeat / section timeout stays above the pauses it must outlast (see
#: ``RestartTimeouts.derived_floor_s``): room for the Wrapper's tear-down (about 1 s measured on
#: gloo) and for scheduling noise on a loaded machine.
DERIVED_TIMEOUT_MARGIN_S = 2.0
#: ft_launcher's sections whose timeouts are derived from the warm steps: what those steps measure.
#: ``setup`` (start, process group, restore) and ``final_checkpoint`` (waiting for the last write)
#: are not measured by them and keep the configured timeouts.
DERIVED_SECTIONS = ("step", "checkpoint")
#: On NCCL, how far the collective timeout is set above the Wrapper's hard timeout when unset.
NCCL_TIMEOUT_MARGIN_S = 60.0


@dataclass(frozen=True)
class RestartTimeouts:
    """The timeouts of the restart layers on one collective backend, and the order they must keep.

    - ``soft_s`` (``hang_timeout_s``): the in-process Wrapper interrupts a rank that made no
      progress this long and restarts in place; ``hard_s`` (2x soft): it kills the rank.
    - ``heartbeat_s``: ft_launcher restarts the worker group when a rank is silent this long.
    - ``collective_s``: the process groups' timeout.

    gloo: nothing aborts a blocked gloo receive. A rank that raises shuts its connections down, so
    its peers learn at once; but a hung rank cannot, and its peers learn of it only when their
    collective times out. Heartbeats pause that long during an in-process restart, so
    ``heartbeat_s`` must exceed ``collective_s``.

    NCCL: with ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` (torch's default) the watchdog kills a rank whose
    collective timed out. NVRx's in-process guide requires the NCCL timeout to exceed the Wrapper's
    hard timeout; otherwise the watchdog kills the healthy ranks waiting on a hung one before the
    Wrapper can recover it, and no hang is ever recovered in-process.
    """

    backend: str
    collective_s: float
    soft_s: float
    hard_s: float
    heartbeat_s: float
    initial_heartbeat_s: float

    def check(self, restart_mode: str) -> None:
        in_process = restart_mode in ("layered", "inprocess")
        monitored = restart_mode in ("layered", "injob")
        where = f"on {self.backend} ({'CPU' if self.backend == 'gloo' else 'CUDA'})"
        if self.backend == "nccl" and in_process and self.collective_s <= self.hard_s:
            raise ConfigError(
                f"collective_timeout_s={self.collective_s} must exceed the in-process hard timeout "
                f"(2 x hang_timeout_s = {self.hard_s}) {where}: otherwise the NCCL watchdog kills the "
                "healthy ranks before a hang can be recovered in-process. Raise it, or leave it unset "
                f"to get {self.hard_s + NCCL_TIMEOUT_MARGIN_S}")
        if self.backend == "gloo" and monitored and self.heartbeat_s <= self.collective_s + 1:
            # An in-process restart pauses heartbeats for about one collective timeout; a shorter
            # heartbeat timeout makes ft_launcher kill ranks that were recovering by themselves.
            raise ConfigError(
                f"heartbeat_timeout_s={self.heartbeat_s} must exceed collective_timeout_s + 1 "
                f"= {self.collective_s + 1} {where}, so in-process restarts are not cut short")
        if restart_mode == "layered" and self.soft_s >= self.heartbeat_s:
            # Otherwise ft_launcher kills a hung rank before the Wrapper can recover it in place.
            raise ConfigError(
                f"hang_timeout_s={self.soft_s} must be below heartbeat_timeout_s={self.heartbeat_s} "
                "in layered mode, so hangs are recovered in-process first")

    def derived_floor_s(self, restart_mode: str, longest_interval_s: float) -> float:
        """The shortest heartbeat (and ``step`` / ``checkpoint`` section) timeout that keeps this
        class's order, given the longest interval seen between two heartbeats:

        - gloo, monitored: an in-process restart pauses heartbeats for a collective timeout plus
          the step it cut short, so the timeout must outlast that pause, or ft_launcher kills ranks
          that were recovering by themselves;
        - layered: above the Wrapper's soft timeout, so it acts on hangs first.

        Plus ``DERIVED_TIMEOUT_MARGIN_S``."""
        floor = longest_interval_s
        if self.backend == "gloo" and restart_mode in ("layered", "injob"):
            floor = max(floor, self.collective_s + longest_interval_s)
        if restart_mode == "layered":
            floor = max(floor, self.soft_s)
        return floor + DERIVED_TIMEOUT_MARGIN_S

    def derive(self, restart_mode: str, safety_factor: float, heartbeat_interval_s: float,
               section_s: dict[str, float]) -> "DerivedTimeouts":
        """ft_launcher's timeouts from what the warm steps measured (the longest interval between
        heartbeats, and the longest time each of ``DERIVED_SECTIONS`` was open, over all ranks):
        ``safety_factor`` x the measure, never below ``derived_floor_s`` and never above the
        configured timeout (the ceiling: a run never gets a longer timeout than it asked for).
        A section not measured (``section_s`` lacks it, or it is <= 0) keeps its configured timeout."""
        floor = self.derived_floor_s(restart_mode, heartbeat_interval_s)

        def bounded(measured: float) -> float:
            return round(min(self.heartbeat_s, max(floor, safety_factor * measured)), 3)

        sections = {name: bounded(section_s[name]) if section_s.get(name, 0) > 0 else self.heartbeat_s
                    for name in DERIVED_SECTIONS}
        return DerivedTimeouts(
            heartbeat_s=bounded(heartbeat_interval_s), sections=sections,
            initial_heartbeat_s=self.initial_heartbeat_s, floor_s=round(floor, 3), ceiling_s=self.heartbeat_s,
            safety_factor=safety_factor, measured_heartbeat_interval_s=round(heartbeat_interval_s, 4),
            measured_section_s={k: round(v, 4) for k, v in section_s.items() if v > 0})


@dataclass(frozen=True)
class DerivedTimeouts:
    """ft_launcher's heartbeat and section timeouts as derived in a run, and what from: recorded in
    the events log (``timeouts_derived``) and the run dir (``RunDir.derived_timeouts``).

    ``initial_heartbeat_s`` (before the first heartbeat of an attempt: start and restore) is never
    derived: it keeps the configured value."""

    heartbeat_s: float
    sections: dict[str, float]
    initial_heartbeat_s: float
    floor_s: float
    ceiling_s: float
    safety_factor: float
    measured_heartbeat_interval_s: float
    measured_section_s: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check_int(name: str, value: Any, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise ConfigError(f"{name}={value} is out of range: it must be between {lo} and {hi}")


def _check_float(name: str, value: Any, lo: float, hi: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    if not lo <= value <= hi:
        raise ConfigError(f"{name}={value} is out of range: it must be between {lo} and {hi}")


def _check_folder_path(name: str, value: str) -> None:
    """A folder path must not be, or sit under, something that is not a folder (a regular file):
    nothing could ever be written there. Parts that do not exist yet are fine (created later; on
    the control plane an FSx path is usually not mounted at all)."""
    path = Path(value)
    for candidate in (path, *path.parents):
        try:
            if candidate.exists():
                if not candidate.is_dir():
                    what = "is" if candidate == path else f"sits under {candidate}, which is"
                    raise ConfigError(f"{name}={value} {what} a file, not a folder; choose a folder path")
                return
        except OSError:  # unreadable or too long: let the first real access report it
            return


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name}={value!r} is not valid; use one of {', '.join(choices)}")


@dataclass(frozen=True)
class RunConfig:
    """Everything a training run needs; both planes build it, one JSON file carries it."""

    run_id: str
    run_dir: str
    dataset_dir: str
    model: str = "tiny"
    nodes: int = 1
    #: Hot spares: node launchers started beyond ``nodes`` that wait in the rendezvous without
    #: training, and take a lost node's place at the next in-job restart (no relaunch). Ranks,
    #: data order and checkpoints stay those of ``nodes`` nodes.
    spare_nodes: int = 0
    procs_per_node: int = 2
    steps: int = 100
    batch_size: int = 8  # sequences per rank per step
    seq_len: int = 128
    lr: float = 3e-3
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 1234
    checkpoint_interval: int = 10  # steps between checkpoints
    keep_checkpoints: int = 3  # committed checkpoints retention keeps
    restart_mode: str = "layered"
    max_restarts: int = 3  # in-job (ft_launcher) restarts
    max_inprocess_restarts: int = 5  # in-process (Wrapper) restarts per launcher round
    #: The process groups' collective timeout. None: derived per backend (``timeouts``): 30 s on
    #: gloo, where it bounds in-process restart latency; above the Wrapper's hard timeout on NCCL.
    collective_timeout_s: float | None = None
    heartbeat_timeout_s: float = 120.0  # ft_launcher: a rank silent this long is restarted
    initial_heartbeat_timeout_s: float = 600.0  # ...before its first heartbeat (start, restore)
    hang_timeout_s: float = 60.0  # Wrapper soft timeout (hard = 2x): no progress this long -> restart
    #: ft_launcher's heartbeat and step / checkpoint section timeouts are derived once an attempt
    #: has run its warm steps and two saves (src/fsdp_resilience/training/restart.py: RankMonitor): this factor x the
    #: longest interval seen after the first save, kept above the restart layers' order and never
    #: above ``heartbeat_timeout_s``, which is what applies until then (``RestartTimeouts.derive``).
    timeout_safety_factor: float = 5.0
    stall_timeout_s: float = 1800.0  # no new committed checkpoint this long -> NO_PROGRESS
    device: str = "auto"
    rdzv_port: int = 29400
    log_interval: int = 1
    eval_batches: int = 8
    #: NVRx's NVML GPU / NVLink / NIC checks before an in-process restart (CUDA only; a rank that
    #: fails them leaves the job, so ft_launcher restarts it or the ladder replaces the node).
    gpu_health_checks: bool = True
    #: Times a NaN/inf loss or grad norm rolls the run back to the newest verified checkpoint
    #: before it ends as ``non_finite``.
    max_nonfinite_rollbacks: int = 2
    faults: tuple[FaultDrill, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        # Accept faults as dicts (from JSON) and normalise to FaultDrill tuples.
        faults = []
        for i, f in enumerate(self.faults or ()):
            if isinstance(f, FaultDrill):
                faults.append(f)
            elif isinstance(f, dict):
                unknown = set(f) - {x.name for x in dataclasses.fields(FaultDrill)}
                if unknown:
                    raise ConfigError(f"faults[{i}] has unknown field(s) {sorted(unknown)}")
                try:
                    faults.append(FaultDrill(**f))
                except TypeError as e:
                    raise ConfigError(f"faults[{i}] is incomplete: {e}; it needs kind and step") from None
            else:
                raise ConfigError(f"faults[{i}] must be an object with kind and step, got {f!r}")
        object.__setattr__(self, "faults", tuple(faults))
        self.validate()

    # -- derived ------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node

    @property
    def launch_nodes(self) -> int:
        """Node launchers a launch starts: the training nodes and the spares behind them."""
        return self.nodes + self.spare_nodes

    @property
    def node_rank_limit(self) -> int:
        """Node indices a launcher of this run may hold: the launch's own, then the indices of
        spares added while it runs (each refill takes a new one, so no two live launchers of a
        run ever share an index, nor NVRx 0.7's infrastructure rank that follows it)."""
        return self.launch_nodes + MAX_SPARE_REFILLS

    @property
    def layout(self) -> "RunDir":
        return RunDir(self.run_dir)

    @property
    def collective_backends(self) -> tuple[str, ...]:
        """The collective backends this run may use: its device decides (``auto``: either)."""
        return {"cpu": ("gloo",), "cuda": ("nccl",)}.get(self.device, ("gloo", "nccl"))

    def timeouts(self, backend: str) -> "RestartTimeouts":
        """Every restart-layer timeout of this run on ``backend`` ("gloo" or "nccl")."""
        if backend not in ("gloo", "nccl"):
            raise ConfigError(f"collective backend {backend!r} is not supported; use gloo or nccl")
        hard = 2 * self.hang_timeout_s
        collective = self.collective_timeout_s
        if collective is None:
            collective = DEFAULT_GLOO_COLLECTIVE_TIMEOUT_S if backend == "gloo" else hard + NCCL_TIMEOUT_MARGIN_S
        return RestartTimeouts(backend=backend, collective_s=float(collective), soft_s=self.hang_timeout_s,
                               hard_s=hard, heartbeat_s=self.heartbeat_timeout_s,
                               initial_heartbeat_s=self.initial_heartbeat_timeout_s)

    def section_timeouts(self) -> dict[str, float]:
        """ft_launcher's section timeouts as configured (the sections RankMonitor reports): what
        applies until timeouts are derived, and, after that, while ``setup`` (start, process
        group, restore) or ``final_checkpoint`` (waiting for the last write) is open."""
        return {"setup": self.initial_heartbeat_timeout_s, "step": self.heartbeat_timeout_s,
                "checkpoint": self.heartbeat_timeout_s, "final_checkpoint": self.initial_heartbeat_timeout_s}

    # -- validation ---------------------------------------------------------------------------
    def validate(self) -> None:
        if not isinstance(self.run_id, str) or not _RUN_ID_RE.match(self.run_id):
            raise ConfigError(
                f"run_id={self.run_id!r} must be 1-63 lowercase letters, digits or '-', "
                "starting and ending with a letter or digit (it names Kubernetes objects)"
            )
        for name in ("run_dir", "dataset_dir"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ConfigError(f"{name} must be a non-empty path, got {value!r}")
        _check_choice("model", self.model, MODEL_PRESETS)
        _check_int("nodes", self.nodes, 1, 1024)
        _check_int("spare_nodes", self.spare_nodes, 0, MAX_SPARE_NODES)
        _check_int("procs_per_node", self.procs_per_node, 1, 64)
        _check_int("steps", self.steps, 1, 10_000_000)
        _check_int("batch_size", self.batch_size, 1, 65_536)
        _check_int("seq_len", self.seq_len, 8, 131_072)
        _check_float("lr", self.lr, 0.0, 10.0)
        if self.lr == 0:
            raise ConfigError("lr must be greater than 0")
        _check_float("weight_decay", self.weight_decay, 0.0, 10.0)
        _check_float("grad_clip", self.grad_clip, 0.0, 1e6)
        _check_int("seed", self.seed, 0, 2**31 - 1)
        _check_int("checkpoint_interval", self.checkpoint_interval, 1, 10_000_000)
        _check_int("keep_checkpoints", self.keep_checkpoints, 1, 1000)
        _check_choice("restart_mode", self.restart_mode, RESTART_MODES)
        if self.spare_nodes and self.restart_mode not in ("layered", "injob"):
            raise ConfigError(f"spare_nodes={self.spare_nodes} needs in-job restarts (restart_mode layered or injob; "
                              f"it is {self.restart_mode}): a spare takes a lost node's place at an in-job restart")
        _check_int("max_restarts", self.max_restarts, 0, 1000)
        _check_int("max_inprocess_restarts", self.max_inprocess_restarts, 0, 1000)
        if self.collective_timeout_s is not None:
            _check_float("collective_timeout_s", self.collective_timeout_s, 0.5, 3600.0)
        _check_float("heartbeat_timeout_s", self.heartbeat_timeout_s, 1.0, 86_400.0)
        _check_float("initial_heartbeat_timeout_s", self.initial_heartbeat_timeout_s, 1.0, 86_400.0)
        _check_float("hang_timeout_s", self.hang_timeout_s, 1.0, 86_400.0)
        _check_float("timeout_safety_factor", self.timeout_safety_factor, 1.0, 100.0)
        _check_float("stall_timeout_s", self.stall_timeout_s, 1.0, 30 * 86_400.0)
        _check_choice("device", self.device, DEVICES)
        _check_int("rdzv_port", self.rdzv_port, 1024, 65_000)
        _check_int("log_interval", self.log_interval, 1, 1_000_000)
        _check_int("eval_batches", self.eval_batches, 1, 100_000)
        _check_int("max_nonfinite_rollbacks", self.max_nonfinite_rollbacks, 0, 100)
        if not isinstance(self.gpu_health_checks, bool):
            raise ConfigError(f"gpu_health_checks must be true or false, got {self.gpu_health_checks!r}")
        for backend in self.collective_backends:
            self.timeouts(backend).check(self.restart_mode)
        for name in ("run_dir", "dataset_dir"):
            _check_folder_path(name, getattr(self, name))
        for i, f in enumerate(self.faults):
            f.validate(self, f"faults[{i}]")

    # -- (de)serialisation --------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["faults"] = [dataclasses.asdict(f) for f in self.faults]
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RunConfig":
        if not isinstance(data, dict):
            raise ConfigError(f"a run config must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown run config field(s) {unknown}; known fields: {sorted(known)}")
        missing = sorted(f.name for f in dataclasses.fields(cls)
                         if f.name not in data and f.default is dataclasses.MISSING
                         and f.default_factory is dataclasses.MISSING)
        if missing:
            raise ConfigError(f"run config is missing required field(s) {missing}")
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> "RunConfig":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"run config is not valid JSON: {e}") from None
        return cls.from_dict(data)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "RunConfig":
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ConfigError(f"cannot read run config {path}: {e.strerror}") from None
        return cls.from_json(text)

    def replace(self, **changes: Any) -> "RunConfig":
        return dataclasses.replace(self, **changes)

    def fault_at(self, step: int, rank: int, attempt: int, node: int,
                 node_id: str | None = None, loss_target: int | None = None) -> FaultDrill | None:
        """The drill that fires at this step in this rank, launcher attempt and node, if any
        (``loss_target``: the node a ``node_loss`` with node null takes down, see FaultDrill)."""
        for f in self.faults:
            if f.step != step:
                continue
            if f.kind != "user_bug" and f.attempt is not None and f.attempt != attempt:
                continue
            if f.node_id is not None and f.node_id != node_id:
                continue
            if f.kind == "node_loss" and (f.node == node or (f.node is None and node == loss_target)):
                return f
            if f.kind != "node_loss" and f.rank == rank:
                return f
        return None


# --------------------------------------------------------------------------------------------
# Run-dir and checkpoint layout
# --------------------------------------------------------------------------------------------

CHECKPOINT_PREFIX = "step_"
COMMIT_MARKER = "COMMITTED.json"
QUARANTINE_DIR = "quarantine"
QUARANTINE_RECORD = "QUARANTINED.json"
#: Per-rank checksum records inside a checkpoint folder, written by each rank's writer.
SUMS_DIR = ".sums"
#: The checksum of every checkpoint file: CRC32C (hardware-accelerated, the one S3 also offers).
CHECKSUM_ALGORITHM = "crc32c"
_CHUNK = 8 << 20


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so a reader sees the old file or the whole new one, never part."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    try:  # make the rename durable (matters on a crash, not for correctness of readers)
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


class RunDir:
    """The layout of one run's folder (a local folder, or FSx for Lustre on EKS)::

        <run_dir>/
          run.json                 the config as launched
          events.jsonl             append-only events log (schema: Event)
          eval.json                written by fsdp_resilience.training.evaluate
          timeouts.json            ft_launcher's timeouts as derived from the measured steps and
                                   saves (DerivedTimeouts), by rank 0 at each derivation; run.json
                                   keeps what was asked for
          control/STOP.json        written by the first rank that hits a fault no restart can fix
                                   (user error, non-finite state, storage): every layer stops
          control/launch-node<N>.lock  held (flock) by the one fsdp_resilience.training.launch of node N
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


def file_checksum(path: str | os.PathLike) -> dict[str, Any]:
    """``{"size": bytes, "crc32c": hex}`` of a file's bytes on disk (CRC32C releases the GIL and
    runs at several GiB/s here, so a writer or a background thread can afford it)."""
    import crc32c  # a small C extension, installed on both planes; imported late to keep this module's import stdlib-only

    value, size = 0, 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            value = crc32c.crc32c(view[:n], value)
            size += n
    return {"size": size, CHECKSUM_ALGORITHM: f"{value:08x}"}


def checkpoint_files(path: str | os.PathLike) -> list[str]:
    """The data files of a checkpoint folder (shards and ``.metadata``), relative names, sorted:
    everything but the protocol's own records."""
    root = Path(path)
    out = []
    for p in root.rglob("*"):
        rel = p.relative_to(root)
        if p.is_file() and rel.parts[0] not in (SUMS_DIR, COMMIT_MARKER, QUARANTINE_RECORD):
            out.append(rel.as_posix())
    return sorted(out)


def write_rank_sums(path: str | os.PathLike, rank: int, names: list[str]) -> dict[str, dict[str, Any]]:
    """Checksum ``names`` (the files rank ``rank`` wrote into checkpoint ``path``) and record them
    in ``.sums/rank_NNNNN.json`` for the commit. Run by the rank's writer, after its write."""
    root = Path(path)
    sums = {name: file_checksum(root / name) for name in names}
    (root / SUMS_DIR).mkdir(exist_ok=True)
    atomic_write_text(root / SUMS_DIR / f"rank_{rank:05d}.json", json.dumps(sums, sort_keys=True))
    return sums


def read_rank_sums(path: str | os.PathLike, world_size: int) -> dict[str, dict[str, Any]]:
    """Every rank's checksum record merged; raises if a rank's is missing or unreadable."""
    files: dict[str, dict[str, Any]] = {}
    missing = []
    for rank in range(world_size):
        record = Path(path) / SUMS_DIR / f"rank_{rank:05d}.json"
        try:
            data = json.loads(record.read_text())
        except (OSError, ValueError):
            missing.append(rank)
            continue
        files.update(data)
    if missing:
        raise RuntimeError(f"cannot commit {Path(path).name}: no checksums from rank(s) {missing[:8]}")
    return files


def verify_checkpoint(path: str | os.PathLike, marker: dict[str, Any] | None = None,
                      checksum: list[str] | None = None) -> str | None:
    """Why checkpoint ``path`` cannot be trusted, or None when it verifies.

    Always checks that the marker lists every file with a checksum, and that each file exists
    with its recorded size (a ``stat`` each). Reads and checksums the files named in ``checksum``
    (None: all of them), so ranks can split the reading between them."""
    path = Path(path)
    if marker is None:
        marker = read_commit_marker(path)
    if marker is None:
        return "no readable commit marker"
    files = marker.get("files")
    if not isinstance(files, dict) or ".metadata" not in files:
        return "the commit marker lists no checksummed files (written before checksums, or damaged)"
    if marker.get("checksum") != CHECKSUM_ALGORITHM:
        return f"the commit marker's checksum is {marker.get('checksum')!r}, not {CHECKSUM_ALGORITHM}"
    for name, want in files.items():
        if not isinstance(want, dict) or not isinstance(want.get("size"), int):
            return f"the commit marker's entry for {name} is damaged"
        try:
            size = (path / name).stat().st_size
        except FileNotFoundError:
            return f"{name} is missing"
        except OSError as e:
            return f"{name} is unreadable: {e.strerror or e}"
        if size != want["size"]:
            return f"{name} is {size} bytes, the commit recorded {want['size']}"
    for name in (sorted(files) if checksum is None else checksum):
        if name not in files:
            continue
        try:
            got = file_checksum(path / name)
        except OSError as e:
            return f"{name} is unreadable: {e.strerror or e}"
        if got != files[name]:
            return (f"{name} fails its {CHECKSUM_ALGORITHM} check (recorded {files[name].get(CHECKSUM_ALGORITHM)}, "
                    f"read {got[CHECKSUM_ALGORITHM]}, {got['size']} bytes)")
    return None


def checksum_share(files: list[str], rank: int, world_size: int) -> list[str]:
    """The files rank ``rank`` checksums when ``world_size`` ranks verify one checkpoint together:
    its own shards (``__<rank>_*``: in the page cache, and read by its load anyway), ``.metadata``
    on rank 0, and shards of ranks that no longer exist, round-robin."""
    mine = []
    orphans = []
    for name in files:
        owner = _shard_owner(name)
        if owner is None:
            if rank == 0:
                mine.append(name)
        elif owner < world_size:
            if owner == rank:
                mine.append(name)
        else:
            orphans.append(name)
    mine += [n for i, n in enumerate(orphans) if i % world_size == rank]
    return mine


def _shard_owner(name: str) -> int | None:
    """DCP names shard files ``__<rank>_<n>.distcp``."""
    match = re.match(r"__(\d+)_\d+\.distcp$", Path(name).name)
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: Path
    committed: bool
    world_size: int | None = None
    committed_at: float | None = None

    @property
    def checkpoint_id(self) -> str:
        return self.path.name


class CheckpointCatalog:
    """The checkpoints of one run and the commit protocol, readable without torch.

    Protocol: every rank's writer writes its shard files into ``step_N/`` and then their sizes and
    CRC32C into ``step_N/.sums/``; when all ranks have finished (the save's finalize synchronises
    them) rank 0 writes DCP's ``.metadata``, then the commit marker atomically, listing every file
    with its size and checksum, then moves ``latest``. A folder without the marker is torn: never
    loaded, never counted. A marker without checksums is not a commit.

    Trust: the marker, not ``latest``, is the source of truth (``latest`` is a hint for humans
    and tools that cannot list a folder), and a committed checkpoint is loaded only after
    ``verify_checkpoint``. One that fails is moved to ``quarantine/`` with the reason, so no
    restart layer tries it again, and the newest earlier one that verifies is used instead.
    """

    def __init__(self, run_dir: str | os.PathLike | RunDir):
        self.layout = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)

    def _scan(self) -> Iterator[CheckpointInfo]:
        root = self.layout.checkpoints
        if not root.is_dir():
            return
        for p in root.iterdir():
            step = checkpoint_step(p.name)
            if step is None or not p.is_dir():
                continue
            marker = read_commit_marker(p)
            if marker is None:
                yield CheckpointInfo(step, p, committed=False)
            else:
                yield CheckpointInfo(step, p, True, marker.get("world_size"), marker.get("committed_at"))

    def all(self) -> list[CheckpointInfo]:
        return sorted(self._scan(), key=lambda c: c.step)

    def committed(self) -> list[CheckpointInfo]:
        return [c for c in self.all() if c.committed]

    def torn(self) -> list[CheckpointInfo]:
        return [c for c in self.all() if not c.committed]

    def latest(self) -> CheckpointInfo | None:
        """The newest committed checkpoint, or None. Not yet verified: see ``verify_checkpoint``."""
        committed = self.committed()
        return committed[-1] if committed else None

    def latest_hint(self) -> str | None:
        """What the ``latest`` pointer names, if it names a checkpoint folder; None if the pointer
        is missing or garbage. A hint only: ``latest()`` never reads it."""
        try:
            name = self.layout.latest_pointer.read_text(errors="replace").strip()
        except OSError:
            return None
        return name if checkpoint_step(name) is not None else None

    def commit(self, step: int, world_size: int, extra: dict[str, Any] | None = None) -> CheckpointInfo:
        """Mark ``step`` committed and move ``latest`` (rank 0 only, after every rank finished).

        The marker lists every data file with the size and checksum its writer recorded, plus
        ``.metadata``'s, checksummed here. Refuses (raises) when a rank's checksums are missing or
        a file in the folder has none: a checkpoint without its checksums is not committed."""
        path = self.layout.checkpoint_dir(step)
        if not (path / ".metadata").is_file():
            raise RuntimeError(f"cannot commit {path}: DCP .metadata is missing (the save did not finish)")
        files = read_rank_sums(path, world_size)
        files[".metadata"] = file_checksum(path / ".metadata")
        unlisted = sorted(set(checkpoint_files(path)) - set(files))
        if unlisted:
            raise RuntimeError(f"cannot commit {path.name}: no checksum for {unlisted[:5]}")
        reason = verify_checkpoint(path, {"files": files, "checksum": CHECKSUM_ALGORITHM}, checksum=[])
        if reason:
            raise RuntimeError(f"cannot commit {path.name}: {reason}")
        now = time.time()
        marker = {"step": step, "world_size": world_size, "committed_at": now,
                  "contract_version": CONTRACT_VERSION, "checksum": CHECKSUM_ALGORITHM, "files": files,
                  **(extra or {})}
        atomic_write_text(path / COMMIT_MARKER, json.dumps(marker, sort_keys=True))
        atomic_write_text(self.layout.latest_pointer, path.name + "\n")
        atomic_write_text(self.layout.latest_step, f"{step}\n")
        return CheckpointInfo(step, path, True, world_size, now)

    def quarantine(self, info: CheckpointInfo, reason: str, **record: Any) -> Path:
        """Move a checkpoint that failed verification out of the catalog, with why, and return
        where it went. Never deletes: a user may still want to inspect or salvage it."""
        dest_root = self.layout.quarantine
        dest_root.mkdir(parents=True, exist_ok=True)
        dest = dest_root / f"{info.path.name}.{int(time.time() * 1000)}"
        os.rename(info.path, dest)
        atomic_write_text(dest / QUARANTINE_RECORD, json.dumps(
            {"checkpoint_id": info.checkpoint_id, "step": info.step, "reason": reason,
             "quarantined_at": time.time(), **record}, sort_keys=True, default=str))
        if self.latest_hint() == info.path.name:
            newest = self.latest()
            if newest is not None:
                atomic_write_text(self.layout.latest_pointer, newest.path.name + "\n")
                atomic_write_text(self.layout.latest_step, f"{newest.step}\n")
            else:
                for pointer in (self.layout.latest_pointer, self.layout.latest_step):
                    try:
                        pointer.unlink()
                    except FileNotFoundError:
                        pass
        return dest

    def quarantined(self) -> list[dict[str, Any]]:
        """The quarantine's records (``path`` added), oldest first."""
        out = []
        root = self.layout.quarantine
        if root.is_dir():
            for p in sorted(root.iterdir()):
                try:
                    rec = json.loads((p / QUARANTINE_RECORD).read_text())
                except (OSError, ValueError):
                    rec = {"checkpoint_id": p.name.split(".")[0], "reason": "unknown (no readable record)"}
                out.append({**rec, "path": str(p)})
        return sorted(out, key=lambda r: r.get("quarantined_at", 0))

    def apply_retention(self, keep: int, protect: tuple[int, ...] | set[int] = ()) -> list[Path]:
        """Delete all but the newest ``keep`` committed checkpoints, and torn folders older than the
        newest committed one (they can never be loaded). Newer torn folders are left alone: a save
        may still be writing them. Returns what was deleted.

        Never deleted: the steps in ``protect`` (the caller's newest verified checkpoint), and,
        when none of the kept ones passes the size check of ``verify_checkpoint``, the newest
        older one that does, so damaged newer checkpoints never take the last good one with them."""
        committed = self.committed()
        if not committed:
            return []
        newest = committed[-1].step
        kept, older = committed[-keep:], committed[:-keep] if len(committed) > keep else []
        spared = {c.step for c in older if c.step in set(protect)}
        if older and not any(verify_checkpoint(c.path, checksum=[]) is None for c in kept):
            fallback = next((c for c in reversed(older) if verify_checkpoint(c.path, checksum=[]) is None), None)
            if fallback is not None:
                spared.add(fallback.step)
        doomed = [c.path for c in older if c.step not in spared]
        doomed += [c.path for c in self.torn() if c.step < newest]
        for p in doomed:
            # Remove the marker first so a crash mid-delete leaves a torn (ignored) folder.
            try:
                (p / COMMIT_MARKER).unlink()
            except FileNotFoundError:
                pass
            shutil.rmtree(p, ignore_errors=True)
        return doomed


def parse_commit_marker(text: str | bytes) -> dict[str, Any] | None:
    """A commit marker's content: a JSON object, or None (unreadable: the checkpoint is torn).
    Wherever the marker was read from (the run dir, its S3 export)."""
    try:
        data = json.loads(text)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def read_commit_marker(path: Path) -> dict[str, Any] | None:
    try:
        text = (Path(path) / COMMIT_MARKER).read_bytes()
    except OSError:
        return None
    return parse_commit_marker(text)


def checkpoint_step(name: str) -> int | None:
    """The step of a checkpoint folder's name (``step_00000020`` -> 20); None if it is not one."""
    if not name.startswith(CHECKPOINT_PREFIX):
        return None
    try:
        return int(name[len(CHECKPOINT_PREFIX):])
    except ValueError:
        return None


# --------------------------------------------------------------------------------------------
# Dataset layout (written by fsdp_resilience.training.prepare_data or the control plane's staging, read by
# fsdp_resilience.training.data). Format "byte-tokens-v1": index.json + little-endian uint16 token shards.
# --------------------------------------------------------------------------------------------

DATASET_FORMAT = "byte-tokens-v1"
DATASET_INDEX = "index.json"
DATASET_TOKEN_DTYPE = "uint16"
DATASET_SPLITS = ("train", "val")
HOW_TO_PREPARE = "run python -m fsdp_resilience.training.prepare_data SRC DST"


class DatasetError(ConfigError):
    """The dataset folder is missing, damaged, or too small for the run: a config error."""


def read_dataset_index(dataset_dir: str | os.PathLike) -> dict[str, Any]:
    """The dataset's index.json, checked for format and for train and val shards."""
    path = Path(dataset_dir) / DATASET_INDEX
    try:
        index = json.loads(path.read_text())
    except FileNotFoundError:
        raise DatasetError(f"no dataset at {path} (index.json is missing); {HOW_TO_PREPARE}") from None
    except (OSError, ValueError) as e:
        raise DatasetError(f"dataset index {path} is unreadable or corrupt ({e}); {HOW_TO_PREPARE}") from None
    if (not isinstance(index, dict) or index.get("format") != DATASET_FORMAT
            or index.get("dtype") != DATASET_TOKEN_DTYPE):
        raise DatasetError(f"{path} is not a {DATASET_FORMAT} dataset index; {HOW_TO_PREPARE}")
    for split in DATASET_SPLITS:
        if not isinstance(index.get(split), list) or not index[split]:
            raise DatasetError(f"{path} lists no {split} shards; {HOW_TO_PREPARE}")
    return index


# --------------------------------------------------------------------------------------------
# Events log
# --------------------------------------------------------------------------------------------


class Event(str, enum.Enum):
    """Event types in ``events.jsonl``. Every line is one JSON object with at least
    ``ts`` (unix seconds), ``event``, ``run_id``, ``host``, ``node_id``, ``pid`` and, when known, ``rank``,
    ``node_rank``, ``attempt`` (launcher restart round) and ``iteration`` (in-process round).

    Type-specific fields:
      launch_begin       nodes, spare_nodes, procs_per_node, restart_mode, command, standby (a
                         spare: it waits in the rendezvous until a node is lost)
      train_begin        start_step, world_size, device, resumed_from (checkpoint id or null), rng
                         ("seeded" | "restored" | "reseeded": each rank's RNG state, from the seed, the
                         checkpoint, or the seed again when the world size changed)
      step               step, loss, tokens_per_s, step_s
      checkpoint_begin   step, blocking_s (time the training loop was stopped for the save), mode,
                         snapshot_s
      checkpoint_commit  step, checkpoint_id, save_s (begin -> commit, wall seconds)
      checkpoint_skip    checkpoint_id, step, reason (passed over at resume or evaluation: torn,
                         or no checkpoint verifies)
      checkpoint_quarantined  checkpoint_id, step, reason, moved_to (failed verification or its load;
                         moved to checkpoints/quarantine/, never tried again)
      checkpoint_stale   step, checkpoint_id, same_as (its model bytes equal an earlier checkpoint's
                         although steps advanced: the save wrote stale state)
      fault_injected     kind, step (a drill fired; written before the fault happens)
      fault_detected     layer, kind, step, error, signature, repeated (same error, same step,
                         seen before: a user error), failure_class (what the fault points at:
                         restarts_exhausted for the machine; user_error, non_finite,
                         storage_error, or "checkpoint" for a restore that failed on a file),
                         restoring; for non_finite (rank 0): first_step, ranks, rollbacks_before,
                         max_rollbacks
      restart_begin      layer ("inprocess" | "injob" | "relaunch" | "rollback": non-finite state,
                         restored in place), reason, fault_ts
      restart_end        layer, step, latency_s (the fault, or the last step before it, -> the
                         first step completed after it)
      train_end          step, status
      final              failure_class, exit_code, step, message (one per launcher, per node)
      eval               checkpoint_id, step, val_loss, perplexity
      escalation         rung, from_launch, to_launch, failure_class, nodes (node ids replaced),
                         reason (the control plane replaced nodes and relaunched)
      spare_promoted     node_id, node_rank (the spare now training), replaces (node ids that
                         trained in the attempt before and not in this one), members (node ids
                         training now), attempt (global rank 0, at the start of the first attempt
                         a spare trains in; from the membership record control/membership.json)
      spare_added        lost_node_id, lost_node_rank, quarantined (node ids), node_id, node_rank
                         (the new spare), reason (the control plane refilled the spare pool
                         while training went on)
      timeouts_derived   step, and DerivedTimeouts' fields: heartbeat_s, sections, floor_s,
                         ceiling_s, safety_factor, measured_heartbeat_interval_s,
                         measured_section_s (rank 0; once per attempt and in-process
                         iteration, after its warm steps and second save)
    """

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


#: Set by the backend for every process of a node: the Kubernetes node name on EKS (downward
#: API ``spec.nodeName``), the slot name on the local backend. Diagnosis maps faults to nodes by it.
NODE_ID_ENV = "TRAINING_NODE_ID"


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
            print(f"[events] cannot append to {self.path} ({e.strerror or e}): {line.decode().strip()}",
                  file=sys.stderr, flush=True)
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


def record_membership(layout: RunDir, events: EventLog, launch_id: str, attempt: int,
                      members: list[tuple[int, str]]) -> list[dict[str, Any]]:
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
            emitted.append(events.emit(Event.SPARE_PROMOTED, node_id=node, node_rank=rank,
                                       replaces=[n for _, n in left], replaced_node_ranks=[r for r, _ in left],
                                       members=[n for _, n in now], previous_attempt=before.get("attempt")))
    try:
        layout.control.mkdir(parents=True, exist_ok=True)
        atomic_write_text(layout.membership, json.dumps({"launch_id": launch_id, "attempt": attempt,
                                                         "members": now, "ts": time.time()}) + "\n")
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


def final_status(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The run's outcome: the last ``final`` record (the worst across nodes if several ended the
    same launch), or None while it is still running."""
    finals = read_events(RunDir(run_dir).events, Event.FINAL)
    if not finals:
        return None
    last_launch = finals[-1].get("launch_id", "")  # the log is in time order
    same = [r for r in finals if r.get("launch_id", "") == last_launch]
    failed = [r for r in same if r.get("failure_class") != FailureClass.SUCCESS.value]
    return (failed or same)[-1]
