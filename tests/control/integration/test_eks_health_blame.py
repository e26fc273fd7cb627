"""Health-aware blame on the real control plane (tests/control/kube, as test_eks_backend.py): a
launch that ends as a user bug blames a node only when that node says it is unhealthy (the EKS
node monitoring agent's condition, an NVRx health check in the run's events on FSx), and the
backend then takes that node out of service; on nodes healthy by every signal nothing is blamed
and no node is touched. The pure rule: tests/control/unit/test_health_blame.py."""

from __future__ import annotations

from pathlib import Path

from fsdp_resilience.training.contract import Event, EventLog, ExitCode

from control.fakes.eks_cluster import NS, add_gpu_node, backend_for, run_config
from control.support.eks_waits import running_pods, status_when


def node_writes(cluster) -> list:
    return [r for r in cluster.requests if r.resource == "nodes" and r.verb in ("patch", "update")]


def user_bug(cluster, backend, cfg, exit_node_index: int = 0, before_exit=None) -> tuple[object, list[dict]]:
    """Submit a launch and end pod ``exit_node_index`` with the user-error exit code (78): the
    Job fails at once (podFailurePolicy). ``before_exit(node_name)`` runs just before the pod
    ends. Returns the handle and the launch's running pods, by index."""
    handle = backend.submit(cfg, "0")
    pods = running_pods(cluster, handle.job_name, 2)
    if before_exit is not None:
        before_exit(pods[exit_node_index]["spec"]["nodeName"])
    cluster.terminate_pod(NS, pods[exit_node_index]["metadata"]["name"], int(ExitCode.USER_ERROR))
    status = status_when(backend, handle, "failed")
    assert status.failure_class == "user_error", status.message
    return handle, pods


def test_a_user_bug_on_a_node_whose_gpu_condition_is_false_blames_and_replaces_that_node(cluster, tmp_path):
    for i in range(3):
        add_gpu_node(cluster, f"gpu-{i}")
    backend = backend_for(tmp_path, replacement="cordon")
    # The GPU fault surfaced as a CUDA exception in user code: the pod exits as a user error,
    # while the monitoring agent marks the GPU unhealthy.
    handle, pods = user_bug(
        cluster,
        backend,
        run_config(tmp_path, run_id="bug-on-bad-gpu"),
        before_exit=lambda node: cluster.set_node_condition(
            node, "AcceleratedHardwareReady", "False", "NvidiaXID79", "GPU has fallen off the bus"
        ),
    )
    bad = pods[0]["spec"]["nodeName"]

    diagnosis = backend.diagnose(handle)
    assert diagnosis.failure_class == "user_error"
    assert diagnosis.replaceable and diagnosis.bad_node_ids == [bad], diagnosis.evidence
    (signal,) = diagnosis.signals[bad]
    assert signal.startswith("AcceleratedHardwareReady=False (NvidiaXID79") and "fallen off the bus" in signal
    replacement = backend.replace_nodes(diagnosis.bad_node_ids, reason=f"rung 1: {diagnosis.failure_class}")
    assert replacement.replaced == [bad], replacement.reason
    assert cluster.node(bad)["spec"]["unschedulable"] is True
    other = pods[1]["spec"]["nodeName"]
    assert not cluster.node(other)["spec"].get("unschedulable")  # its peer, healthy, is kept


def test_the_same_user_bug_on_healthy_nodes_blames_and_replaces_nothing(cluster, tmp_path):
    for i in range(3):
        add_gpu_node(cluster, f"gpu-{i}")
    backend = backend_for(tmp_path, replacement="cordon")
    handle, _ = user_bug(cluster, backend, run_config(tmp_path, run_id="bug-on-healthy"))
    cluster.clear_requests()
    diagnosis = backend.diagnose(handle)
    assert not diagnosis.replaceable and diagnosis.bad_node_ids == [] and diagnosis.signals == {}
    assert any("healthy by every signal" in e for e in diagnosis.evidence), diagnosis.evidence
    assert not node_writes(cluster)  # diagnosing touched no node, and nothing was replaced


def test_an_nvrx_health_check_in_the_events_blames_its_node(cluster, tmp_path):
    for i in range(3):
        add_gpu_node(cluster, f"gpu-{i}")
    backend = backend_for(tmp_path, replacement="cordon")
    cfg = run_config(tmp_path, run_id="nvrx-check")
    handle = backend.submit(cfg, "0")
    pods = running_pods(cluster, handle.job_name, 2)
    bad = pods[1]["spec"]["nodeName"]
    # What the pods wrote to the run dir on FSx: the launch began, and on the other node NVRx's
    # restart health check failed (the rank recorded it as it ended). The nodes' conditions are
    # all healthy: the record is the only signal against it.
    events = EventLog(Path(cfg.run_dir) / "events.jsonl", run_id=cfg.run_id)
    events.emit(Event.LAUNCH_BEGIN, launch_id="0", node_rank=0, node_id=pods[0]["spec"]["nodeName"])
    events.emit(
        Event.HEALTH_CHECK_FAILED,
        node_id=bad,
        check="gpu",
        source="inprocess_wrapper",
        message="GPU health check failed",
        nvrx_version="0.7.0",
    )
    cluster.terminate_pod(NS, pods[0]["metadata"]["name"], int(ExitCode.USER_ERROR))
    assert status_when(backend, handle, "failed").failure_class == "user_error"
    diagnosis = backend.diagnose(handle)
    assert diagnosis.replaceable and diagnosis.bad_node_ids == [bad], diagnosis.evidence
    assert diagnosis.signals[bad] == [
        "NVRx gpu health check failed (inprocess_wrapper, NVRx 0.7.0): GPU health check failed"
    ]
