"""Which faults are the platform's (fsdp_resilience.training.restart.fault_kinds)."""

from __future__ import annotations

from fsdp_resilience.training.checkpointing.rounds import CheckpointWriterError
from fsdp_resilience.training.restart.fault_kinds import UserErrorAbort, is_platform_fault


def test_storage_network_collective_and_writer_faults_are_the_platforms():
    for exc in (
        OSError(28, "No space left"),
        TimeoutError(),
        MemoryError(),
        CheckpointWriterError(3, "writer died"),
        RuntimeError("Gloo connectFullMesh failed"),
        RuntimeError("Connection closed by peer"),
    ):
        assert is_platform_fault(exc), exc


def test_errors_of_the_users_code_are_not():
    for exc in (ValueError("bad shape"), KeyError("x"), RuntimeError("mat1 and mat2 shapes cannot be multiplied")):
        assert not is_platform_fault(exc), exc


def test_the_user_error_abort_is_no_exception_the_wrapper_retries():
    assert not issubclass(UserErrorAbort, Exception) and issubclass(UserErrorAbort, BaseException)
