"""The writer process (checkpointing/writer.py) with real processes: its forked file writers die
with it, and a stopped writer is seen as stalled and killed with its whole tree. Real SIGSTOP and
SIGKILL; nothing is mocked."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch.multiprocessing as mp
from test_checkpoint import _running

from fsdp_resilience.training.checkpointing.writer import _PersistentWriter, _WriterQueue
from fsdp_resilience.training.faults import descendants


def _fork_file_writer(pid_file: str) -> None:
    """Runs in the writer process, as NVRx 0.4.1's write does: fork a child and wait for it."""
    child = mp.get_context("fork").Process(target=time.sleep, args=(600,), daemon=False)
    child.start()
    Path(pid_file).write_text(str(child.pid))
    child.join()


def _writer_with_a_child(tmp_path: Path, stall_s: float = 600.0) -> tuple[_PersistentWriter, int]:
    from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncRequest

    writer = _PersistentWriter(rank=0, stall_s=stall_s)
    writer.start()
    calls = _WriterQueue(writer)
    pid_file = tmp_path / f"child-{time.monotonic_ns()}"
    calls.schedule_async_request(AsyncRequest(_fork_file_writer, (str(pid_file),), []))
    deadline = time.monotonic() + 120
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline and writer.alive, "the writer did not fork its child"
        time.sleep(0.05)
    return writer, int(pid_file.read_text())


def _wait_gone(pids: list[int], timeout: float = 20) -> list[int]:
    deadline = time.monotonic() + timeout
    while any(_running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if _running(p)]


@pytest.mark.slow
def test_a_killed_writer_takes_its_file_writers_with_it(tmp_path):
    writer, child = _writer_with_a_child(tmp_path)
    assert child in descendants(writer.pid)
    os.kill(writer.pid, signal.SIGKILL)  # as a drill or the OOM killer would: no cleanup runs
    assert _wait_gone([writer.pid, child]) == [], "the writer's forked file writer outlived it"
    writer.close()


@pytest.mark.slow
def test_a_stopped_writer_is_stalled_and_close_kills_its_whole_tree(tmp_path):
    writer, child = _writer_with_a_child(tmp_path, stall_s=2.0)
    pid = writer.pid
    for p in (pid, child):
        os.kill(p, signal.SIGSTOP)
    deadline = time.monotonic() + 60
    while not writer.stalled():
        assert time.monotonic() < deadline, "a stopped writer with work was never seen as stalled"
        time.sleep(0.1)
    writer.close()  # asks it to finish, sees it stalled, kills it and its child
    assert _wait_gone([pid, child]) == []


@pytest.mark.slow
def test_a_writer_killed_by_sigbus_mid_save_is_a_storage_error(tmp_path):
    """A full /dev/shm kills what touches a page the tmpfs cannot give with SIGBUS. The save's
    error then says so, and reads as a storage error (ENOSPC: no retry, no node replaced). (Any
    other death reads as an ordinary checkpoint fault: test_contract_failures.py.)"""
    import errno

    from fsdp_resilience.training.checkpointing.rounds import CheckpointWriterError
    from fsdp_resilience.training.contract import storage_errno

    writer, child = _writer_with_a_child(tmp_path)
    pid = writer.pid
    os.kill(pid, signal.SIGBUS)
    assert _wait_gone([pid, child]) == []
    assert not writer.alive
    died = writer.exit_description()
    assert died.startswith(f"the checkpoint writer process (pid {pid}) was killed by signal 7 (SIGBUS)"), died
    error = CheckpointWriterError(6, f"rank 0: writer process died or stalled (here: {died} mid-save)", (0,))
    assert storage_errno(error) == errno.ENOSPC
    writer.close()
