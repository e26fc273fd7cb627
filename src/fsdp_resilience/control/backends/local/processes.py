"""A local job's processes: /proc reading, liveness, the job tag, process groups and stopping them.

Every process of a job carries ``FSDP_RESILIENCE_LOCAL_JOB=<job>/<node>`` in its environment (read
from /proc; psutil where there is none), so a job's processes are found even when a launcher
started them in other sessions (ft_launcher, workers, checkpoint writers), orphans included.
``stop_nodes`` marks nodes stopped in the job record before stopping them (the supervisor's failure
policy and ``replace_nodes`` both use it), so the verdict never takes a node we stopped for a lost one.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from fsdp_resilience.control.backends.local.state import StateStore

#: In every process of a local job: ``<job_name>/<node index>``.
JOB_TAG_ENV = "FSDP_RESILIENCE_LOCAL_JOB"
HAVE_PROC = Path("/proc/self/stat").exists()


def proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, process group, start time in clock ticks) from /proc, or None if gone."""
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    fields = data[data.rindex(b")") + 2 :].split()  # the command name may hold spaces and ')'
    return fields[0].decode(), int(fields[2]), int(fields[19])


def process_start_ticks(pid: int) -> int | None:
    stat = proc_stat(pid) if HAVE_PROC else None
    return stat[2] if stat else None


def process_alive(pid: int | None, start_ticks: int | None = None) -> bool:
    """Whether ``pid`` runs (not a zombie) and is still the process we started (pids are reused)."""
    if pid is None:
        return False
    if HAVE_PROC:
        stat = proc_stat(pid)
        if stat is None or stat[0] in ("Z", "X"):
            return False
        return start_ticks is None or stat[2] == start_ticks
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def tagged_processes(job_name: str, node: int | None = None) -> list[int]:
    """Live processes of the job (of one node), found by the tag in their environment."""
    prefix = f"{JOB_TAG_ENV}={job_name}/".encode()
    found = []
    if HAVE_PROC:
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/environ", "rb") as f:
                    env = f.read()
            except OSError:
                continue
            for var in env.split(b"\0"):
                if var.startswith(prefix) and (node is None or var[len(prefix) :] == str(node).encode()):
                    if process_alive(int(entry.name)):
                        found.append(int(entry.name))
                    break
        return found
    try:  # macOS and friends: psutil comes with Airflow
        import psutil
    except ImportError:
        return found
    want = f"{job_name}/"
    for proc in psutil.process_iter():
        try:
            tag = proc.environ().get(JOB_TAG_ENV, "")
            if tag.startswith(want) and (node is None or tag == f"{want}{node}") and proc.status() != "zombie":
                found.append(proc.pid)
        except (psutil.Error, OSError):
            continue
    return found


def signal_processes(pids: list[int], sig: int, groups: list[int] = ()) -> None:
    for pgid in groups:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def stop_job_processes(
    record: dict[str, Any], grace_s: float, nodes: list[int] | None = None, reap: Callable[[], Any] = lambda: None
) -> list[int]:
    """Stop the job's processes (of ``nodes``, default all): SIGTERM to each live launcher's group
    (the launcher passes it on to ft_launcher's session and writes its ``final`` event), and to any
    process whose launcher is already gone; SIGKILL whatever is left after ``grace_s``. Returns the
    pids that survived SIGKILL (none, normally). ``reap`` lets the launchers' parent collect them
    while it waits."""
    job = record["job_name"]
    selected = [n for n in record["nodes"] if nodes is None or n["index"] in nodes]

    def remaining() -> list[int]:
        reap()
        pids: list[int] = []
        for n in selected:
            pids += tagged_processes(job, n["index"])
        return pids

    def live_launchers() -> list[int]:
        return [n["pid"] for n in selected if process_alive(n["pid"], n["start_ticks"])]

    launchers = live_launchers()
    orphans = [
        p for n in selected if not process_alive(n["pid"], n["start_ticks"]) for p in tagged_processes(job, n["index"])
    ]
    signal_processes(orphans, signal.SIGTERM, groups=launchers)
    deadline = time.monotonic() + grace_s
    pause = 0.02  # a launcher that already reported is gone within a few of these; a busy one backs off
    while remaining() and time.monotonic() < deadline:
        time.sleep(pause)
        pause = min(2 * pause, 0.2)
    left = remaining()
    if left:
        signal_processes(left, signal.SIGKILL, groups=live_launchers())
        deadline = time.monotonic() + 10
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left = remaining()
    return left


def job_active(record: dict[str, Any]) -> bool:
    """Whether the job may still hold its slots: a launcher runs, or it has not started yet."""
    if record["error"]:
        return False
    for n in record["nodes"]:
        if n["exit_code"] is not None:
            continue
        if n["pid"] is None:
            supervisor = record["supervisor"]
            if supervisor["pid"] is not None:
                if process_alive(supervisor["pid"], supervisor["start_ticks"]):
                    return True
            elif time.time() - record["created_at"] < 2 * record["start_timeout_s"]:
                return True
        elif process_alive(n["pid"], n["start_ticks"]):
            return True
    return False


def stop_nodes(
    store: "StateStore", job_name: str, indices: list[int], why: str, reap: Callable[[], Any] = lambda: None
) -> None:
    """Mark nodes ``indices`` stopped by ``why`` (a mark set earlier stays), then stop them."""
    print(f"stopping nodes {indices} of {job_name}: {why}", flush=True)

    def mark(r: dict[str, Any]) -> None:
        for i in indices:
            r["nodes"][i]["stopped_by"] = r["nodes"][i]["stopped_by"] or why

    record = store.update_job(job_name, mark)
    stop_job_processes(record, grace_s=record["cancel_grace_s"], nodes=indices, reap=reap)


class ExitWaiter:
    """Sleeps until a launcher exits or a timeout passes. A launcher's exit is how the job record
    learns of a lost node (no ``final`` event), and the watch reacts to the record: recorded at
    once, not at the next poll. Linux pidfds; elsewhere (or an old kernel) a plain sleep."""

    def __init__(self) -> None:
        self.fds: dict[int, int] = {}
        self.poller = select.poll() if hasattr(os, "pidfd_open") and hasattr(select, "poll") else None

    def add(self, index: int, proc: subprocess.Popen) -> None:
        if self.poller is None:
            return
        try:
            fd = os.pidfd_open(proc.pid)
        except OSError:  # ENOSYS on a kernel without pidfds: plain sleeps from now on
            for known in list(self.fds):
                self.forget(known)
            self.poller = None
            return
        self.fds[index] = fd
        self.poller.register(fd, select.POLLIN)

    def wait(self, timeout_s: float) -> None:
        if self.poller is None or not self.fds:
            time.sleep(timeout_s)
        else:
            self.poller.poll(timeout_s * 1000)

    def forget(self, index: int) -> None:
        fd = self.fds.pop(index, None)
        if fd is not None:
            if self.poller is not None:
                self.poller.unregister(fd)
            os.close(fd)
