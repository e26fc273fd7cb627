"""Starting a local job (backends/local/launching.py): the supervisor spawn and the waits for its
launchers. Records are written by hand; the pids are this process (alive) or this pid with another
start time (gone). Real jobs: tests/control/integration/test_local_backend.py."""

from __future__ import annotations

import time

import pytest

from fsdp_resilience.control.backends import BackendError
from fsdp_resilience.control.backends.local.launching import spawn_supervisor, wait_added, wait_started

from control.support.local_jobs import ALIVE, GONE, make_record, node


def test_wait_started_returns_once_every_launcher_has_a_pid(tmp_path):
    store, _ = make_record(tmp_path, [node(0, **ALIVE), node(1, **ALIVE)], supervisor=ALIVE)
    wait_started(store, "job", 5.0)


def test_wait_started_reports_why_a_job_did_not_start(tmp_path):
    store, _ = make_record(tmp_path, [node(0)], error="boom")
    with pytest.raises(BackendError, match="job job did not start: boom"):
        wait_started(store, "job", 5.0)
    store, _ = make_record(tmp_path, [node(0)], supervisor=GONE)
    with pytest.raises(BackendError, match="the supervisor died before starting its launchers"):
        wait_started(store, "job", 5.0)
    store, _ = make_record(tmp_path, [node(0)])  # a supervisor not started yet, and no time to wait
    with pytest.raises(BackendError, match="did not start its launchers within 0s.*same launch_id returns this job"):
        wait_started(store, "job", 0.0)


def test_wait_added_returns_the_started_spares_status(tmp_path):
    store, _ = make_record(tmp_path, [node(0, **ALIVE), node(1, standby=True, **ALIVE)], supervisor=ALIVE)
    status = wait_added(store, "job", 1, 5.0)
    assert status.index == 1 and status.node_id == "slot-1" and status.state in ("pending", "running")


def test_wait_added_raises_for_a_spare_never_started(tmp_path):
    store, _ = make_record(
        tmp_path, [node(0, **ALIVE), node(1, standby=True, start_error="no such file")], supervisor=ALIVE
    )
    with pytest.raises(BackendError, match=r"spare node 1 \(slot-1\) was not started"):
        wait_added(store, "job", 1, 5.0)
    store, _ = make_record(tmp_path, [node(0, **ALIVE), node(1, standby=True)], supervisor=ALIVE)
    with pytest.raises(BackendError, match="did not start spare node 1 within 0s"):
        wait_added(store, "job", 1, 0.0)


def test_the_spawned_supervisor_detaches_and_logs_to_the_job(tmp_path):
    """The intermediate process exits at once (reaped here); its forked child finds no such job and says so."""
    log = tmp_path / "supervisor.log"
    record = {"job_name": "missing", "supervisor": {"log_path": str(log)}}
    spawn_supervisor(record, tmp_path / "state", 30.0)
    deadline = time.monotonic() + 30
    while "no job missing" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "no job missing under" in log.read_text()
