"""What kind of fault a worker saw: the platform's (never a user error, however often it
repeats), and the abort that ends every restart layer once a fault is a user error."""

from __future__ import annotations

import torch.distributed as dist

from fsdp_resilience.training.checkpointing.rounds import CheckpointWriterError


class UserErrorAbort(BaseException):
    """Raised (as a BaseException, so the in-process Wrapper does not retry it) once a fault is
    classified as a user error: the same exception at the same step on two attempts."""


#: Words in a RuntimeError's message that mark a collective / transport failure.
_COMM_MARKERS = ("gloo", "nccl", "connection", "timed out", "timeout", "socket", "peer")


def is_platform_fault(exc: BaseException) -> bool:
    """Whether ``exc`` comes from the platform (storage, network, collectives, the checkpoint
    writer, memory) rather than the user's code: such faults are never called user errors, however
    often they repeat; they escalate through the restart layers instead."""
    if isinstance(exc, (CheckpointWriterError, dist.DistError, OSError, MemoryError, TimeoutError)):
        return True
    if isinstance(exc, RuntimeError):
        message = str(exc).lower()
        return any(marker in message for marker in _COMM_MARKERS)
    return False
