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
