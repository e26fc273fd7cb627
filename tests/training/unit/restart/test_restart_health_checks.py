"""NVRx's failed health checks as evidence against a node (fsdp_resilience.training.restart.
health_checks): found in the exception the in-process Wrapper ends a rank with (NVRx's own
exception classes, chained the way its Wrapper chains them), in ft_launcher's refusal lines
(the messages of both versions' rendezvous), and recorded as ``health_check_failed``."""

from __future__ import annotations

from nvidia_resiliency_ext.inprocess import exception as nvrx_exception

from fsdp_resilience.training.contract import HEALTH_CHECKS, NODE_ID_ENV, Event, EventLog, read_events
from fsdp_resilience.training.launch.outcome import launcher_log_lines
from fsdp_resilience.training.restart.health_checks import (
    LAUNCHER,
    WRAPPER,
    check_named_in,
    failed_health_check,
    launcher_refusal,
    record_health_check,
)


def wrapper_exit(check_error: BaseException) -> BaseException:
    """What NVRx 0.7's Wrapper raises when its restart health check fails after a fault (wrap.py:
    the check's error re-raised from the fault, wrapped in a bare HealthCheckError, then in an
    InternalError, re-raised ``from None`` on the way out)."""
    try:
        try:
            try:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            except RuntimeError as term_ex:
                try:
                    raise check_error
                except Exception as health_ex:
                    try:
                        raise health_ex from term_ex
                    except Exception:
                        raise nvrx_exception.HealthCheckError from health_ex
        except Exception as term_ex:
            raise nvrx_exception.InternalError("state") from term_ex
    except BaseException as exit_ex:
        try:
            raise exit_ex from None
        except BaseException as raised:
            return raised


def test_a_failed_restart_health_check_is_found_under_the_wrappers_exit():
    gpu = wrapper_exit(nvrx_exception.HealthCheckError("GPU health check failed"))
    assert gpu.__cause__ is None  # hidden from the traceback, kept as the context
    assert failed_health_check(gpu) == ("gpu", "GPU health check failed")
    nic = wrapper_exit(nvrx_exception.HealthCheckError("NIC health check failed - link down detected"))
    assert failed_health_check(nic) == ("nic", "NIC health check failed - link down detected")


def test_an_ordinary_fault_or_a_user_bug_is_no_health_check():
    assert failed_health_check(RuntimeError("CUDA error: an illegal memory access was encountered")) is None
    try:
        try:
            raise ValueError("shape mismatch")
        except ValueError as fault:
            raise nvrx_exception.InternalError("state") from fault
    except nvrx_exception.InternalError as ended:
        assert failed_health_check(ended) is None


def test_ft_launchers_refusals_of_both_versions_name_the_check():
    # 0.4.1 (and 0.7): the rendezvous' GPU check; 0.7: NIC link state, storage, a node-health service.
    assert launcher_refusal(
        ["[E] Health check failed for node gpu-7: Node gpu-7 has an unhealthy GPU.", "Traceback ..."]
    ) == ("gpu", "gpu-7: Node gpu-7 has an unhealthy GPU.")
    assert launcher_refusal(["...launcher.UnhealthyNodeException: Node gpu-7 has unhealthy NIC link(s)."])[0] == "nic"
    assert launcher_refusal(
        ["Agent .run() raised UnhealthyNodeException: Node n has invalid or unreadable paths."]
    ) == (
        "storage",
        "Node n has invalid or unreadable paths.",
    )
    assert launcher_refusal(["UnhealthyNodeException: Node gpu-3 is unhealthy."])[0] == "node"
    # A rank asked for its node to be excluded: no health check failed.
    assert (
        launcher_refusal(["UnhealthyNodeException: Node n is excluded from the training due to an user request."])
        is None
    )
    assert launcher_refusal(["rendezvous round 3 complete"]) is None


def test_a_node_name_is_not_taken_for_the_check():
    assert check_named_in("Node gpu-storage-1 has unhealthy NIC link(s).") == "nic"
    assert set(map(check_named_in, ["GPU health check failed", "NVL health check", "x"])) <= set(HEALTH_CHECKS)


def test_the_record_names_the_node_and_the_check(tmp_path, monkeypatch):
    monkeypatch.setenv(NODE_ID_ENV, "gpu-7")
    log = tmp_path / "launcher.log"
    log.write_text("starting\nHealth check failed for node gpu-7: Node gpu-7 has an unhealthy GPU.\n")
    check, message = launcher_refusal(launcher_log_lines(str(log)))
    record_health_check(EventLog(tmp_path / "events.jsonl", run_id="r", launch_id="0"), check, LAUNCHER, message)
    record_health_check(EventLog(tmp_path / "events.jsonl", run_id="r"), "gpu", WRAPPER, "GPU health check failed")
    first, second = read_events(tmp_path / "events.jsonl", Event.HEALTH_CHECK_FAILED)
    assert (first["node_id"], first["check"], first["source"]) == ("gpu-7", "gpu", "ft_launcher")
    assert second["source"] == "inprocess_wrapper" and first["nvrx_version"][0].isdigit()
