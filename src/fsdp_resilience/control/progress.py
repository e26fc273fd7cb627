"""Is a training launch done, failed, stalled, or still going? One check, used by the deferrable
trigger (in the triggerer) and by the sensor's poke mode (in a worker).

The check keeps no state of its own: progress is read from the run dir (the newest committed
checkpoint and its commit time) and the job's state from the backend. A trigger that is restarted
— the triggerer moved, Airflow upgraded — picks the run up exactly where it was.

Between two checks, ``LaunchChanges`` says when the next one is due at once: a launcher wrote its
``final`` event, or the backend rewrote a file of the job's state (the local backend's job record,
when a launcher ended without one: a lost node). It only stats files and reads what was appended,
so the watch can look every fraction of a second and still see an ended launch in well under its
poll interval.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any, Iterable

from fsdp_resilience.control.backends import JobHandle, JobStatus, TrainingBackend
from fsdp_resilience.control.task_data import Outcome
from fsdp_resilience.training.contract import CheckpointCatalog, Event, FailureClass, RunDir

SUCCESS, FAILED, NO_PROGRESS = "success", "failed", "no_progress"


def latest_checkpoint(run_dir: str, checkpoints_s3: str | None = None, aws_conn_id: str | None = None) -> Any:
    """The run's newest committed checkpoint: from the run dir (FSx mounted here), or from its S3
    export when ``checkpoints_s3`` is set (a triggerer without the mount). Same rules either way."""
    if checkpoints_s3:
        from fsdp_resilience.control.hooks.s3_checkpoints import latest_committed_in_s3

        return latest_committed_in_s3(checkpoints_s3, aws_conn_id=aws_conn_id or "aws_default")
    return CheckpointCatalog(run_dir).latest()


def check_progress(
    backend: TrainingBackend,
    handle: JobHandle,
    *,
    run_dir: str,
    final_step: int,
    stall_timeout_s: float,
    launched_at: float,
    now: float | None = None,
    checkpoints_s3: str | None = None,
    aws_conn_id: str | None = None,
) -> Outcome:
    """One look at a launch: its job's state, then its newest committed checkpoint (an ``Outcome``
    whose ``outcome`` is None while the launch is still healthy and running)."""
    status = backend.status(handle)
    latest = latest_checkpoint(run_dir, checkpoints_s3, aws_conn_id)
    return judge_progress(
        status, latest, handle, final_step=final_step, stall_timeout_s=stall_timeout_s, launched_at=launched_at, now=now
    )


def judge_progress(
    status: JobStatus,
    latest: Any,
    handle: JobHandle,
    *,
    final_step: int,
    stall_timeout_s: float,
    launched_at: float,
    now: float | None = None,
) -> Outcome:
    """The verdict from a job's state and its run's newest committed checkpoint (``latest``: what
    ``CheckpointCatalog.latest()`` returns, or None). Read the job's state first, then the
    checkpoint: a job seen done has committed everything it ever will, so the checkpoint read after
    it sees the final commit (read the other way round, a commit landing between the two reads
    would make a finished run look short)."""
    now = time.time() if now is None else now
    step = latest.step if latest else 0
    checkpoint_id = latest.checkpoint_id if latest else None
    # A commit from an earlier launch is not progress of this one: count from the launch.
    last_progress_at = max(launched_at, (latest.committed_at or 0.0) if latest else 0.0)

    def result(outcome: str | None, failure_class: str | None, message: str) -> Outcome:
        return Outcome(
            outcome,
            failure_class,
            message,
            step,
            checkpoint_id,
            handle.launch_id,
            handle.to_dict(),
            status.state,
            last_progress_at,
            [n.to_dict() for n in status.nodes],
        )

    if status.state == "succeeded":
        if step >= final_step:
            return result(SUCCESS, FailureClass.SUCCESS.value, f"step {final_step} committed as {checkpoint_id}")
        return result(
            FAILED,
            FailureClass.UNKNOWN.value,
            f"the job ended successfully but the newest committed step is {step}, not {final_step}",
        )
    if status.state == "failed":
        return result(FAILED, status.failure_class or FailureClass.UNKNOWN.value, status.message)
    stalled_for = now - last_progress_at
    if stalled_for > stall_timeout_s:
        return result(
            NO_PROGRESS,
            FailureClass.NO_PROGRESS.value,
            f"no new committed checkpoint for {stalled_for:.0f}s (stall timeout {stall_timeout_s:.0f}s); "
            f"newest committed step {step}",
        )
    return result(None, None, f"{status.state}: newest committed step {step} of {final_step}")


#: How often the watch looks for a ``final`` event or a changed job file between its checks.
CHANGE_TICK_S = 0.2


#: The events ``LaunchChanges`` reads (as they appear in a line): a launcher's end, survivors
#: waiting for nodes, and training beginning again after a wait.
_CHANGE_EVENTS = (b'"final"', b'"waiting_for_nodes"', b'"train_begin"')


class LaunchChanges:
    """What tells, between two progress checks, that a launch may have ended: one of its
    launchers appended its ``final`` event to the run's events log, or a file the backend keeps
    the job's state in (``TrainingBackend.change_paths``) was rewritten.

    Create it before the check it follows (``check_progress``/``judge_progress``): whatever is
    appended or rewritten after that is then seen. Its offsets are only a shortcut: a watch
    restarted without them (a restarted trigger) loses nothing, since its first check reads the
    job's state in full.
    """

    def __init__(self, run_dir: str | os.PathLike, launch_id: str, paths: Iterable[str | os.PathLike] = ()):
        self.events = RunDir(run_dir).events
        self.launch_id = launch_id
        self.needle = json.dumps(launch_id).encode()  # as it appears in the line, quotes included
        self.paths = [Path(p) for p in paths]
        self.offset = _size(self.events)
        self.partial = b""  # a line whose end has not been written yet
        self.seen = {p: _identity(p) for p in self.paths}
        #: The newest ``waiting_for_nodes`` of this launch seen so far: survivors of a loss no
        #: spare covered, waiting for a replacement until its ``until``, or (``until`` null)
        #: ending the launch because nothing is coming; None again once training begins again.
        self.waiting: dict[str, Any] | None = None

    def poll(self) -> str | None:
        """One look (a few ``stat`` calls, and a read of what was appended): why the launch should
        be checked now, or None."""
        why = self._final_event()
        for path in self.paths:
            now = _identity(path)
            if now != self.seen[path]:
                self.seen[path] = now
                why = why or f"{path.name} changed"
        return why

    def _final_event(self) -> str | None:
        size = _size(self.events)
        if size < self.offset:  # the log was replaced: read the new one from its start
            self.offset, self.partial = 0, b""
        if size == self.offset:
            return None
        try:
            with open(self.events, "rb") as f:
                f.seek(self.offset)
                data = f.read(size - self.offset)
        except OSError:  # a shortcut only: the regular check reads the log and says what is wrong
            return None
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        why = None
        for line in lines:
            if self.needle not in line or not any(k in line for k in _CHANGE_EVENTS):
                continue
            try:
                record = json.loads(line)
            except ValueError:
                return "a torn line that may be a final event"  # the check reads it properly
            if not isinstance(record, dict) or record.get("launch_id") != self.launch_id:
                continue
            if record.get("event") == Event.FINAL.value:
                return f"node {record.get('node_rank')} of launch {self.launch_id} wrote its final event"
            if record.get("event") == Event.WAITING_FOR_NODES.value:
                self.waiting = record
                why = f"node {record.get('node_rank')} of launch {self.launch_id} waits for nodes"
            elif record.get("event") == Event.TRAIN_BEGIN.value and self.waiting is not None:
                self.waiting = None  # the replacement came: training goes on
        return why


def waiting_verdict(progress: Outcome, waiting: dict[str, Any] | None) -> tuple[Outcome | None, str | None]:
    """What a launch still running is, given the newest ``waiting_for_nodes`` of it
    (``LaunchChanges.waiting``): (a failed outcome, None) when nothing is coming (its launcher is
    ending it: no need to wait for its final, nor for ``stall_timeout_s``); (None, what it waits
    for) while a replacement is announced; (None, None) without a wait."""
    if progress.outcome is not None or waiting is None:
        return None, None
    nodes = ", ".join(str(n) for n in waiting.get("nodes") or []) or "?"
    why = str(waiting.get("why") or "")
    until = waiting.get("until")
    if isinstance(until, (int, float)):
        left = max(0.0, until - time.time())
        return None, f"launch {progress.launch_id} waits for node(s) {nodes} for up to {left:.0f} s more: {why}"
    message = f"node(s) {nodes} lost and no spare left to take their place; {why}"
    failed = dataclasses.replace(
        progress, outcome=FAILED, failure_class=FailureClass.RESTARTS_EXHAUSTED.value, message=message
    )
    return failed, None


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _identity(path: Path) -> tuple[int, int, int] | None:
    """What changes when a file is rewritten in place or replaced (atomic writes rename)."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size
