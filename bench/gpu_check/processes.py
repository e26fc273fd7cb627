"""Processes: bounded, and nothing left behind (a process tree stopped with SIGTERM, then SIGKILL)."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

from bench.common import REPO
from bench.gpu_check.configs import STOP_GRACE_S


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, from /proc. Needed because torchrun and fsdp_resilience.training.launch put
    their workers in sessions of their own: killing one process group would orphan them."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def stop_tree(proc: subprocess.Popen) -> None:
    """SIGTERM (the launchers pass it on to their workers), then SIGKILL whatever is left."""
    family = descendants(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(STOP_GRACE_S)
    for pid in family + descendants(proc.pid) + [proc.pid]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def run_bounded(command: list[str], log_path: Path, timeout_s: float) -> tuple[int | None, float]:
    """Run ``command`` from the repo root, output to ``log_path``; (exit code or None if it ran
    past ``timeout_s`` and was stopped, wall seconds)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO / "src"), os.environ.get("PYTHONPATH", "")) if p),
    }
    t0 = time.monotonic()
    with open(log_path, "w") as out:
        out.write(f"$ {shlex.join(command)}\n")
        out.flush()
        proc = subprocess.Popen(
            command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            rc: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stop_tree(proc)
            rc = None
    return rc, time.monotonic() - t0


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
