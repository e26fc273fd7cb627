"""Job records of the local backend written by hand, for unit tests of what reads them (verdict,
launching): node entries with the fields the supervisor fills in, and pids that are this process
(``ALIVE``) or this pid with another start time (``GONE``: the process we started is gone)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from fsdp_resilience.control.backends.local.processes import process_start_ticks
from fsdp_resilience.control.backends.local.state import StateStore

ME = os.getpid()
ALIVE = {"pid": ME, "start_ticks": process_start_ticks(ME)}
GONE = {"pid": ME, "start_ticks": -1}


def node(index: int, standby: bool = False, **fields) -> dict:
    """Node ``index`` of a job record, as the supervisor leaves it before it starts the launcher."""
    entry = {
        "index": index,
        "node_id": f"slot-{index}",
        "standby": standby,
        "log_path": f"/nonexistent/n{index}.log",
        "pid": None,
        "start_ticks": None,
        "exit_code": None,
        "ended_at": None,
        "stopped_by": None,
        "start_error": None,
    }
    entry.update(fields)
    return entry


def make_record(
    tmp_path: Path, nodes: list[dict], train_nodes: int | None = None, supervisor: dict | None = None, **fields
) -> tuple[StateStore, dict]:
    """Job ``job`` of run ``r``, launch 1, with ``nodes``, written to a state store under ``tmp_path``."""
    store = StateStore(tmp_path / "state")
    record = {
        "job_name": "job",
        "run_id": "r",
        "launch_id": "1",
        "run_dir": str(tmp_path / "run"),
        "train_nodes": len(nodes) if train_nodes is None else train_nodes,
        "created_at": time.time(),
        "start_timeout_s": 60.0,
        "cancel": None,
        "error": None,
        "nodes": nodes,
        "supervisor": {"pid": None, "start_ticks": None, "log_path": "/nonexistent/supervisor.log"},
    }
    record["supervisor"].update(supervisor or {})
    record.update(fields)
    store.write_job(record)
    return store, record
