"""What a launch's end means, in the run contract's terms: the ``FailureClass`` (and so the exit
code) and the message of the node's ``final`` record, from ft_launcher's exit code, the stop
marker a rank declared, the committed checkpoints and the run dir's storage."""

from __future__ import annotations

import os
from pathlib import Path

from fsdp_resilience.training.contract import (
    CheckpointCatalog,
    ExitCode,
    FailureClass,
    RunConfig,
    RunDir,
    read_stop,
)
from fsdp_resilience.training.launch.storage import STORAGE_ADVICE, storage_problem


def stop_record(layout: RunDir) -> dict | None:
    """The stop a rank declared (control/STOP.json), or None. A marker left empty or torn on a full
    disk (its file created, its content refused) is the storage fault it stands for."""
    stop = read_stop(layout)
    if stop is not None and "ts" not in stop:  # unreadable: declare_stop always records ts
        problem = storage_problem(layout)
        if problem:
            return {"failure_class": FailureClass.STORAGE_ERROR.value, "error": problem}
    return stop


def describe_stop(stop: dict) -> tuple[FailureClass, str]:
    failure = FailureClass(stop["failure_class"])
    what = failure.value.replace("_", " ")
    where = f" at step {stop['step']}" if stop.get("step") is not None else ""
    why = next((str(stop[k]) for k in ("error", "reason", "message") if stop.get(k)), "no details recorded")
    advice = f"; {STORAGE_ADVICE}" if failure is FailureClass.STORAGE_ERROR else ""
    return failure, f"{what}{where}: {why}{advice}"


def classify(
    cfg: RunConfig, rc: int, stalled: bool, workers_started: bool = True, log_hint: str = "this node's launcher log"
) -> tuple[FailureClass, str]:
    """What the launcher's exit means, in the run contract's terms. ``workers_started``: whether
    any rank of this launch began training (a ``train_begin`` after its ``launch_begin``)."""
    layout = cfg.layout
    stop = stop_record(layout)
    if stop is not None:
        return describe_stop(stop)
    latest = CheckpointCatalog(layout).latest()
    if rc == 0 and not stalled and latest is not None and latest.step >= cfg.steps:
        return FailureClass.SUCCESS, f"trained {cfg.steps} steps; final checkpoint {latest.checkpoint_id}"
    problem = storage_problem(layout)
    if problem:
        return FailureClass.STORAGE_ERROR, f"{problem}; {STORAGE_ADVICE}"
    if stalled:
        return FailureClass.NO_PROGRESS, f"no new committed checkpoint for {cfg.stall_timeout_s:.0f}s"
    if rc == ExitCode.NO_PROGRESS:
        return FailureClass.NO_PROGRESS, (
            "ft_launcher stopped restarting: its last restart cycles committed no "
            f"checkpoint past step {latest.step if latest else 0}"
        )
    if rc == 0:
        return FailureClass.UNKNOWN, "the launcher exited 0 before the final checkpoint was committed"
    if rc < 0:
        return FailureClass.UNKNOWN, f"the launcher was killed by signal {-rc}"
    launcher = "ft_launcher" if cfg.restart_mode in ("layered", "injob") else "torchrun"
    if not workers_started:
        return FailureClass.UNKNOWN, (
            f"the workers never started: {launcher} exited {rc} before any rank began "
            f"training (nothing was restarted); read {log_hint}"
        )
    if cfg.restart_mode in ("layered", "injob"):
        return FailureClass.RESTARTS_EXHAUSTED, f"ft_launcher gave up after max_restarts={cfg.max_restarts} (exit {rc})"
    return FailureClass.RESTARTS_EXHAUSTED, (
        f"a rank failed and restart_mode={cfg.restart_mode} has no in-job restarts (exit {rc})"
    )


#: What NVRx logs when its rendezvous turns a node away (0.7: the health checks at every join;
#: both versions: a rank's ExcludeThisNode request, a GPU check).
_REFUSAL_MARKS = ("health check failed", "UnhealthyNodeException", "excluded from the training", "unhealthy")


def launcher_log_lines(log_path: str | None = None) -> list[str]:
    """The last 256 KiB of this node's launcher log, as lines; [] when it is not a file here (on
    EKS the launcher's output is the pod's log, which only the kubelet keeps)."""
    path = log_path or launcher_log_hint()
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - (256 << 10)))
            return f.read().decode(errors="replace").splitlines()
    except OSError:
        return []


def dropped_spare_reason(rc: int, log_path: str | None = None) -> str:
    """Why a spare's ft_launcher left the rendezvous before its node trained: the last line of
    its log where NVRx turned the node away (a failed health check), else its exit code."""
    path = log_path or launcher_log_hint()
    reason = ""
    for line in launcher_log_lines(path):
        if any(mark.lower() in line.lower() for mark in _REFUSAL_MARKS):
            reason = line.strip()[-400:]
    where = f"; read {path}" if path.startswith("/") else ""
    return (f"NVRx turned the node away: {reason}" if reason else f"ft_launcher exited {rc}") + where


def launcher_log_hint() -> str:
    """Where this process's output goes, for messages that send the reader there: the file our
    stdout is (the local backend's logs/<job>-node<N>.log), else the pod's log."""
    try:
        target = os.readlink("/proc/self/fd/1")
        if target.startswith("/") and Path(target).is_file():
            return target
    except OSError:
        pass
    return "this node's launcher output (on EKS: kubectl logs of the node's pod)"
