"""Exit codes and failure classes (fsdp_resilience.training.contract.failures), and storage faults."""

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
