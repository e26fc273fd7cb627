"""Exit codes and failure classes (fsdp_resilience.training.contract.failures), and storage faults."""

import errno
import signal

from fsdp_resilience.training.contract.failures import ExitCode, FailureClass, failure_class_for_exit, storage_errno
from fsdp_resilience.training.contract.files import probe_writable


def test_exit_codes_map_to_failure_classes_both_ways():
    assert failure_class_for_exit(0) is FailureClass.SUCCESS
    assert failure_class_for_exit(ExitCode.USER_ERROR) is FailureClass.USER_ERROR
    assert failure_class_for_exit(75) is FailureClass.RESTARTS_EXHAUSTED
    assert failure_class_for_exit(93) is FailureClass.NO_PROGRESS
    assert failure_class_for_exit(137) is FailureClass.UNKNOWN
    assert not FailureClass.USER_ERROR.retryable and FailureClass.RESTARTS_EXHAUSTED.retryable


def test_new_failure_classes_have_documented_exit_codes():
    assert failure_class_for_exit(65) is FailureClass.NON_FINITE
    assert failure_class_for_exit(73) is FailureClass.ALREADY_RUNNING
    assert failure_class_for_exit(74) is FailureClass.STORAGE_ERROR
    for cls in (FailureClass.NON_FINITE, FailureClass.ALREADY_RUNNING, FailureClass.STORAGE_ERROR):
        assert not cls.retryable  # none of them is the machine's fault


def test_storage_errors_are_recognised_through_causes_and_text(tmp_path):
    import errno

    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as e:
            raise RuntimeError("save failed") from e
    except RuntimeError as e:
        assert storage_errno(e) == errno.ENOSPC
    assert storage_errno(RuntimeError("rank 1: [Errno 30] Read-only file system: '/fsx/x'")) == errno.EROFS
    assert storage_errno(RuntimeError("[Errno 2] No such file")) is None
    assert probe_writable(tmp_path) is None
    (tmp_path / "f").write_text("x")
    assert "not writable" in probe_writable(tmp_path / "f" / "sub")


def test_a_full_dev_shm_is_a_storage_error_in_the_words_torch_writes_it():
    """torch's shared-memory allocator reports a full /dev/shm as C++ text, "<strerror> (28)"
    (measured with torch 2.13 on a 4 MiB tmpfs; the older wording is DataLoader's well-known one)."""
    now = "unable to allocate shared memory(shm) for file </torch_10016_940612396_0>: No space left on device (28)"
    before = "RuntimeError: unable to write to file </torch_311_1954506196>: No space left on device (28)"
    assert storage_errno(RuntimeError(now)) == errno.ENOSPC
    assert storage_errno(RuntimeError(f"rank 3: {before}")) == errno.ENOSPC
    assert storage_errno(RuntimeError("Disk quota exceeded (122)")) == errno.EDQUOT
    # A number in brackets alone, or another errno's text, is not a storage error.
    assert storage_errno(RuntimeError("checkpoint step (28) failed")) is None
    assert storage_errno(RuntimeError("unable to open file <x>: Permission denied (13)")) is None


def test_a_process_killed_by_sigbus_reads_as_a_full_dev_shm():
    from fsdp_resilience.training.contract import describe_process_exit

    died = describe_process_exit("the checkpoint writer process (pid 41)", -signal.SIGBUS)
    assert died.startswith("the checkpoint writer process (pid 41) was killed by signal 7 (SIGBUS)")
    assert "/dev/shm" in died and "shm_size" in died
    assert storage_errno(RuntimeError(f"rank 2: {died} mid-save")) == errno.ENOSPC
    # torchelastic's and torch DataLoader's words for the same death.
    assert storage_errno(RuntimeError("Signal 7 (SIGBUS) received by PID 812")) == errno.ENOSPC
    assert storage_errno(RuntimeError("DataLoader worker (pid 9) is killed by signal: Bus error.")) == errno.ENOSPC
    # Any other death is an ordinary fault.
    for code in (-signal.SIGKILL, -signal.SIGSEGV, 1, 0):
        other = describe_process_exit("the checkpoint writer process (pid 41)", code)
        assert storage_errno(RuntimeError(other)) is None, other
    assert describe_process_exit("w", -signal.SIGKILL) == "w was killed by signal 9 (SIGKILL)"
    assert describe_process_exit("w", 3) == "w exited with code 3"
    assert describe_process_exit("w", None) == "w is gone (exit status unknown)"
