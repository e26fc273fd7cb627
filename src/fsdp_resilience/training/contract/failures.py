"""Exit codes and failure classes: why a run ended, and what each plane does about it.

``ExitCode`` is the launcher's (the pod's, the Job's) exit code; ``FailureClass`` is what it
stands for. The failure rules live beside them: which classes a node replacement can fix
(``REPLACEABLE_FAILURES``), which end a job at once (``FINAL_FAILURES``), which tells most when
nodes disagree (``FAILURE_PRIORITY``) and what the user should do (``WHAT_TO_DO``).
"""

from __future__ import annotations

import enum
import errno
import os
import re
import signal


class ConfigError(ValueError):
    """A run config value is wrong. The message names the field and what to do."""


class FailureClass(str, enum.Enum):
    """Why a run ended; decides what the control plane does next."""

    #: Trained every step; the final checkpoint is committed.
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
    #: The launcher started after its launch had ended (a launcher of the launch wrote a ``final``
    #: record with a decisive class): it did nothing and left at once. On EKS, the pod the Job
    #: recreates for an index after the launch ended (it could not reach the rendezvous, whose pod
    #: is gone); the Job's podFailurePolicy ignores its exit, so it never uses up backoffLimit, and
    #: it never changes the run's status.
    LAUNCH_ENDED = "launch_ended"
    #: The launcher itself failed in a way not covered above (e.g. killed from outside).
    UNKNOWN = "unknown"

    @property
    def retryable(self) -> bool:
        """Whether relaunching (possibly on a replaced node) can help."""
        return self in (FailureClass.RESTARTS_EXHAUSTED, FailureClass.NO_PROGRESS)


class ExitCode(enum.IntEnum):
    """Exit codes of ``python -m fsdp_resilience.training.launch``: the pod's, and so the Job's, exit code."""

    #: Trained every step; the final checkpoint is committed.
    SUCCESS = 0
    #: Anything else: killed from outside, or the workers never started.
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
    #: sysexits EX_UNAVAILABLE: the launch this launcher belongs to had already ended when it
    #: started (a pod recreated after the end); it did nothing. Never counted against the Job's
    #: backoffLimit (a podFailurePolicy Ignore rule), never the run's outcome.
    LAUNCH_ENDED = 69


_EXIT_TO_CLASS = {
    ExitCode.SUCCESS: FailureClass.SUCCESS,
    ExitCode.CONFIG_ERROR: FailureClass.USER_ERROR,
    ExitCode.USER_ERROR: FailureClass.USER_ERROR,
    ExitCode.RESTARTS_EXHAUSTED: FailureClass.RESTARTS_EXHAUSTED,
    ExitCode.NO_PROGRESS: FailureClass.NO_PROGRESS,
    ExitCode.NON_FINITE: FailureClass.NON_FINITE,
    ExitCode.ALREADY_RUNNING: FailureClass.ALREADY_RUNNING,
    ExitCode.STORAGE_ERROR: FailureClass.STORAGE_ERROR,
    ExitCode.LAUNCH_ENDED: FailureClass.LAUNCH_ENDED,
}

_CLASS_TO_EXIT = {
    FailureClass.SUCCESS: ExitCode.SUCCESS,
    FailureClass.USER_ERROR: ExitCode.USER_ERROR,
    FailureClass.RESTARTS_EXHAUSTED: ExitCode.RESTARTS_EXHAUSTED,
    FailureClass.NO_PROGRESS: ExitCode.NO_PROGRESS,
    FailureClass.STORAGE_ERROR: ExitCode.STORAGE_ERROR,
    FailureClass.NON_FINITE: ExitCode.NON_FINITE,
    FailureClass.ALREADY_RUNNING: ExitCode.ALREADY_RUNNING,
    FailureClass.LAUNCH_ENDED: ExitCode.LAUNCH_ENDED,
    FailureClass.UNKNOWN: ExitCode.UNKNOWN,
}

#: Failure classes a rank declares in the stop marker (``declare_stop``): every restart layer stops.
STOP_CLASSES = (FailureClass.USER_ERROR, FailureClass.NON_FINITE, FailureClass.STORAGE_ERROR)

#: Failure classes for which replacing the blamed node(s) and relaunching can help
#: (``FailureClass.retryable``). Never ``user_error``: a bug fails the same way on any machine.
REPLACEABLE_FAILURES = frozenset(c.value for c in FailureClass if c.retryable)

#: Failure classes a launcher ends with by its own decision (not killed, not lost): its node's exit
#: fails the whole job at once (the EKS Job's podFailurePolicy FailJob rules), since no other pod
#: of the same job can do better. Not ``launch_ended``: that launcher came after the end and
#: decides nothing (the Job ignores its exit).
FINAL_FAILURES = frozenset(
    c.value for c in FailureClass if c not in (FailureClass.SUCCESS, FailureClass.UNKNOWN, FailureClass.LAUNCH_ENDED)
)

#: Classes of a ``final`` record that end its launch: the run trained every step, or failed in a
#: way that ends the launch (``FINAL_FAILURES``). A launcher that starts later for the same launch
#: (``launch_ended_by``) exits ``launch_ended`` at once. Not ``unknown``: a node killed or a spare
#: dropped leaves the launch running.
LAUNCH_ENDING_FAILURES = FINAL_FAILURES | {FailureClass.SUCCESS.value}

