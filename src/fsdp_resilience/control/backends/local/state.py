"""The local backend's state on disk: slots.json and one record per job, under ``state_dir``.

Nothing is kept in memory, so any process (an Airflow worker, the triggerer, the supervisor, a
test) reads the same state; every write is atomic and writers hold one flock(2).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from fsdp_resilience.control.backends.base import BackendError, JobNotFoundError
from fsdp_resilience.control.backends.local.processes import JOB_TAG_ENV
from fsdp_resilience.training.contract import NODE_ID_ENV, RunConfig, RunDir, atomic_write_text

LAUNCH_ID_ENV = "TRAINING_LAUNCH_ID"
RECORD_VERSION = 1


class StateStore:
    """The backend's files. Writers hold the lock; readers need none (every write is atomic)."""

    def __init__(self, root: Path):
        self.root = root
        self.jobs_dir = root / "jobs"
        self.slots_path = root / "slots.json"

    @contextmanager
    def locked(self) -> Iterator[None]:
        self.jobs_dir.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def job_path(self, job_name: str) -> Path:
        return self.jobs_dir / f"{job_name}.json"

    def read_job(self, job_name: str) -> dict[str, Any] | None:
        return read_json(self.job_path(job_name))

    def write_job(self, record: dict[str, Any]) -> None:
        self.jobs_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.job_path(record["job_name"]), json.dumps(record, indent=1, sort_keys=True) + "\n")

    def update_job(self, job_name: str, change: Callable[[dict[str, Any]], Any]) -> dict[str, Any]:
        with self.locked():
            record = self.read_job(job_name)
            if record is None:
                raise JobNotFoundError(f"no local job {job_name} under {self.root}")
            change(record)
            self.write_job(record)
            return record

    def jobs(self) -> list[dict[str, Any]]:
        if not self.jobs_dir.is_dir():
            return []
        records = (read_json(p) for p in sorted(self.jobs_dir.glob("*.json")))
        return [r for r in records if r is not None]

    def read_slots(self) -> dict[str, dict[str, Any]]:
        data = read_json(self.slots_path) or {}
        return dict(data.get("slots", {}))

    def write_slots(self, slots: dict[str, dict[str, Any]]) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.slots_path, json.dumps({"slots": slots}, indent=1, sort_keys=True) + "\n")

    def quarantined(self) -> list[str]:
        return [s for s, info in self.read_slots().items() if info.get("state") == "quarantined"]


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise BackendError(f"local backend state file {path} is unreadable ({e}); remove it if its job is gone") from e
    return data if isinstance(data, dict) else None


def tail_lines(path: Path, lines: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            block, data = 8192, b""
            while size > 0 and data.count(b"\n") <= lines:
                step = min(block, size)
                size -= step
                f.seek(size)
                data = f.read(step) + data
                block *= 2
    except FileNotFoundError:
        return ""
    return "\n".join(data.decode(errors="replace").splitlines()[-lines:]) if lines > 0 else ""


# --------------------------------------------------------------------------------------------
# The job record: what the supervisor starts, and what it and the backend learn of it
# --------------------------------------------------------------------------------------------


def new_job_record(
    store: StateStore,
    cfg: RunConfig,
    launch_id: str,
    job_name: str,
    slots: list[str],
    training_python: str,
    *,
    cwd: Path,
    failure_grace_s: float,
    cancel_grace_s: float,
    start_timeout_s: float,
) -> dict[str, Any]:
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", launch_id)
    if safe != launch_id:
        safe = f"{safe}-{job_name.rsplit('-', 1)[-1]}"  # keep it unique per launch id
    config_path = cfg.layout.launch_config(safe)
    nodes = [
        node_entry(
            training_python, job_name, launch_id, str(config_path), cfg.run_dir, index, slot, standby=index >= cfg.nodes
        )
        for index, slot in enumerate(slots)
    ]
    return {
        "version": RECORD_VERSION,
        "job_name": job_name,
        "run_id": cfg.run_id,
        "launch_id": launch_id,
        "run_dir": cfg.run_dir,
        "config_path": str(config_path),
        "cwd": str(cwd),
        "train_nodes": cfg.nodes,
        "node_rank_limit": cfg.node_rank_limit,
        "created_at": time.time(),
        "stall_timeout_s": cfg.stall_timeout_s,
        "failure_grace_s": failure_grace_s,
        "cancel_grace_s": cancel_grace_s,
        "start_timeout_s": start_timeout_s,
        "supervisor": {
            "pid": None,
            "start_ticks": None,
            "log_path": str(store.job_path(job_name).with_suffix(".supervisor.log")),
        },
        "cancel": None,
        "error": None,
        "nodes": nodes,
    }


def node_entry(
    training_python: str,
    job_name: str,
    launch_id: str,
    config_path: str,
    run_dir: str,
    index: int,
    slot: str,
    standby: bool,
    added_reason: str | None = None,
) -> dict[str, Any]:
    """One node of the job record: what the supervisor starts, and what it learns of it."""
    return {
        "index": index,
        "node_id": slot,
        "standby": standby,
        "added_reason": added_reason,
        "command": [
            training_python,
            "-m",
            "fsdp_resilience.training.launch",
            "--config",
            config_path,
            "--node-rank",
            str(index),
            "--rdzv-host",
            "127.0.0.1",
        ],
        "env": {
            LAUNCH_ID_ENV: launch_id,
            NODE_ID_ENV: slot,
            "PYTHONUNBUFFERED": "1",
            JOB_TAG_ENV: f"{job_name}/{index}",
        },
        "log_path": str(RunDir(run_dir).logs / f"{job_name}-node{index}.log"),
        "pid": None,
        "pgid": None,
        "start_ticks": None,
        "started_at": None,
        "exit_code": None,
        "ended_at": None,
        "stopped_by": None,
        "start_error": None,
    }
