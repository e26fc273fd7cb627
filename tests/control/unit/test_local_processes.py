"""A local job's processes (backends/local/processes.py): liveness from /proc, the job tag, stopping
a job's process groups, and the exit waiter. Starts only ``sleep`` children, tagged with a job name
unique to this test session."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from fsdp_resilience.control.backends.local.processes import (
    HAVE_PROC,
    JOB_TAG_ENV,
    ExitWaiter,
    job_active,
    proc_stat,
    process_alive,
    process_start_ticks,
    stop_job_processes,
    tagged_processes,
)

pytestmark = pytest.mark.skipif(not HAVE_PROC, reason="reads /proc")

JOB = f"unit-processes-{os.getpid()}"


def start_tagged(node: int, seconds: int = 60, *command: str) -> subprocess.Popen:
    return subprocess.Popen(
        list(command) or ["sleep", str(seconds)],
        env={**os.environ, JOB_TAG_ENV: f"{JOB}/{node}"},
        start_new_session=True,
    )


def record_of(*procs: subprocess.Popen) -> dict:
    return {
        "job_name": JOB,
        "error": None,
        "created_at": time.time(),
        "start_timeout_s": 60.0,
        "supervisor": {"pid": None, "start_ticks": None},
        "nodes": [
            {"index": i, "pid": p.pid, "start_ticks": process_start_ticks(p.pid), "exit_code": None}
            for i, p in enumerate(procs)
        ],
    }


def test_liveness_knows_the_process_we_started_from_a_reused_pid():
    me = os.getpid()
    state, pgid, ticks = proc_stat(me)
    assert state in "RS" and pgid == os.getpgid(me) and ticks == process_start_ticks(me)
    assert process_alive(me) and process_alive(me, ticks) and not process_alive(me, ticks + 1)
    assert not process_alive(None) and proc_stat(2**22 + 1) is None  # above pid_max's ceiling


def test_a_zombie_is_not_alive():
    child = subprocess.Popen(["true"])
    deadline = time.monotonic() + 10
    while (proc_stat(child.pid) or ("?",))[0] != "Z" and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not process_alive(child.pid)  # exited, not yet reaped
    child.wait()


def test_a_job_is_stopped_by_its_tag_and_its_process_groups():
    procs = [start_tagged(0), start_tagged(1)]
    try:
        deadline = time.monotonic() + 10
        while len(tagged_processes(JOB)) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)  # the environ is readable once exec is done
        assert sorted(tagged_processes(JOB)) == sorted(p.pid for p in procs)
        assert tagged_processes(JOB, node=1) == [procs[1].pid] and tagged_processes(JOB + "x") == []
        record = record_of(*procs)
        assert job_active(record)
        assert stop_job_processes(record, grace_s=5, nodes=[0], reap=lambda: procs[0].poll()) == []
        assert procs[0].wait(5) == -15 and procs[1].poll() is None
        assert stop_job_processes(record, grace_s=5, reap=lambda: procs[1].poll()) == []
        assert procs[1].wait(5) == -15 and tagged_processes(JOB) == []
        record["nodes"][0]["exit_code"], record["nodes"][1]["exit_code"] = -15, -15
        assert not job_active(record)
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_job_that_ignores_sigterm_gets_sigkill():
    stubborn = start_tagged(
        0, 0, sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
    )
    try:
        deadline = time.monotonic() + 10
        while not tagged_processes(JOB) and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.5)  # let it install its handler
        assert stop_job_processes(record_of(stubborn), grace_s=0.5, reap=stubborn.poll) == []
        assert stubborn.wait(5) == -9
    finally:
        stubborn.kill()
        stubborn.wait()


def test_job_active_while_its_supervisor_starts_it_and_not_after_an_error():
    record = {
        "error": None,
        "created_at": time.time(),
        "start_timeout_s": 60.0,
        "supervisor": {"pid": None, "start_ticks": None},
        "nodes": [{"pid": None, "exit_code": None}],
    }
    assert job_active(record)  # submitted, supervisor not yet up
    record["created_at"] -= 121
    assert not job_active(record)  # the supervisor never came
    record["supervisor"] = {"pid": os.getpid(), "start_ticks": process_start_ticks(os.getpid())}
    assert job_active(record)
    record["error"] = "could not start"
    assert not job_active(record)


def test_the_exit_waiter_wakes_when_a_launcher_exits():
    waiter = ExitWaiter()
    child = subprocess.Popen(["sleep", "0.2"])
    waiter.add(0, child)
    t0 = time.monotonic()
    waiter.wait(30)
    assert time.monotonic() - t0 < 20  # woken by the exit, not the timeout
    waiter.forget(0)
    assert waiter.fds == {}
    child.wait()
