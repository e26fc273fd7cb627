"""A rank whose in-process Wrapper lost its store exits instead of hanging
(fsdp_resilience.training.restart.wrapper.exit_when_the_monitor_thread_dies).

NVRx's own ``MonitorThread`` runs here in a child process, against a store that fails the way
a TCPStore fails when its host (rank 0's node) is gone: ``DistNetworkError``, which the thread
does not catch. The child must end with exit 1 and say why; a thread the Wrapper stopped itself
(``stop_loop`` set: the run or an iteration ended, and rank 0 may have left first) must not.
Before it exits, the rank logs the fault (``on_store_lost``), and a failure to log never keeps it
from exiting."""

from __future__ import annotations

import subprocess
import sys
import textwrap

CHILD = textwrap.dedent(
    """
    import datetime, threading, time, sys
    import torch.distributed as dist
    from nvidia_resiliency_ext.inprocess.monitor_thread import MonitorThread
    from fsdp_resilience.training.restart.wrapper import exit_when_the_monitor_thread_dies

    class State:
        rank = 3

    class LostStore:
        # The Wrapper's store once its host is gone: the wait fails with DistNetworkError.
        def __init__(self, after_stop):
            self.after_stop = after_stop
        def wait_for_interrupted(self, timeout):
            while self.after_stop and not thread.stop_loop.is_set():
                time.sleep(0.01)
            raise dist.DistNetworkError("Failed to recv, got 0 bytes. Connection was likely closed.")

    def on_store_lost(exc):
        if sys.argv[1] == "unloggable":
            raise OSError("the run dir is gone")
        print(f"logged {type(exc).__name__}", flush=True)

    exit_when_the_monitor_thread_dies(on_store_lost)
    exit_when_the_monitor_thread_dies()  # a second Wrapper in the process installs nothing more
    after_stop = sys.argv[1] == "stopped"
    thread = MonitorThread(
        State(), LostStore(after_stop), None, datetime.timedelta(seconds=0.05), None,
        datetime.timedelta(seconds=1), datetime.timedelta(seconds=0.05), threading.RLock(), True,
    )
    thread.start()
    if after_stop:
        thread.stop_loop.set()
    thread.join(30)
    print("still running", flush=True)
    """
)


def run_child(mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=120)


def test_a_monitor_thread_that_lost_its_store_ends_the_rank():
    child = run_child("lost")
    assert child.returncode == 1, child.stderr
    assert "still running" not in child.stdout
    assert "logged DistNetworkError" in child.stdout  # the fault, before the exit
    assert "monitor thread (MonitorThread-3) died: DistNetworkError" in child.stderr
    assert "ft_launcher restarts" in child.stderr


def test_a_rank_that_cannot_log_the_lost_store_still_exits():
    child = run_child("unloggable")
    assert child.returncode == 1, child.stderr
    assert "still running" not in child.stdout
    assert "could not log the lost store: OSError('the run dir is gone')" in child.stderr


def test_a_monitor_thread_the_wrapper_stopped_ends_nothing():
    child = run_child("stopped")
    assert child.returncode == 0, child.stderr
    assert "still running" in child.stdout
    assert "DistNetworkError" in child.stderr  # the usual hook still prints it
    assert "ft_launcher restarts" not in child.stderr and "logged" not in child.stdout