#: When the nodes of one job fail differently, the job is reported with the most telling class.
#: First the classes that must never be retried, most specific first: another launcher owns the
#: run (whatever else our nodes report follows from that), the storage, the training state, the
#: user's code; then the restart layers giving up (or a lost node), then no progress; ``unknown``
#: (e.g. a node stopped because a peer failed) tells little, and ``launch_ended`` (a launcher that
#: came after the end) nothing.
FAILURE_PRIORITY = (
    FailureClass.ALREADY_RUNNING.value,
    FailureClass.STORAGE_ERROR.value,
    FailureClass.NON_FINITE.value,
    FailureClass.USER_ERROR.value,
    FailureClass.RESTARTS_EXHAUSTED.value,
    FailureClass.NO_PROGRESS.value,
    FailureClass.UNKNOWN.value,
    FailureClass.LAUNCH_ENDED.value,
)

#: What the user should do about a launch that ended with a class no node replacement can fix.
#: Diagnosis, the ladder and the DAG's failure message all say it the same way.
WHAT_TO_DO = {
    FailureClass.USER_ERROR.value: "a user error fails the same way on any node: fix the code or config, then "
    "trigger the run again; "
    "no node was touched",
    FailureClass.STORAGE_ERROR.value: "the run dir is full or read-only (storage, not a node fault): free space on "
    "it or fix its mount; or the node's /dev/shm, where checkpoints are staged, is full (on EKS: raise "
    "PodTemplateSettings.shm_size, or leave it unset to size it from the model); "
    "then trigger the run again (it resumes from the newest verified checkpoint); no node was touched",
    FailureClass.NON_FINITE.value: "the loss or gradient norm became NaN/inf again after max_nonfinite_rollbacks "
    "rollbacks to the newest "
    "verified checkpoint: the run diverges. Lower lr (or grad_clip), or check the data, then trigger the "
    "run again; no node was touched",
    FailureClass.ALREADY_RUNNING.value: "another fsdp_resilience.training.launch of this run holds its launch lock: "
    "the run is being trained by "
    "another launcher. This launch did nothing; that launcher was left alone and the run's status is unchanged. "
    "Watch it (events.jsonl), or stop it before triggering this run again, or pick another run_name",
    FailureClass.LAUNCH_ENDED.value: "this launcher started after its launch had ended (on EKS: a pod the Job "
    "recreated after the training nodes finished or failed) and did nothing; the launch's outcome is in the other "
    "nodes' final records (events.jsonl). Nothing to do: the Job does not count it against backoffLimit",
    FailureClass.UNKNOWN.value: "not a failure that replacing a node fixes; read the launch's logs (backend.logs)",
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


#: errnos that mean "the run dir cannot take writes": storage, not the node or the code. The node's
#: memory-backed /dev/shm, where async checkpoints are staged, counts as storage too.
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EFBIG})

#: How a process killed by SIGBUS is told: the signal's name (ours, torchelastic's "Signal 7
#: (SIGBUS)"), or torch's "killed by signal: Bus error" for a data loader worker. A memory-backed
#: file (/dev/shm is tmpfs) whose page the kernel cannot allocate answers the access with SIGBUS
#: instead of an error return: /dev/shm is full (``ENOSPC``).
_SIGBUS_TEXT = re.compile(r"\bSIGBUS\b|signal: Bus error")


def _errno_in_text(text: str) -> int | None:
    """A storage errno written out: Python's ``[Errno 28] ...``, or C++ code's ``<strerror> (28)``
    (torch's shared memory: "unable to allocate shared memory(shm) for file </torch_...>: No space
    left on device (28)", and "unable to write to file <...>: ..." before torch 2.5)."""
    match = re.search(r"\[Errno (\d+)\]", text)
    if match and int(match.group(1)) in STORAGE_ERRNOS:
        return int(match.group(1))
    for code in sorted(STORAGE_ERRNOS):
        if f"{os.strerror(code)} ({code})" in text:
            return code
    if _SIGBUS_TEXT.search(text):
        return errno.ENOSPC
    return None


def storage_errno(exc: BaseException | None) -> int | None:
    """The storage errno (``STORAGE_ERRNOS``) behind ``exc`` or anything in its cause chain, else
    None. Writers in other processes report errors as text: ``[Errno 28] ...`` and ``... No space
    left on device (28)`` count too, and so does a process killed by SIGBUS (a full /dev/shm,
    ``ENOSPC``; see ``describe_process_exit``). A SIGBUS from a hardware memory error reads the
    same: the node's health conditions, not this, tell that one."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in STORAGE_ERRNOS:
            return exc.errno
        code = _errno_in_text(str(exc))
        if code is not None:
            return code
        exc = exc.__cause__ or exc.__context__
    return None


def describe_process_exit(what: str, exitcode: int | None) -> str:
    """How a helper process ended, as ``multiprocessing`` reports it (``exitcode``: a negative
    number is the signal that killed it). A SIGBUS death says that /dev/shm is full, in words
    ``storage_errno`` reads as ``ENOSPC``, so it is a storage error, not an ordinary fault that a
    restart would only meet again."""
    if exitcode is None:
        return f"{what} is gone (exit status unknown)"
    if exitcode >= 0:
        return f"{what} exited with code {exitcode}"
    number = -exitcode
    try:
        name = signal.Signals(number).name
    except ValueError:
        name = "unknown signal"
    text = f"{what} was killed by signal {number} ({name})"
    if number == signal.SIGBUS:
        text += (
            ": a page of a memory-backed file could not be allocated, i.e. /dev/shm (where checkpoints "
            "are staged) is full; on EKS raise PodTemplateSettings.shm_size, or leave it unset to size "
            "it from the model"
        )
    return text


def failure_class_for_exit(code: int) -> FailureClass:
    """The failure class a launcher exit code stands for (unknown codes -> UNKNOWN)."""
    try:
        return _EXIT_TO_CLASS.get(ExitCode(code), FailureClass.UNKNOWN)
    except ValueError:
        return FailureClass.UNKNOWN


def exit_code_for(failure: FailureClass) -> ExitCode:
    return _CLASS_TO_EXIT[failure]
