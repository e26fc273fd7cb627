"""Starting a local job: the supervisor process that ``submit`` spawns, and the waits until it has
started a job's launchers (``submit``) or a spare's (``add_spare``).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from fsdp_resilience.control.backends.base import BackendError, NodeStatus
from fsdp_resilience.control.backends.local.processes import process_alive
from fsdp_resilience.control.backends.local.state import StateStore
from fsdp_resilience.control.backends.local.verdict import judge_job

#: What ``submit`` runs (with ``sys.executable``) to start a job's supervisor.
SUPERVISOR_MODULE = "fsdp_resilience.control.backends.local.supervisor"


def spawn_supervisor(record: dict[str, Any], state_dir: Path, start_timeout_s: float) -> None:
    """Start the job's supervisor (``python -m SUPERVISOR_MODULE``): it forks once and exits."""
    # The supervisor is its own module (nothing in this package imports it), so -m runs it once,
    # and the launchers it starts inherit the caller's environment untouched (no PYTHONPATH of ours).
    with open(record["supervisor"]["log_path"], "ab") as log:
        intermediate = subprocess.Popen(
            [
                sys.executable,
                "-m",
                SUPERVISOR_MODULE,
                "--state-dir",
                str(state_dir),
                "--job",
                record["job_name"],
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    # It forks the supervisor and exits at once; reaping it here leaves no zombie behind.
    if intermediate.wait(timeout=start_timeout_s) != 0:
        raise OSError(
            f"the supervisor failed to start (exit {intermediate.returncode}); see {record['supervisor']['log_path']}"
        )


def wait_started(store: StateStore, job_name: str, start_timeout_s: float) -> None:
    """Wait until the supervisor has started every launcher of the job; BackendError when it cannot."""
    deadline = time.monotonic() + start_timeout_s
    while True:
        record = store.read_job(job_name)
        if record["error"]:
            raise BackendError(
                f"job {job_name} did not start: {record['error']} (see {record['supervisor']['log_path']})"
            )
        if all(n["pid"] is not None for n in record["nodes"]):
            return
        supervisor = record["supervisor"]
        if supervisor["pid"] is not None and not process_alive(supervisor["pid"], supervisor["start_ticks"]):
            raise BackendError(
                f"job {job_name}: the supervisor died before starting its launchers; see {supervisor['log_path']}"
            )
        if time.monotonic() > deadline:
            raise BackendError(
                f"job {job_name}: the supervisor did not start its launchers within "
                f"{start_timeout_s:.0f}s; see {record['supervisor']['log_path']}. "
                "Submitting again with the same launch_id returns this job"
            )
        time.sleep(0.02)


def wait_added(store: StateStore, job_name: str, index: int, start_timeout_s: float) -> NodeStatus:
    """Wait until the supervisor has started spare node ``index`` (``add_spare``); its status."""
    deadline = time.monotonic() + start_timeout_s
    while True:
        record = store.read_job(job_name)
        node = record["nodes"][index]
        if node["pid"] is not None or node.get("start_error"):
            break
        supervisor = record["supervisor"]
        if supervisor.get("ended_at") or not process_alive(supervisor["pid"], supervisor["start_ticks"]):
            break  # judged below: a node the supervisor never started is a failed one
        if time.monotonic() > deadline:
            raise BackendError(
                f"job {job_name}: the supervisor did not start spare node {index} within "
                f"{start_timeout_s:.0f}s; see {supervisor['log_path']}"
            )
        time.sleep(0.05)
    status = judge_job(store, record).nodes[index]
    if node["pid"] is None:
        raise BackendError(f"job {job_name}: spare node {index} ({node['node_id']}) was not started: {status.message}")
    return status
