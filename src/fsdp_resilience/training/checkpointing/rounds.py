"""The collective rounds of the commit protocol, run by ``AsyncCheckpointer`` on every rank.

Finalizing (``poll``/``wait``, and at the start of the next ``save``) is a collective: every rank
reports whether its write finished, failed, or its writer process died or stalled; only when every
rank finished does rank 0 write DCP's ``.metadata`` and then ``CheckpointCatalog.commit`` (which
refuses a checkpoint without every rank's checksums, see ``commit``); retention then runs in the
background on rank 0. A failure anywhere makes every rank raise ``CheckpointWriterError``; the
step stays torn (no marker) and is never loaded. Before a save, a settle round agrees that every
rank's writer process is up, that all ranks save the same step, and whether the cached plan holds.

Here: the per-rank states a round exchanges, what a pending save holds, the group the rounds run
on, ``CheckpointWriterError``, and ``CommitRounds``, the rounds themselves.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import FileSystemWriterAsync

from fsdp_resilience.training.contract import CheckpointInfo

log = logging.getLogger(__name__)

#: How long one finalize round waits locally before the ranks compare notes (seconds). Short, so
#: a rank that finished early never sits in a collective for long (gloo timeouts can be seconds).
_ROUND_S = 0.05

# Per-rank states exchanged in a finalize / settle round. Larger is worse: any rank's FAILED or
# DEAD fails the save everywhere.
_DONE, _BUSY, _FAILED, _DEAD = 0, 1, 2, 3
_STATE_NAMES = {_DONE: "done", _BUSY: "busy", _FAILED: "write failed", _DEAD: "writer process died or stalled"}


@dataclasses.dataclass
class _PendingSave:
    step: int
    path: Path
    writer: FileSystemWriterAsync
    metadata: Any
    dist_wrapper: Any
    call_idx: int | None  # None: nothing to write on this rank
    began: float  # time.monotonic() when save() was entered
    scheduled: float
    local_state: int | None = None  # sticky once DONE / FAILED / DEAD
    write_results: list | None = None
    error: str = ""


def _protocol_group(group: dist.ProcessGroup, timeout_s: float | None = None) -> dist.ProcessGroup:
    """The group the save protocol (planning, settle and finalize rounds, commit) runs on: a gloo
    group over ``group``'s ranks, on every backend, with ``timeout_s`` (the run's collective
    timeout; None: torch's gloo default, 30 min).

    On NCCL every round would otherwise be a GPU collective plus a host sync of its result, once
    per step while a save is pending; a gloo group keeps them on the host, off the GPU streams, as
    torch's docs recommend for async checkpointing. On gloo a group of its own runs the same code
    as on NCCL, so the CPU lanes test the path GPUs take. Creating it is a collective: ``rebind``
    is called on every rank at the same point."""
    ranks = None if group is dist.group.WORLD else dist.get_process_group_ranks(group)
    timeout = datetime.timedelta(seconds=timeout_s) if timeout_s is not None else None
    return dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)


def _failed_ranks(states: list[int]) -> list[int]:
    return [r for r, s in enumerate(states) if s in (_FAILED, _DEAD)]


class CheckpointWriterError(RuntimeError):
    """A checkpoint save failed on at least one rank (its writer process died, hung, or the write
    raised). Raised on every rank at the same point; the step is left uncommitted (torn) and the
    checkpointer is ready for the next save (a dead writer has already been replaced)."""

    def __init__(self, step: int, message: str, failed_ranks: tuple[int, ...] = ()):
        # args mirror the signature: restart layers copy and pickle exceptions as cls(*args).
        super().__init__(step, message, tuple(failed_ranks))
        self.step = step
        self.message = message
        self.failed_ranks = tuple(failed_ranks)

    def __str__(self) -> str:
        return f"checkpoint step {self.step} failed: {self.message}"


class CommitRounds:
    """``AsyncCheckpointer``'s collective rounds: settle before a save, finalize after it, and
    the agreement on rank 0's commit. Each is one all-reduce of small host tensors per short
    round (``_ROUND_S``), on every rank at the same point.

    A base class of ``AsyncCheckpointer`` only: it uses the checkpointer's group, rank, writer
    (``_helpers``, ``_calls``), pending save, committer and plan cache, and its ``rebind`` and
    ``_start_writer``."""

    def _agree(self, *values: int) -> list[list[int]]:
        """Every rank's ``values``: row i holds value i of each rank (one all-reduce)."""
        table = torch.zeros((len(values), self._world_size), dtype=torch.int64, device=self._collective_device)
        table[:, self._rank] = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(table, group=self._group)
        return table.tolist()

    def _settle(self, step: int, already_committed: int, plan_key: int | None = None) -> bool:
        """Agree that every writer is up and every rank saves ``step``; False: skip (committed).
        Also agrees whether the plan cache holds on every rank for this save (``plan_key``: the
        state's ``structure_key``); if not, every rank drops it and plans afresh."""
        self._require_group()
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            self._progress()  # each round: a rank waiting here for writers is not hung
            state = _DONE
            if self.async_save:
                state = self._writer_state(deadline)
            cache_holds = int(plan_key is not None and plan_key == self._plan_key)
            states, steps, committed, cache_held = self._agree(state, step, already_committed, cache_holds)
            if not all(cache_held):
                self._drop_plan_cache()
                self._plan_key = plan_key
            if len(set(steps)) != 1:
                raise RuntimeError(
                    f"ranks disagree on the checkpoint step: {steps}; save() must be "
                    "called with the same step on every rank"
                )
            failed = _failed_ranks(states)
            if failed:
                raise CheckpointWriterError(
                    step,
                    f"checkpoint writer did not start on rank(s) {failed} (not up "
                    f"within {self.start_timeout_s:.0f}s, or died starting)",
                    tuple(failed),
                )
            if max(states) == _DONE:
                return committed[0] == 0

    def _writer_state(self, deadline: float) -> int:
        """DONE when this rank's writer is up and has finished everything it was given (its boot
        ping, an abandoned save); BUSY until then. Waiting here, in short collective rounds, keeps a
        rank from stalling alone in the staging handshake while the others train on. A writer that
        died, or stalls on what it was given (an abandoned save), is replaced here."""
        writer = self._helpers.writer
        if writer.wait_completed(self._calls.call_idx, _ROUND_S):
            self._calls.forget_up_to(writer.completed_idx)
            return _DONE
        if not writer.alive:
            log.warning("rank %d: checkpoint writer (pid %s) died; starting a new one", self._rank, writer.pid)
            self._start_writer()
        elif self._writer_stuck():
            log.warning(
                "rank %d: checkpoint writer (pid %s) made no progress for %.0fs; killing it and starting a new one",
                self._rank,
                writer.pid,
                writer.idle_s(),
            )
            self._start_writer()
        return _FAILED if time.monotonic() > deadline else _BUSY

    def _writer_stuck(self) -> bool:
        """Whether the writer has unfinished work and shows no progress for ``writer_stall_s``."""
        writer = self._helpers.writer
        if self._calls is None or writer.wait_completed(self._calls.call_idx, 0.0):
            return False  # idle: nothing to make progress on
        return writer.stalled()

    def _finalize(self, blocking: bool) -> list[CheckpointInfo]:
        pending = self._pending
        self._require_group()
        while True:
            if blocking:
                self._progress()  # each round: a rank waiting for a slow write is not hung
            state = self._write_state(pending, _ROUND_S if blocking else 0.0)
            states, steps = self._agree(state, pending.step)
            if len(set(steps)) != 1:
                raise RuntimeError(f"ranks are finalizing different checkpoint steps: {steps}")
            failed = _failed_ranks(states)
            if failed:
                self._fail(pending, states, failed)
            if max(states) == _DONE:
                break
            if not blocking:
                return []
        all_results = pending.dist_wrapper.gather_object(pending.write_results)  # on the coordinator

        def finish() -> None:
            pending.writer.finish(pending.metadata, all_results)  # DCP's .metadata

        self._pending = None
        return [self._commit(pending.step, pending.path, pending.began, finish)]

    def _write_state(self, pending: _PendingSave, wait_s: float) -> int:
        """This rank's view of the pending write (sticky once it is final)."""
        if pending.local_state is not None:
            return pending.local_state
        writer = self._helpers.writer
        if pending.call_idx is None or writer.wait_completed(pending.call_idx, wait_s):
            if pending.call_idx is not None:
                self._calls.forget_up_to(pending.call_idx)
            try:
                results = pending.writer.retrieve_write_results()
            except Exception as e:  # 0.4.1 raises what the writer reported instead of results
                results = (e, None)
            if isinstance(results, tuple) and len(results) == 2 and isinstance(results[0], BaseException):
                # 0.7 returns it wrapped, DCP-style: (exception, traceback summary)
                pending.local_state, pending.error = _FAILED, f"{type(results[0]).__name__}: {results[0]}"
            else:
                pending.write_results, pending.local_state = results, _DONE
            return pending.local_state
        if not writer.alive:
            pending.local_state = _DEAD
            pending.error = f"{writer.exit_description()} mid-save"
        elif writer.stalled():
            pending.local_state = _DEAD
            pending.error = (
                f"the checkpoint writer process (pid {writer.pid}) made no progress for "
                f"{writer.idle_s():.0f}s (writer_stall_s={self.writer_stall_s:g}: stopped or hung); "
                "killed and replaced"
            )
        elif time.monotonic() - pending.scheduled > self.write_timeout_s:
            pending.local_state = _DEAD
            pending.error = (
                f"the checkpoint writer process (pid {writer.pid}) did not finish within "
                f"write_timeout_s={self.write_timeout_s:.0f}s; killed and replaced"
            )
        if pending.local_state == _DEAD:
            log.error("rank %d: %s (step %d)", self._rank, pending.error, pending.step)
            self._start_writer()  # now (killing the old one), so it boots while training goes on
            return _DEAD
        return _BUSY

    def _fail(self, pending: _PendingSave, states: list[int], failed: list[int]) -> None:
        self._pending = None
        detail = "; ".join(f"rank {r}: {_STATE_NAMES[states[r]]}" for r in failed)
        if pending.error:
            detail += f" (here: {pending.error})"
        raise CheckpointWriterError(pending.step, f"{detail}; {pending.path.name} is left uncommitted", tuple(failed))

    def _commit(self, step: int, path: Path, began: float, finish: Callable[[], None] | None) -> CheckpointInfo:
        """Rank 0 commits (``Committer.commit``); every rank learns whether that worked, so all
        raise or none do. Then rank 0 applies retention in the background."""
        info, error = None, None
        if self._rank == 0:
            try:
                info = self._committer.commit(step, self._world_size, finish, began)
            except Exception as e:
                error = e
                log.exception("committing checkpoint step %d failed", step)
        (ok,) = self._agree(int(self._rank != 0 or error is None))
        if not all(ok):
            raise CheckpointWriterError(
                step, f"rank 0 could not commit {path.name}: {error or 'see rank 0 log'}", (0,)
            ) from error
        self._committer.trusted = step  # written, checksummed from disk and committed here
        if self._rank == 0:
            self._committer.start_retention()
        return info or CheckpointInfo(step, path, True, self._world_size)

    def _require_group(self) -> None:
        if self._group is None:
            if not dist.is_initialized():
                raise RuntimeError(
                    "checkpointing needs an initialized torch.distributed process group "
                    "(call rebind() after init_process_group)"
                )
            self.rebind(None)
