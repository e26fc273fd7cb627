"""The worker zygote and its client (launch/worker_zygote.py, launch/worker_client.py) with real
processes, sockets and signals: a stand-in rank (training/zygote_rank.py) instead of the
trainer, so no torch is imported. Started as ft_launcher starts a worker: the client script in a
session of its own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fsdp_resilience.training.launch.worker_client import STARTING_SUFFIX, ZYGOTE_ENV
from fsdp_resilience.training.launch.worker_zygote import CLIENT_SCRIPT, new_socket_path, start_zygote

from shared import REPO

PYTHONPATH = os.pathsep.join([str(REPO / "src"), str(REPO / "tests")])


def wait_for(condition, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


@pytest.fixture
def zygote(tmp_path):
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    path = new_socket_path()
    proc = start_zygote(path, env, ("--module", "training.zygote_rank", "--no-preload"))
    try:
        assert wait_for(lambda: os.path.exists(path) and not os.path.exists(path + STARTING_SUFFIX))
        yield proc, path
    finally:
        proc.kill()
        proc.wait()


def client(path: str, tmp_path: Path, *args: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-u", str(CLIENT_SCRIPT), *args],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": PYTHONPATH, ZYGOTE_ENV: path, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # as torch elastic starts a worker
    )


def test_the_rank_is_forked_with_the_clients_stdio_arguments_environment_and_folder(zygote, tmp_path):
    proc, path = zygote
    report = tmp_path / "report"
    run = client(path, tmp_path, "--report", str(report), "--say", "hello", "--exit", "7", ZYGOTE_TEST_VALUE="v1")
    out, err = run.communicate(timeout=30)
    assert run.returncode == 7, err  # the client exits as the rank did
    assert out == "hello\n"  # the rank wrote to the client's stdout
    pid, ppid, cwd, value, *argv = report.read_text().split()
    assert int(ppid) == proc.pid and int(pid) != run.pid  # forked by the zygote, not exec'd by the client
    assert (cwd, value, argv) == (str(tmp_path), "v1", ["--report", str(report), "--say", "hello", "--exit", "7"])
    assert "starting without the zygote" not in err


def test_a_rank_killed_by_a_signal_ends_its_client_by_the_same_signal(zygote, tmp_path):
    _, path = zygote
    for sig in (signal.SIGKILL, signal.SIGSEGV):
        run = client(path, tmp_path, "--signal", str(int(sig)))
        run.communicate(timeout=30)
        assert run.returncode == -sig  # what ft_launcher classifies the failure by


def test_the_launchers_sigterm_reaches_the_rank(zygote, tmp_path):
    _, path = zygote
    report = tmp_path / "report"
    run = client(path, tmp_path, "--report", str(report), "--sleep", "60")
    assert wait_for(report.exists)
    os.killpg(run.pid, signal.SIGTERM)  # torch elastic stops a worker by its process group
    out, _ = run.communicate(timeout=30)
    assert "got SIGTERM" in out and run.returncode == 43


def test_a_killed_client_takes_its_rank_with_it(zygote, tmp_path):
    _, path = zygote
    report = tmp_path / "report"
    run = client(path, tmp_path, "--report", str(report), "--sleep", "60")
    assert wait_for(report.exists)
    rank = int(report.read_text().split()[0])
    os.kill(rank, signal.SIGSTOP)  # even a frozen rank
    os.killpg(run.pid, signal.SIGKILL)  # SIGKILL cannot be passed on: the zygote sees the client go
    run.communicate(timeout=30)

    def gone() -> bool:
        try:
            with open(f"/proc/{rank}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] == "Z"
        except FileNotFoundError:
            return True

    assert wait_for(gone, 10)


def test_without_a_zygote_the_client_becomes_the_trainer_itself(tmp_path):
    run = client(str(tmp_path / "no-such-socket"), tmp_path, "--help")
    out, err = run.communicate(timeout=120)
    assert run.returncode == 0, err
    assert "starting without the zygote" in err
    assert "fsdp_resilience.training.train" in out  # the trainer's own --help, exec'd in the client's process


def test_ranks_die_with_the_zygote(zygote, tmp_path):
    """The launch SIGKILLed takes the zygote with it (parent-death signal), and the zygote its ranks,
    even before their clients are stopped."""
    proc, path = zygote
    report = tmp_path / "report"
    run = client(path, tmp_path, "--report", str(report), "--sleep", "60")
    assert wait_for(report.exists)
    rank = int(report.read_text().split()[0])
    proc.kill()
    proc.wait()
    out, err = run.communicate(timeout=30)
    assert run.returncode == 1 and "lost the zygote" in err
    assert wait_for(
        lambda: (
            not os.path.exists(f"/proc/{rank}") or open(f"/proc/{rank}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
        ),
        10,
    )
