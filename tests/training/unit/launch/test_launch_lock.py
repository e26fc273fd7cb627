"""One launch per run per node (fsdp_resilience.training.launch.lock)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from fsdp_resilience.training.contract import RunDir
from fsdp_resilience.training.launch.lock import AlreadyRunning, take_launch_lock


def test_a_second_launcher_of_a_node_is_refused_and_names_the_first(tmp_path):
    layout = RunDir(tmp_path / "run")
    layout.create()
    fd = take_launch_lock(layout, 0, "launch-a")
    try:
        holder = json.loads(layout.launch_lock(0).read_text())
        assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
        assert holder["launch_id"] == "launch-a"
        # The same launch on the same host is no lost predecessor: refused at once.
        with pytest.raises(AlreadyRunning, match=f"pid {os.getpid()} on {socket.gethostname()}"):
            take_launch_lock(layout, 0, "launch-a", predecessor_wait_s=60.0)
        other = take_launch_lock(layout, 1, "launch-a")  # another node's lock is its own
        os.close(other)
    finally:
        os.close(fd)
    os.close(take_launch_lock(layout, 0, "launch-b"))  # free once its holder is gone


def test_a_recreated_node_waits_for_its_lost_predecessors_lock(tmp_path):
    """On EKS the Job recreates a lost node's pod under the same index while the lost machine's
    storage client may still hold that index's launch lock: the new launcher of the same launch
    waits for it (bounded) instead of exiting already_running, which would fail the whole Job. A
    launcher of another launch, or on the same host, is refused at once as before."""
    layout = RunDir(tmp_path / "run")
    layout.create()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import fcntl, json, os, sys, time\n"
                "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
                "fcntl.flock(fd, fcntl.LOCK_EX)\n"
                "os.pwrite(fd, json.dumps({'pid': os.getpid(), 'host': 'lost-node', 'launch_id': 'l0'}).encode(), 0)\n"
                "print('held', flush=True)\n"
                "time.sleep(float(sys.argv[2]))\n"
            ),
            str(layout.launch_lock(1)),
            "3",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(AlreadyRunning, match="lost-node"):
            take_launch_lock(layout, 1, "other-launch", predecessor_wait_s=10)
        t0 = time.monotonic()
        fd = take_launch_lock(layout, 1, "l0", predecessor_wait_s=60)
        assert fd is not None and time.monotonic() - t0 > 0.5  # it waited for the holder to go
        assert json.loads(os.pread(fd, 4096, 0))["launch_id"] == "l0"
        os.close(fd)
    finally:
        holder.kill()
        holder.wait()


def _hold(path, record: dict, seconds: float) -> subprocess.Popen:
    """A process on this host holding ``path``'s flock with ``record`` written in it."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import fcntl, json, os, sys, time\n"
                "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
                "fcntl.flock(fd, fcntl.LOCK_EX)\n"
                "os.pwrite(fd, json.dumps({**json.loads(sys.argv[3]), 'pid': os.getpid()}).encode(), 0)\n"
                "print('held', flush=True)\n"
                "time.sleep(float(sys.argv[2]))\n"
            ),
            str(path),
            str(seconds),
            json.dumps(record),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_recreated_pod_with_the_lost_pods_hostname_waits_for_it_by_pod_uid(tmp_path, monkeypatch):
    """On EKS the pod the Job recreates for an index keeps the lost pod's host name
    (<job>-<index>): the predecessor is told by its pod UID (downward API), so the new pod waits
    for the lost pod's lock instead of exiting already_running, which fails the whole Job."""
    layout = RunDir(tmp_path / "run")
    layout.create()
    me = socket.gethostname()  # the same host name, as a recreated pod has
    holder = _hold(layout.launch_lock(1), {"host": me, "launch_id": "l0", "pod_uid": "uid-lost", "node": "n1"}, 2)
    monkeypatch.setenv("TRAINING_POD_UID", "uid-new")
    monkeypatch.setenv("TRAINING_NODE_ID", "n2")
    try:
        t0 = time.monotonic()
        fd = take_launch_lock(layout, 1, "l0", predecessor_wait_s=60)
        assert fd is not None and time.monotonic() - t0 > 0.5  # it waited for the predecessor
        record = json.loads(os.pread(fd, 4096, 0))
        assert (record["pod_uid"], record["node"], record["launch_id"]) == ("uid-new", "n2", "l0")
        os.close(fd)
    finally:
        holder.kill()
        holder.wait()


def test_the_same_pod_or_another_launch_is_refused_at_once(tmp_path, monkeypatch):
    layout = RunDir(tmp_path / "run")
    layout.create()
    holder = _hold(
        layout.launch_lock(0), {"host": socket.gethostname(), "launch_id": "l0", "pod_uid": "uid-a", "node": "n1"}, 30
    )
    try:
        monkeypatch.setenv("TRAINING_POD_UID", "uid-a")  # a second launcher in the same pod
        t0 = time.monotonic()
        with pytest.raises(AlreadyRunning, match="pod uid-a on node n1"):
            take_launch_lock(layout, 0, "l0", predecessor_wait_s=60)
        monkeypatch.setenv("TRAINING_POD_UID", "uid-b")  # another pod, but another launch
        with pytest.raises(AlreadyRunning):
            take_launch_lock(layout, 0, "l1", predecessor_wait_s=60)
        assert time.monotonic() - t0 < 5
    finally:
        holder.kill()
        holder.wait()


def test_a_predecessors_lock_held_past_the_bound_is_stale_and_the_launch_goes_on(tmp_path, monkeypatch, capsys):
    """A lost machine's storage client may hold the lock for a while; past the bound the pod
    goes on without it (the Job recreated it only once the lost pod was terminal)."""
    layout = RunDir(tmp_path / "run")
    layout.create()
    holder = _hold(layout.launch_lock(0), {"host": socket.gethostname(), "launch_id": "l0", "pod_uid": "uid-lost"}, 30)
    monkeypatch.setenv("TRAINING_POD_UID", "uid-new")
    try:
        t0 = time.monotonic()
        assert take_launch_lock(layout, 0, "l0", predecessor_wait_s=1.5) is None
        assert 1.4 < time.monotonic() - t0 < 10
        assert "taking its lock as stale" in capsys.readouterr().err
    finally:
        holder.kill()
        holder.wait()


def test_is_predecessor_falls_back_to_the_host_without_pod_uids():
    from fsdp_resilience.training.launch.lock import is_predecessor

    local = {"host": "h1", "pod_uid": None}
    assert is_predecessor({"host": "h2", "launch_id": "0"}, "0", local)
    assert not is_predecessor({"host": "h1", "launch_id": "0"}, "0", local)
    assert not is_predecessor({"host": "h2", "launch_id": "0"}, "", local)
    assert is_predecessor({"host": "h1", "launch_id": "0", "pod_uid": "a"}, "0", {"host": "h1", "pod_uid": "b"})
