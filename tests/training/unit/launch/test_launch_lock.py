"""One launch per run per node (fsdp_resilience.training.launch.lock)."""

from __future__ import annotations

import json
import os
import socket

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
