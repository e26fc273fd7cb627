"""The EKS backend against a real Kubernetes control plane (tests/control/kube: kube-apiserver
with RBAC, admission and the deploy kit's policies; the controller-manager's Job, EndpointSlice,
PodGC, garbage-collector and node lifecycle controllers; kube-scheduler; kwok playing the nodes and
ending pods the way a node would) and AWS Auto Scaling in moto's server. The backend reaches both
through the real clients and the providers' hooks (KubernetesHook, AsyncKubernetesHook,
AwsBaseHook) with the Airflow identities' real tokens, so what runs here is what runs against EKS,
minus the kubelets (no container runs: no pod logs, no downward-API values, no DNS).

Everything the controllers do is asynchronous: the tests wait for the state they assert
(``wait_for``, ``running_pods``, ``status_when``), never for a fixed time."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import pytest

from fsdp_resilience.control.backends import BackendError, InsufficientCapacityError, JobConflictError, get_backend
from fsdp_resilience.control.backends.eks import CANCEL_ANNOTATION, QUARANTINE_TAINT
from fsdp_resilience.training.contract import Event, EventLog, ExitCode, RunConfig, failure_class_for_exit, what_to_do

from control.fakes.eks_cluster import (
    NS,
    TRIGGERER,
    add_gpu_node,
    asg_instances,
    backend_for,
    commit_checkpoint,
    make_asg,
    run_config,
    start_strict_cluster,
    wait_for,
)
from control.support.eks_waits import (
    api_client,
    failed_count,
    index_of,
    job_failed,
    launch_objects,
    live,
    next_second,
    pods_by_index,
    running_by_index,
    running_pods,
    spare_run,
    status_when,
    true_conditions,
)


def test_submit_creates_one_indexed_job_and_a_headless_service_and_is_idempotent(cluster, tmp_path):
    for i in range(3):
        add_gpu_node(cluster, f"gpu-{i}")
    cluster.add_node("cpu-0")  # not in the pool: nothing lands there
    backend = backend_for(tmp_path)
    cfg = run_config(tmp_path)
    handle = backend.submit(cfg, "0", airflow_run_id="manual__2026-11-30T07:35:43+00:00")
    assert handle.backend == "eks" and handle.job_name.startswith("llm-0-")
    job = cluster.job(NS, handle.job_name)
    assert job["spec"]["completionMode"] == "Indexed" and job["spec"]["parallelism"] == 2
    pods = running_pods(cluster, handle.job_name, 2)
    assert len({p["spec"]["nodeName"] for p in pods}) == 2  # one pod per node
    assert all(p["spec"]["nodeName"].startswith("gpu-") for p in pods)
    # The rendezvous Service and NetworkPolicy, owned by the Job (deleting the Job deletes them),
    # created while the Job was suspended; then the Job was resumed.
    for resource in ("services", "networkpolicies"):
        assert len([r for r in cluster.requests if r.resource == resource and r.verb == "create"]) == 1, resource
    writes = [
        r
        for r in cluster.requests
        if r.verb in ("create", "patch") and r.resource in ("jobs", "services", "networkpolicies")
    ]
    job_writes = [(r.resource, r.verb) for r in writes if r.code < 400]
    assert job_writes == [("jobs", "create"), ("services", "create"), ("networkpolicies", "create"), ("jobs", "patch")]
    # The Job controller writes the new Job's status meanwhile: a resume patch computed from the
    # Job as created may get 409 (the resourceVersion it carries), then goes again on a fresh read.
    assert all((r.resource, r.verb, r.code) == ("jobs", "patch", 409) for r in writes if r.code >= 400), writes
    assert cluster.job(NS, handle.job_name)["spec"]["suspend"] is False
    assert backend.status(handle).state == "running"

    again = backend.submit(cfg, "0")  # a retried Airflow task
    assert again.job_name == handle.job_name
    assert len([r for r in cluster.requests if r.resource == "jobs" and r.verb == "create"]) == 1
    with pytest.raises(JobConflictError, match="already has job"):
        backend.submit(cfg, "1")  # launch 0 still runs: two launches would share one run dir


def test_bad_input_and_missing_capacity_fail_before_anything_is_created(cluster, tmp_path):
    add_gpu_node(cluster, "gpu-0")
    cfg = run_config(tmp_path)
    with pytest.raises(BackendError, match="needs a training image"):
        backend_for(tmp_path).__class__(namespace=NS, kubernetes_conn_id="kubernetes_fake").submit(cfg, "0")
    outside = RunConfig.from_dict({**cfg.to_dict(), "run_dir": "/elsewhere/runs/llm"})
    with pytest.raises(BackendError, match="outside|under"):
        backend_for(tmp_path).submit(outside, "0")
    with pytest.raises(InsufficientCapacityError, match="needs 2 healthy node"):
        backend_for(tmp_path).submit(cfg, "0")
    add_gpu_node(cluster, "gpu-1")  # enough for the training nodes, not for a spare beside them
    with pytest.raises(InsufficientCapacityError, match=r"needs 3 healthy node.*\(nodes 2 \+ spare_nodes 1\); 2 of 2"):
        backend_for(tmp_path).submit(spare_run(tmp_path), "0")
    with pytest.raises(BackendError, match="replacement="):
        backend_for(tmp_path, replacement="magic")
    assert not [r for r in cluster.requests if r.verb == "create"]


def test_status_and_status_async_agree_through_the_providers_hooks(cluster, tmp_path):
    for i in range(2):
        add_gpu_node(cluster, f"gpu-{i}")
    backend = backend_for(tmp_path)
    handle = backend.submit(run_config(tmp_path), "0")
    running_pods(cluster, handle.job_name, 2)
    sync = backend.status(handle)
    via_async = asyncio.run(backend.status_async(handle))
    assert sync.state == via_async.state == "running"
    assert [n.node_id for n in sync.nodes] == [n.node_id for n in via_async.nodes]

    cluster.succeed_pods(NS, handle.job_name)
    status = wait_for(
        lambda: (s := asyncio.run(backend.status_async(handle))).state == "succeeded" and s,
        what="the async status to read succeeded",
    )
    assert status.failure_class == "success" and backend.status(handle).state == "succeeded"
    assert status.exit_codes == {0: 0, 1: 0}


def test_restarts_exhausted_fails_the_job_at_once_and_blames_the_node_from_the_events(cluster, tmp_path):
    for i in range(3):
        add_gpu_node(cluster, f"gpu-{i}")
    backend = backend_for(tmp_path)
    cfg = run_config(tmp_path)
    handle = backend.submit(cfg, "0")
    pods = {p["spec"]["nodeName"]: p["metadata"]["name"] for p in running_pods(cluster, handle.job_name, 2)}
    bad = sorted(pods)[1]
    # What the pods wrote to the run dir on FSx: a rank on the bad node kept faulting.
    events = EventLog(Path(cfg.run_dir) / "events.jsonl", run_id=cfg.run_id)
    events.emit(Event.LAUNCH_BEGIN, launch_id="0", node_rank=0, node_id=sorted(pods)[0])
    events.emit(
        Event.FAULT_DETECTED, kind="exception", error="CUDA error: uncorrectable ECC error", step=7, rank=9, node_id=bad
    )
    events.emit(
        Event.FAULT_DETECTED,
        kind="collective",
        error="NCCL timeout waiting for rank 9",
        step=7,
        rank=0,
        node_id=sorted(pods)[0],
    )  # a peer's symptom: does not blame its node
    cluster.terminate_pod(NS, pods[bad], int(ExitCode.RESTARTS_EXHAUSTED))
    job_failed(cluster, handle.job_name)

    status = status_when(backend, handle, "failed")
    assert status.failure_class == "restarts_exhausted"
    assert "PodFailurePolicy" in status.message
    # No kubelet serves the container's log here: the backend asks the apiserver for the bad
    # node's pod's log and says why there is none, rather than failing.
    cluster.clear_requests()
    text = backend.logs(handle, node=[n.index for n in status.nodes if n.node_id == bad][0])
    assert isinstance(text, str) and text
    assert [r.name for r in cluster.requests if r.subresource == "log"] == [pods[bad]]
    diagnosis = backend.diagnose(handle)
    assert diagnosis.replaceable and diagnosis.bad_node_ids == [bad], diagnosis.evidence
    assert any("ECC" in e for e in diagnosis.evidence)


def test_a_node_the_monitoring_agent_marks_unhealthy_is_blamed(cluster, tmp_path):
    for i in range(2):
        add_gpu_node(cluster, f"gpu-{i}")
    backend = backend_for(tmp_path)
    handle = backend.submit(run_config(tmp_path), "0")
    pod = running_pods(cluster, handle.job_name, 2)[0]
    node = pod["spec"]["nodeName"]
    cluster.set_node_condition(node, "AcceleratedHardwareReady", "False", "NvidiaXID79", "GPU has fallen off the bus")
    cluster.terminate_pod(NS, pod["metadata"]["name"], int(ExitCode.RESTARTS_EXHAUSTED))
    status_when(backend, handle, "failed")
    diagnosis = backend.diagnose(handle)
    assert diagnosis.bad_node_ids == [node] and diagnosis.replaceable
    assert any("AcceleratedHardwareReady=False" in e and "fallen off the bus" in e for e in diagnosis.evidence)


def test_a_lost_node_is_replaceable_and_a_user_error_never_is(cluster, tmp_path):
    for i in range(2):  # two nodes for two pods: a recreated pod lands where its index ran
        add_gpu_node(cluster, f"gpu-{i}")
    # No room for disruptions in the Job's failure budget: backoffLimit = backoff_limit (2).
    backend = backend_for(tmp_path, pod={"max_pod_disruptions": 0})
    lost = backend.submit(run_config(tmp_path, run_id="lost"), "0")
    victim = running_pods(cluster, lost.job_name, 2)[0]
    node = victim["spec"]["nodeName"]
    ended = {victim["metadata"]["name"]}
    cluster.terminate_pod_with_reason(NS, victim["metadata"]["name"], 137, "OOMKilled")
    # Not a FailJob exit code: it counts against backoffLimit, and the job controller starts a new
    # pod for that index after its backoff (the restart layers on the other nodes wait for it).
    for _ in range(2):  # backoffLimit=2: the third lost pod fails the job
        pod = wait_for(
            lambda: [
                p
                for p in cluster.pods(NS, lost.job_name)
                if p["status"]["phase"] == "Running" and p["spec"]["nodeName"] == node
                and p["metadata"]["name"] not in ended
            ],
            timeout=120,
            what="a replacement pod",
        )[0]  # fmt: skip
        assert backend.status(lost).state == "running"
        ended.add(pod["metadata"]["name"])
        cluster.terminate_pod_with_reason(NS, pod["metadata"]["name"], 137, "OOMKilled")
    job_failed(cluster, lost.job_name)
    status = status_when(backend, lost, "failed")
    assert status.failure_class == "restarts_exhausted", status.message
    assert "OOMKilled" in status.message and "BackoffLimitExceeded" in status.message
    diagnosis = backend.diagnose(lost)
    assert diagnosis.replaceable and diagnosis.bad_node_ids == [node], diagnosis.evidence

    for i in range(2, 4):
        add_gpu_node(cluster, f"gpu-{i}")
    bug = backend.submit(run_config(tmp_path, run_id="bug"), "0")
    pod = running_pods(cluster, bug.job_name, 2)[0]
    cluster.terminate_pod(NS, pod["metadata"]["name"], int(ExitCode.USER_ERROR))
    status = status_when(backend, bug, "failed")
    assert status.failure_class == "user_error"
    assert any(
        c["type"] == "Failed" and c["reason"] == "PodFailurePolicy"
        for c in job_failed(cluster, bug.job_name)["status"]["conditions"]
    )
    diagnosis = backend.diagnose(bug)
    assert not diagnosis.replaceable and diagnosis.bad_node_ids == []
    assert any("user error" in e for e in diagnosis.evidence)


@pytest.mark.parametrize("code", [ExitCode.STORAGE_ERROR, ExitCode.NON_FINITE, ExitCode.ALREADY_RUNNING])
def test_storage_non_finite_and_already_running_fail_the_job_at_once_and_replace_no_node(cluster, tmp_path, code):
    for i in range(3):
        add_gpu_node(cluster, f"gpu-{i}")
    backend = backend_for(tmp_path)
    failure = failure_class_for_exit(code).value
    handle = backend.submit(run_config(tmp_path, run_id=failure.replace("_", "-")), "0")
    pods = running_pods(cluster, handle.job_name, 2)
    # Node 1 ends with the class; node 0 is still training (or, already running: waiting for it).
    cluster.terminate_pod(NS, pods[1]["metadata"]["name"], int(code))
    status = status_when(backend, handle, "failed")
    assert status.failure_class == failure, status.message
    # The Job controller fails the Job at once (podFailurePolicy), with no pod retried.
    conditions = job_failed(cluster, handle.job_name)["status"]["conditions"]
    assert any(c["type"] == "Failed" and c["reason"] == "PodFailurePolicy" for c in conditions)
    assert {p["metadata"]["name"] for p in cluster.pods(NS, handle.job_name)} <= {p["metadata"]["name"] for p in pods}
    diagnosis = backend.diagnose(handle)
    assert not diagnosis.replaceable and diagnosis.bad_node_ids == []
    assert any(what_to_do(failure) in e for e in diagnosis.evidence)
    assert not [r for r in cluster.requests if r.resource == "nodes" and r.verb == "patch"]


def test_cancel_suspends_the_job_keeps_the_evidence_and_records_a_stall(cluster, tmp_path):
    for i in range(2):
        add_gpu_node(cluster, f"gpu-{i}")
    backend = backend_for(tmp_path)
    cfg = run_config(tmp_path, stall_timeout_s=10)
    handle = backend.submit(cfg, "0")
    nodes = sorted(p["spec"]["nodeName"] for p in running_pods(cluster, handle.job_name, 2))
    # Pretend the launch started long ago and never committed: the watch stops it as stalled.
    assert backend.status(handle).state == "running"
    import fsdp_resilience.control.backends.eks.backend as eks_backend

    real_ts = eks_backend.timestamp
    eks_backend.timestamp = lambda text: real_ts(text) - 3600
    try:
        backend.cancel(handle)
    finally:
        eks_backend.timestamp = real_ts
    job = cluster.job(NS, handle.job_name)
    assert job["spec"]["suspend"] is True and CANCEL_ANNOTATION in job["metadata"]["annotations"]
    wait_for(
        lambda: not [p for p in cluster.pods(NS, handle.job_name) if p["status"]["phase"] == "Running"],
        what="the suspended job's pods to stop",
    )
    status = backend.status(handle)
    assert status.state == "failed" and status.failure_class == "no_progress", status.message
    backend.cancel(handle)  # a no-op now
    diagnosis = backend.diagnose(handle)
    assert diagnosis.replaceable and set(diagnosis.bad_node_ids) <= set(nodes) and diagnosis.bad_node_ids


def test_replace_nodes_cordons_taints_evicts_and_terminates_the_instance_in_its_asg(cluster, tmp_path, aws):
    instances = make_asg("gpu-ng-a", 5)
    for i, instance in enumerate(instances):
        add_gpu_node(cluster, f"gpu-{i}", instance)
    backend = backend_for(tmp_path)
    handle = backend.submit(run_config(tmp_path, nodes=2), "0")
    pod = running_pods(cluster, handle.job_name, 2)[0]
    bad = pod["spec"]["nodeName"]
    bad_instance = instances[int(bad.split("-")[1])]

    replacement = backend.replace_nodes([bad], reason="rung 1: restarts_exhausted")
    assert replacement.replaced == [bad] and not replacement.refused, replacement.reason
    node = cluster.node(bad)
    assert node["spec"]["unschedulable"] is True
    assert any(t["key"] == QUARANTINE_TAINT for t in node["spec"]["taints"])
    assert any(t["key"] == "nvidia.com/gpu" for t in node["spec"]["taints"])  # other taints kept
    assert pod["metadata"]["name"] in replacement.reason  # its running pod was evicted
    assert [r for r in cluster.requests if r.subresource == "eviction" and r.verb == "create"]
    assert bad_instance not in asg_instances("gpu-ng-a")
    assert len(asg_instances("gpu-ng-a")) == 5  # desired capacity kept: the group launched a new one
    capacity = backend.capacity()
    assert capacity.total == 5 and capacity.healthy == 4 and capacity.quarantined == [bad]

    again = backend.replace_nodes([bad], reason="again")  # already out of service: left alone
    assert again.replaced == [] and "already out of service" in again.reason
    # The share rule: 2 of 5 at once is more than 20 %.
    others = sorted(n for n in capacity.healthy_node_ids)[:2]
    refused = backend.replace_nodes(others, reason="too many")
    assert refused.replaced == [] and refused.refused == others and "max_unhealthy_share" in refused.reason
    assert not any(cluster.node(n)["spec"].get("unschedulable") for n in others)


def test_an_untagged_asg_is_not_touched_and_the_reason_says_why(cluster, tmp_path, aws):
    instances = make_asg("someone-elses", 1, tagged=False)
    add_gpu_node(cluster, "gpu-0", instances[0])
    replacement = backend_for(tmp_path, max_unhealthy_share=1.0).replace_nodes(["gpu-0"], reason="test")
    assert replacement.refused == ["gpu-0"] and "lacks the tag fsdp-resilience/managed=true" in replacement.reason
    assert asg_instances("someone-elses") == instances


def test_karpenter_mode_deletes_the_nodeclaim_and_provisions_on_demand(kube, tmp_path, monkeypatch):
    cluster = start_strict_cluster(kube, tmp_path, monkeypatch, "example-karpenter")
    for i in range(5):
        add_gpu_node(cluster, f"gpu-{i}")
        # The kit's admission policy lets the Airflow identities delete claims of the GPU
        # NodePool only: gpu-4's claim belongs to another pool.
        cluster.add_nodeclaim(f"gpu-claim-{i}", f"gpu-{i}", nodepool="gpu" if i < 4 else "general")
    backend = backend_for(tmp_path, replacement="karpenter")
    replacement = backend.replace_nodes(["gpu-3"], reason="bad GPU")
    assert replacement.replaced == ["gpu-3"], replacement.reason
    deleted = [r.name for r in cluster.requests if r.resource == "nodeclaims" and r.verb == "delete"]
    assert deleted == ["gpu-claim-3"]
    capacity = backend.capacity()
    assert capacity.provisions_on_demand and capacity.fits(64)

    refused = backend.replace_nodes(["gpu-4"], reason="bad GPU")
    assert refused.replaced == [] and refused.refused == ["gpu-4"]
    assert "fsdp-airflow-nodeclaim-deletes" in refused.reason, refused.reason
    assert cluster.nodeclaim("gpu-claim-4")  # still there


def test_evaluation_runs_as_a_one_pod_job_and_returns_its_result(cluster, tmp_path):
    add_gpu_node(cluster, "gpu-0")
    backend = backend_for(tmp_path, evaluation_poll_s=0.05)
    cfg = run_config(tmp_path, nodes=1)
    with pytest.raises(BackendError, match="no committed checkpoint"):
        backend.run_evaluation(cfg)
    commit_checkpoint(cfg.run_dir, 20, world_size=8)

    def pod_that_evaluates():
        pods = wait_for(lambda: [p for p in cluster.pods(NS) if "eval" in p["metadata"]["name"]], what="the eval pod")
        Path(cfg.run_dir, "eval.json").write_text(json.dumps({"checkpoint_id": "step_00000020", "val_loss": 2.5}))
        cluster.terminate_pod(NS, pods[0]["metadata"]["name"], 0)

    threading.Thread(target=pod_that_evaluates, daemon=True).start()
    assert backend.run_evaluation(cfg, timeout_s=30) == {"checkpoint_id": "step_00000020", "val_loss": 2.5}
    eval_jobs = [r for r in cluster.requests if r.resource == "jobs" and r.verb == "create"]
    assert len(eval_jobs) == 1


def test_the_watch_reads_checkpoints_from_the_s3_export_and_the_job_through_the_async_hook(cluster, tmp_path, aws):
    """A triggerer without the FSx mount: progress from the run dir's S3 export, job state through
    AsyncKubernetesHook, all inside the deferrable trigger's event loop."""
    import boto3

    from fsdp_resilience.control.triggers.training_progress import TrainingProgressTrigger
    from fsdp_resilience.training.contract import COMMIT_MARKER

    for i in range(2):
        add_gpu_node(cluster, f"gpu-{i}")
    backend = backend_for(tmp_path)
    handle = backend.submit(run_config(tmp_path, run_id="s3watch"), "0")
    running_pods(cluster, handle.job_name, 2)
    s3 = boto3.client("s3")
    s3.create_bucket(Bucket="exports", CreateBucketConfiguration={"LocationConstraint": "us-west-2"})
    for step in (5, 10):
        s3.put_object(
            Bucket="exports",
            Key=f"runs/s3watch/checkpoints/step_{step:08d}/{COMMIT_MARKER}",
            Body=json.dumps({"step": step, "world_size": 16, "committed_at": time.time()}).encode(),
        )
    s3.put_object(Bucket="exports", Key="runs/s3watch/checkpoints/step_00000015/__0_0.distcp", Body=b"torn")
    trigger = TrainingProgressTrigger(
        backend=backend.to_config(),
        handle=handle.to_dict(),
        run_dir=str(tmp_path / "not-mounted"),
        final_step=10,
        stall_timeout_s=600,
        launched_at=time.time(),
        poll_interval_s=0.05,
        checkpoints_s3="s3://exports/runs/s3watch",
        aws_conn_id="aws_fake",
    )
    assert TrainingProgressTrigger(**trigger.serialize()[1]).serialize() == trigger.serialize()

    async def first_event():
        async for event in trigger.run():
            return event.payload

    cluster.succeed_pods(NS, handle.job_name)
    event = asyncio.run(asyncio.wait_for(first_event(), timeout=60))
    assert event["outcome"] == "success" and event["checkpoint_id"] == "step_00000010", event


def test_with_a_cluster_name_the_kubeconfig_comes_from_eks_and_the_aws_connection(aws, tmp_path):
    """Airflow outside the cluster: EksHook builds the kubeconfig from DescribeCluster (endpoint,
    CA) with a token from the AWS connection's credentials, and removes it afterwards."""
    import boto3
    import yaml

    role = boto3.client("iam").create_role(RoleName="eks-cluster", AssumeRolePolicyDocument="{}")["Role"]["Arn"]
    cluster = boto3.client("eks").create_cluster(
        name="training", roleArn=role, resourcesVpcConfig={"subnetIds": ["subnet-1"]}
    )["cluster"]
    backend = backend_for(tmp_path, cluster_name="training")
    assert get_backend(**backend.to_config()).cluster_name == "training"
    with backend._kubeconfig() as path:
        config = yaml.safe_load(Path(path).read_text())
    assert not Path(path).exists()  # it held a credential: gone once used
    (server,) = [c["cluster"]["server"] for c in config["clusters"]]
    assert server == boto3.client("eks").describe_cluster(name="training")["cluster"]["endpoint"]
    assert cluster["name"] == "training"
    assert config["contexts"][0]["context"]["namespace"] == NS
    assert "exec" in config["users"][0]["user"]  # a short-lived token, refreshed per request


def test_the_capacity_trigger_waits_for_a_replacement_node_and_gives_up_with_what_it_saw(cluster, tmp_path):
    from airflow.sdk.exceptions import AirflowFailException

    from fsdp_resilience.control.sensors.node_capacity import NodeCapacitySensor
    from fsdp_resilience.control.task_data import Run
    from fsdp_resilience.control.triggers.node_capacity import NodeCapacityTrigger

    add_gpu_node(cluster, "gpu-0")
    add_gpu_node(cluster, "gpu-1", ready=False)
    backend = backend_for(tmp_path)

    async def first_event(trigger):
        async for event in trigger.run():
            return event.payload

    def trigger(timeout_s):
        return NodeCapacityTrigger(
            backend=backend.to_config(), nodes=2, timeout_s=timeout_s, started_at=time.time(), poll_interval_s=0.05
        )

    gave_up = asyncio.run(first_event(trigger(0.2)))
    assert gave_up["status"] == "timeout" and gave_up["capacity"]["healthy"] == 1
    sensor = NodeCapacitySensor(
        task_id="wait_for_capacity",
        run=Run(config={"nodes": 2}, backend=backend.to_config(), max_node_replacements=0),
        timeout_s=0.2,
    )
    with pytest.raises(AirflowFailException, match="not enough healthy nodes for 2"):
        sensor.execute_complete({}, gave_up)

    waiting = trigger(60)
    assert NodeCapacityTrigger(**waiting.serialize()[1]).serialize() == waiting.serialize()
    threading.Timer(0.3, lambda: cluster.set_node_condition("gpu-1", "Ready", "True", "KubeletReady")).start()
    ready = asyncio.run(asyncio.wait_for(first_event(waiting), timeout=30))
    assert ready["status"] == "success" and ready["capacity"]["healthy"] == 2


# --------------------------------------------------------------------------------------------
# Names, retried submits, API errors, images (issue 12)
# --------------------------------------------------------------------------------------------


def test_a_run_id_starting_with_a_digit_launches(cluster, tmp_path):
    for i in range(2):
        add_gpu_node(cluster, f"gpu-{i}")
    backend = backend_for(tmp_path)
    handle = backend.submit(run_config(tmp_path, run_id="7b-llama"), "0")
    assert handle.job_name.startswith("r-7b-llama-0-")
    running_pods(cluster, handle.job_name, 2)
    # The Service (a DNS-1035 name) was accepted, and so the rendezvous host resolves.
    assert launch_objects(cluster, tmp_path) == {
        "jobs": [handle.job_name],
        "services": [handle.job_name],
        "networkpolicies": [handle.job_name],
    }
    assert backend.status(handle).state == "running"


def test_a_submit_that_fails_in_the_middle_is_finished_by_a_retry(cluster, tmp_path, monkeypatch):
    """The Service is refused once (here: a name the apiserver rejects); the Job stays suspended,
    no pod runs without its Service, and the retried task finishes the launch: one Job, its
    Service, its NetworkPolicy, running."""
    import fsdp_resilience.control.backends.eks.backend as eks_backend

    for i in range(2):
        add_gpu_node(cluster, f"gpu-{i}")
    backend = backend_for(tmp_path)
    cfg = run_config(tmp_path)
    real_service = eks_backend.rendezvous_service

    def refused_once(*args, **kwargs):
        service = real_service(*args, **kwargs)
        service["metadata"]["name"] += "_"  # not a DNS label: the apiserver says 422
        return service

    monkeypatch.setattr(eks_backend, "rendezvous_service", refused_once)
    with pytest.raises(
        BackendError,
        match=r"rejected the request to create service .* invalid \(422\).*"
        r"stays suspended.*retrying the launch task",
    ):
        backend.submit(cfg, "0")
    monkeypatch.setattr(eks_backend, "rendezvous_service", real_service)
    assert launch_objects(cluster, tmp_path)["services"] == []
    (name,) = launch_objects(cluster, tmp_path)["jobs"]
    job = cluster.job(NS, name)
    assert job["spec"]["suspend"] is True and cluster.pods(NS) == []  # nothing runs without its Service
    handle = backend._handle(cfg, "0", job)
    status = backend.status(handle)
    assert status.state == "pending" and "suspended" in status.message, status.message

    again = backend.submit(cfg, "0")  # the retried task
    assert again.job_name == job["metadata"]["name"]
    assert launch_objects(cluster, tmp_path) == {"jobs": [name], "services": [name], "networkpolicies": [name]}
    assert len([r for r in cluster.requests if r.resource == "jobs" and r.verb == "create"]) == 1
    assert cluster.job(NS, again.job_name)["spec"]["suspend"] is False
    running_pods(cluster, again.job_name, 2)
    assert backend.status(again).state == "running"


def test_a_retry_after_a_try_that_died_after_creating_the_job_finishes_it(cluster, tmp_path):
    """A first try created the (suspended) Job and died: the retry creates the Service and the
    NetworkPolicy and resumes the Job."""
    from kubernetes import client

    from fsdp_resilience.control.backends.eks import training_job

    for i in range(2):
        add_gpu_node(cluster, f"gpu-{i}")
    backend = backend_for(tmp_path)
    cfg = run_config(tmp_path)
    body = training_job(cfg, "0", backend.settings)
    client.BatchV1Api(api_client(cluster, tmp_path)).create_namespaced_job(NS, body)
    name = body["metadata"]["name"]
    assert cluster.pods(NS, name) == []
    handle = backend.submit(cfg, "0")
    assert handle.job_name == name
    running_pods(cluster, name, 2)
    assert launch_objects(cluster, tmp_path) == {"jobs": [name], "services": [name], "networkpolicies": [name]}
    assert backend.status(handle).state == "running"


def test_a_cancelled_job_is_never_resumed_by_a_retried_submit(cluster, tmp_path):
    for i in range(2):
        add_gpu_node(cluster, f"gpu-{i}")
    backend = backend_for(tmp_path)
    cfg = run_config(tmp_path)
    handle = backend.submit(cfg, "0")
    running_pods(cluster, handle.job_name, 2)
    backend.cancel(handle)
    wait_for(
        lambda: not [p for p in cluster.pods(NS, handle.job_name) if p["status"]["phase"] == "Running"],
        what="the cancelled job's pods to stop",
    )
    backend.submit(cfg, "0")  # a late retry of the launch task
    job = cluster.job(NS, handle.job_name)
    assert job["spec"]["suspend"] is True and CANCEL_ANNOTATION in job["metadata"]["annotations"]
    assert backend.status(handle).state == "failed"


def test_an_image_outside_the_allowlist_is_refused_at_submit(cluster, tmp_path):
    add_gpu_node(cluster, "gpu-0")
    backend = backend_for(tmp_path, image_allowlist=["123456789012.dkr.ecr.us-west-2.amazonaws.com/fsdp-training"])
    with pytest.raises(BackendError, match="not under the image allowlist.*FSDP_EKS_IMAGE_ALLOWLIST"):
        backend.submit(run_config(tmp_path, nodes=1), "0")
    assert not [r for r in cluster.requests if r.verb == "create"]
    assert get_backend(**backend.to_config()).image_allowlist == backend.image_allowlist
    allowed = backend_for(tmp_path, image_allowlist=["example.com/fsdp-training"])
    assert allowed.submit(run_config(tmp_path, nodes=1), "0").job_name


def test_an_unreachable_cluster_is_a_backend_error_that_says_so(kube, tmp_path, monkeypatch):
    import socket

    import yaml

    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = kube.kubeconfig(tmp_path / "gone-kubeconfig")
    config = yaml.safe_load(path.read_text())
    config["clusters"][0]["cluster"]["server"] = f"https://127.0.0.1:{port}"
    path.write_text(yaml.safe_dump(config))
    monkeypatch.setenv("AIRFLOW_CONN_KUBERNETES_GONE", kube.airflow_connection(path))
    backend = backend_for(tmp_path, kubernetes_conn_id="kubernetes_gone")
    with pytest.raises(BackendError, match="cannot reach the Kubernetes API.*FSDP_KUBERNETES_CONN_ID"):
        backend.capacity()


def test_a_node_without_registered_gpus_is_not_healthy_capacity(cluster, tmp_path):
    add_gpu_node(cluster, "gpu-0")
    # Joined and Ready, but its device plugin has not registered the GPUs (or the EFA devices) yet.
    cluster.add_node(
        "gpu-1",
        labels={"fsdp-resilience/pool": "gpu", "node.kubernetes.io/instance-type": "p5.48xlarge"},
        allocatable={"nvidia.com/gpu": 0, "vpc.amazonaws.com/efa": 32},
    )
    cluster.add_node(
        "gpu-2",
        labels={"fsdp-resilience/pool": "gpu", "node.kubernetes.io/instance-type": "p5.48xlarge"},
        allocatable={"nvidia.com/gpu": 8},
    )
    capacity = backend_for(tmp_path).capacity()
    assert capacity.total == 3 and capacity.healthy_node_ids == ["gpu-0"]


def test_disrupted_pods_are_replaced_within_a_bound_then_the_launch_fails_replaceably(cluster, tmp_path):
    """Evictions and lost nodes do not fail a launch at once (the Job replaces the pod and the
    restart layers take it back), but not for ever: past backoff_limit + max_pod_disruptions
    the Job fails and the launch reports restarts_exhausted, which the ladder climbs."""
    for i in range(4):
        add_gpu_node(cluster, f"gpu-{i}")
    backend = backend_for(tmp_path, pod={"backoff_limit": 0, "max_pod_disruptions": 1})
    handle = backend.submit(run_config(tmp_path, nodes=1), "0")
    first = running_pods(cluster, handle.job_name, 1)[0]["spec"]["nodeName"]
    cluster.remove_node(first)  # lost with its node (PodGC fails its pod): replaced on another node
    second = wait_for(
        lambda: [p for p in cluster.pods(NS, handle.job_name) if live(p) and p["status"]["phase"] == "Running"],
        timeout=90,
        what="the replacement pod",
    )[0]["spec"]["nodeName"]
    assert second != first and backend.status(handle).state == "running"
    cluster.remove_node(second)  # the second disruption is one more than the bound
    job_failed(cluster, handle.job_name)
    status = status_when(backend, handle, "failed")
    assert status.failure_class == "restarts_exhausted", status.message
    assert "disrupted" in status.message and "BackoffLimitExceeded" in status.message


def test_a_taint_added_between_the_read_and_the_patch_survives_the_quarantine(cluster, tmp_path, monkeypatch):
    """Another controller taints the node right after the backend read it: the
    backend's patch (the whole taint list, with the resourceVersion it read) gets 409, and the
    backend reads the node again and keeps that taint."""
    from fsdp_resilience.control.backends.eks.client import KubeClient

    for i in range(5):
        add_gpu_node(cluster, f"gpu-{i}")
    # Karpenter's taint (the node lifecycle controller would take an unreachable taint off a
    # node kwok keeps Ready): the second writer patches right after the backend read the pool.
    disrupted = {"key": "karpenter.sh/disrupted", "effect": "NoSchedule"}
    real_list_nodes = KubeClient.list_nodes
    read = []

    def list_then_taint(self, *args, **kwargs):
        nodes = real_list_nodes(self, *args, **kwargs)
        if not read:
            read.append(cluster.add_node_taint("gpu-2", disrupted))
        return nodes

    monkeypatch.setattr(KubeClient, "list_nodes", list_then_taint)
    replacement = backend_for(tmp_path, replacement="cordon").replace_nodes(["gpu-2"], reason="rung 1: lost")
    assert replacement.replaced == ["gpu-2"], replacement.reason
    keys = [t["key"] for t in cluster.node("gpu-2")["spec"]["taints"]]
    # Beside them, only the node lifecycle controller's own (node.kubernetes.io/unschedulable for
    # the cordon, not-ready while it catches up with a new node), which it writes as it likes.
    assert {"nvidia.com/gpu", "karpenter.sh/disrupted", QUARANTINE_TAINT} <= set(keys), keys
    assert all(
        k.startswith("node.kubernetes.io/")
        for k in set(keys) - {"nvidia.com/gpu", "karpenter.sh/disrupted", QUARANTINE_TAINT}
    ), keys
    node_patches = [r for r in cluster.requests if r.resource == "nodes" and r.verb == "patch"]
    # The conflict, then the patch on a fresh read (another 409 if a controller wrote meanwhile).
    codes = [r.code for r in node_patches]
    assert codes[0] == 409 and codes[-1] == 200 and set(codes[:-1]) == {409}, codes
    assert cluster.node("gpu-2")["spec"]["unschedulable"] is True


def test_a_missing_grant_is_a_backend_error_naming_the_identity_and_the_grant(cluster, tmp_path, monkeypatch):
    """The triggerer's identity is read-only: a submit with its token is refused (403), and the
    error names who lacks what and where the grants are."""
    for i in range(2):
        add_gpu_node(cluster, f"gpu-{i}")
    triggerer = cluster.kubeconfig(tmp_path / "triggerer", namespace=NS, user=TRIGGERER)
    monkeypatch.setenv("AIRFLOW_CONN_KUBERNETES_TRIGGERER", cluster.airflow_connection(triggerer))
    backend = backend_for(tmp_path, kubernetes_conn_id="kubernetes_triggerer")
    with pytest.raises(
        BackendError,
        match=r"forbidden to (list|create) jobs? .*identity system:serviceaccount:"
        r"airflow:airflow-triggerer lacks the grant '(list|create)' on jobs "
        r"\(API group batch\) in namespace fsdp-training.*deploy/base/rbac.yaml",
    ):
        backend.submit(run_config(tmp_path), "0")
    assert backend.capacity().total == 2  # what its triggers read, it may


def test_a_launch_on_the_kit_as_the_worker_passes_rbac_admission_and_pod_security(cluster, tmp_path):
    """With the rendered deploy kit loaded (RBAC, Pod Security labels, the kit's admission
    policies, the ServiceAccount, PVC and PriorityClass the pods name), the worker launches a run
    whose id starts with a digit, its pods (EFA, Pod Security restricted) are admitted and run, and a bad node
    of the GPU pool is cordoned and tainted."""
    for i in range(3):
        add_gpu_node(cluster, f"gpu-{i}")
    backend = backend_for(tmp_path, replacement="cordon")
    handle = backend.submit(run_config(tmp_path, run_id="7b-llama"), "0")
    pods = running_pods(cluster, handle.job_name, 2)
    assert backend.status(handle).state == "running"
    bad = pods[0]["spec"]["nodeName"]
    replacement = backend.replace_nodes([bad], reason="rung 1: restarts_exhausted")
    assert replacement.replaced == [bad], replacement.reason
    assert cluster.node(bad)["spec"]["unschedulable"] is True
    # Every request of the Airflow identities was allowed and admitted (a 404 is a read of what
    # is not there yet, a 409 a patch that goes again on a fresh read).
    refused = [
        r for r in cluster.requests if r.user.startswith("system:serviceaccount:airflow:") and r.code in (401, 403, 422)
    ]
    assert not refused, refused


def test_the_pods_pass_pod_security_restricted_and_one_adding_ipc_lock_is_refused(cluster, tmp_path):
    """In a namespace that enforces Pod Security "restricted" (as the kit's does), the backend's EFA
    pods are admitted and run; the same Job with IPC_LOCK added (what efa_ipc_lock used to add) is
    refused by the apiserver (the Job controller says so in its events)."""
    cluster.add_namespace(NS, labels={"pod-security.kubernetes.io/enforce": "restricted"})
    for i in range(4):
        add_gpu_node(cluster, f"gpu-{i}")
    backend = backend_for(tmp_path)
    handle = backend.submit(run_config(tmp_path, run_id="restricted", nodes=1), "0")
    running_pods(cluster, handle.job_name, 1)
    job = backend.check_launch(run_config(tmp_path, run_id="ipc-lock", nodes=1), "0")
    job["spec"]["suspend"] = False
    job["spec"]["template"]["spec"]["containers"][0]["securityContext"]["capabilities"]["add"] = ["IPC_LOCK"]
    cluster.api("POST", f"/apis/batch/v1/namespaces/{NS}/jobs", job)
    event = wait_for(
        lambda: [e for e in cluster.events(NS, job["metadata"]["name"]) if e["reason"] == "FailedCreate"],
        what="the Job controller's FailedCreate event",
    )[0]
    assert "violates PodSecurity" in event["message"] and "IPC_LOCK" in event["message"], event["message"]
    assert cluster.pods(NS, job["metadata"]["name"]) == []


def test_a_cluster_without_the_kits_service_account_or_claim_is_refused_before_any_job(cluster, tmp_path):
    """The pods name a ServiceAccount and the FSx claim: without them the Job controller would
    retry pod creation forever (or the pods stay Pending) until the stall timeout, so submit checks
    them first and says what to apply."""
    for i in range(2):
        add_gpu_node(cluster, f"gpu-{i}")
    cfg = run_config(tmp_path)
    for pod in ({"fsx_claim": "fsx-elsewhere"}, {"service_account": "someone-else"}):
        backend = backend_for(tmp_path, pod=pod)
        with pytest.raises(BackendError, match="apply the deploy kit") as refused:
            backend.submit(cfg, "0")
        assert next(iter(pod.values())) in str(refused.value)
        assert launch_objects(cluster, tmp_path) == {"jobs": [], "services": [], "networkpolicies": []}
    assert backend_for(tmp_path).submit(cfg, "0").job_name  # with the kit's names it launches


# --------------------------------------------------------------------------------------------
# Hot spares (cfg.spare_nodes): pods beyond cfg.nodes wait in the rendezvous
# --------------------------------------------------------------------------------------------


def test_a_lost_node_behind_a_spare_keeps_the_job_running_and_its_pod_comes_back_as_the_new_spare(cluster, tmp_path):
    """nodes=2 + 1 spare: three pods, one per node. The node of index 1 stops reporting: its pod
    is deleted by the taint eviction controller and stays Terminating, the job stays running with
    node 1 lost (a spare covers it), and add_spare says the Job has not recreated the pod yet. Once
    the node object goes (PodGC fails the pod), the Job controller recreates index 1 on the one
    free node; add_spare returns it, without the backend creating any pod."""
    for i in range(4):
        add_gpu_node(cluster, f"gpu-{i}")
    backend = backend_for(tmp_path)
    handle = backend.submit(spare_run(tmp_path), "0")
    job = cluster.job(NS, handle.job_name)
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 3
    pods = running_by_index(cluster, handle.job_name)
    assert sorted(pods) == [0, 1, 2] and len({p["spec"]["nodeName"] for p in pods.values()}) == 3
    status = backend.status(handle)
    assert status.state == "running" and [n.state for n in status.nodes] == ["running"] * 3
    with pytest.raises(BackendError, match="lost no node"):
        backend.add_spare(handle, "refill")

    lost_node = pods[1]["spec"]["nodeName"]
    cluster.lose_node(lost_node)
    status = backend.status(handle)
    assert status.state == "running", status.message
    assert [n.state for n in status.nodes] == ["running", "lost", "running"]
    assert status.nodes[1].node_id == lost_node and "a spare covers it" in status.nodes[1].message
    assert "DeletionByTaintManager" in status.nodes[1].message
    assert asyncio.run(backend.status_async(handle)).nodes[1].state == "lost"
    # The pod is replaced only once it is terminal, which needs the node object deleted: first
    # the node must be taken out of service, and under replacement=cordon a human deletes it.
    with pytest.raises(BackendError, match="still in service: take it out with replace_nodes"):
        backend.add_spare(handle, "refill")
    cordon = backend_for(tmp_path, replacement="cordon")
    assert cordon.replace_nodes([lost_node], reason="spare maintenance: node lost").replaced == [lost_node]
    with pytest.raises(BackendError, match=f"kubectl delete node {lost_node}"):
        cordon.add_spare(handle, "refill")
    # With its instance being replaced (asg, karpenter), the recreation is under way: pending.
    coming = backend_for(tmp_path, replacement="karpenter").add_spare(handle, "refill")
    assert (coming.index, coming.state, coming.node_id) == (1, "pending", None)
    assert "PodGC fails the pod" in coming.message

    next_second()  # the replacement is made later than the launch's pods (whole seconds)
    cluster.remove_node(lost_node)  # the node object goes (its instance was replaced): PodGC
    running_by_index(cluster, handle.job_name)  # after the Job controller's backoff
    status = backend.status(handle)
    assert status.state == "running" and [n.state for n in status.nodes] == ["running"] * 3, status.message
    spare = backend.add_spare(handle, "refill after spare_promoted")
    (free,) = {f"gpu-{i}" for i in range(4)} - {lost_node} - {pods[0]["spec"]["nodeName"], pods[2]["spec"]["nodeName"]}
    assert (spare.index, spare.state, spare.node_id) == (1, "running", free)
    assert spare.message.startswith("refill after spare_promoted: ") and "the Job recreated it" in spare.message
    failed_count(cluster, handle.job_name, 1)  # one disruption of the budget
    # Least privilege: the Job controller made the pod; the backend created and deleted none
    # (replace_nodes' eviction is the pods/eviction subresource the kit grants).
    assert not [
        r
        for r in cluster.requests
        if r.resource == "pods"
        and not r.subresource
        and r.verb in ("create", "delete")
        and r.user.startswith("system:serviceaccount:airflow")
    ]


def test_a_spare_replacement_with_no_node_to_run_on_is_lost_until_capacity_joins(cluster, tmp_path):
    """Three nodes for 2 + 1 spare: the lost pod's replacement cannot be scheduled (anti-affinity,
    no free node). The node stays lost (the spare covers it) and add_spare says capacity is
    missing; a new node joins and the replacement runs there as the new spare."""
    for i in range(3):
        add_gpu_node(cluster, f"gpu-{i}")
    backend = backend_for(tmp_path)
    handle = backend.submit(spare_run(tmp_path), "0")
    lost_node = running_by_index(cluster, handle.job_name)[1]["spec"]["nodeName"]
    next_second()
    cluster.remove_node(lost_node)
    # The Job recreates index 1 (after its backoff) and the scheduler finds no node for it.
    status = wait_for(
        lambda: "cannot be scheduled" in (s := backend.status(handle)).nodes[1].message and s,
        timeout=120,
        what="the recreated pod unschedulable",
    )
    assert status.state == "running" and status.nodes[1].state == "lost", status.message
    with pytest.raises(InsufficientCapacityError, match="no node to run on"):
        backend.add_spare(handle, "refill")
    # Under Karpenter an unschedulable pod is what brings a node: the replacement is pending.
    karpenter = backend_for(tmp_path, replacement="karpenter")
    assert karpenter.status(handle).nodes[1].state == "pending"
    assert (karpenter.add_spare(handle, "refill").index, karpenter.add_spare(handle, "refill").state) == (1, "pending")
    add_gpu_node(cluster, "gpu-new-0")
    running_by_index(cluster, handle.job_name)  # the scheduler binds it once the node joined
    spare = backend.add_spare(handle, "refill")
    assert (spare.index, spare.state, spare.node_id) == (1, "running", "gpu-new-0")


def test_two_nodes_lost_behind_one_spare_fail_the_launch_and_blame_both(cluster, tmp_path):
    for i in range(4):  # one node stays healthy: the zone is not fully disrupted, so pods are evicted
        add_gpu_node(cluster, f"gpu-{i}")
    backend = backend_for(tmp_path)
    handle = backend.submit(spare_run(tmp_path), "0")
    pods = running_by_index(cluster, handle.job_name)
    lost = sorted(pods[i]["spec"]["nodeName"] for i in (0, 2))
    for name in lost:
        cluster.lose_node(name)
    status = status_when(backend, handle, "failed")
    assert status.failure_class == "restarts_exhausted", status.message
    assert "too few nodes left to train: 1 of the 2 needed" in status.message
    assert [n.state for n in status.nodes] == ["lost", "running", "lost"]
    with pytest.raises(BackendError, match="it is failed"):
        backend.add_spare(handle, "refill")
    # What the ladder does next: stop what is left of the launch, then diagnose.
    backend.cancel(handle)
    diagnosis = backend.diagnose(handle)
    assert diagnosis.replaceable and diagnosis.bad_node_ids == lost, diagnosis.evidence


def test_losing_node_0_fails_the_launch_even_with_a_spare_left(cluster, tmp_path):
    """Node 0 hosts the rendezvous store every node meets at: a spare cannot take its place, so
    the ladder climbs as without spares."""
    for i in range(4):
        add_gpu_node(cluster, f"gpu-{i}")
    backend = backend_for(tmp_path)
    handle = backend.submit(spare_run(tmp_path), "0")
    cluster.lose_node(running_by_index(cluster, handle.job_name)[0]["spec"]["nodeName"])
    status = status_when(backend, handle, "failed")
    assert status.failure_class == "restarts_exhausted", status.message
    assert "rendezvous store" in status.message and "too few" not in status.message


def test_replacing_a_node_that_hosts_a_parked_spare_moves_the_spare_off_it(cluster, tmp_path):
    """A spare must never be admitted from a quarantined node: replace_nodes evicts the spare's
    pod, the Job recreates it for the same index, and the cordon and quarantine taint keep the new
    pod off that node."""
    for i in range(5):
        add_gpu_node(cluster, f"gpu-{i}")
    backend = backend_for(tmp_path, replacement="cordon")
    handle = backend.submit(spare_run(tmp_path), "0")
    spare_pod = running_by_index(cluster, handle.job_name)[2]
    spare_name, bad = spare_pod["metadata"]["name"], spare_pod["spec"]["nodeName"]
    next_second()
    replacement = backend.replace_nodes([bad], reason="spare maintenance: health check failed")
    assert replacement.replaced == [bad] and spare_name in replacement.reason, replacement.reason
    # Evicted: deleted (with a DisruptionTarget condition the Job counted), not left on the node.
    wait_for(lambda: spare_name not in {p["metadata"]["name"] for p in cluster.pods(NS)}, what="the spare gone")
    pods = wait_for(
        lambda: (p := running_by_index(cluster, handle.job_name))[2]["metadata"]["name"] != spare_name and p,
        what="index 2 recreated",
    )
    assert sorted(pods) == [0, 1, 2] and pods[2]["spec"]["nodeName"] != bad
    assert not any(p["spec"].get("nodeName") == bad for p in cluster.pods(NS))
    assert backend.status(handle).state == "running"
    failed_count(cluster, handle.job_name, 1)
    assert backend.add_spare(handle, "refill").index == 2


# --------------------------------------------------------------------------------------------
# What the real Job controller does with a launch's pods (issue 26's defects, shown here first)
# --------------------------------------------------------------------------------------------


@pytest.mark.every_kube_version
def test_a_launch_with_spares_succeeds_when_its_training_nodes_do_while_the_spare_still_runs(cluster, tmp_path):
    """nodes=2 + 1 spare: an Indexed Job of 3 completions whose spare index never succeeds by
    itself. Its successPolicy (succeededCount: 2, which the apiserver keeps) has the real Job
    controller meet the Job's success criteria once the two training nodes exit 0, with the spare
    still parked; the backend reads succeeded, and the Job controller ends the spare's pod."""
    for i in range(3):
        add_gpu_node(cluster, f"gpu-{i}")
    backend = backend_for(tmp_path)
    handle = backend.submit(spare_run(tmp_path), "0")
    pods = running_by_index(cluster, handle.job_name)
    cluster.clear_requests()
    cluster.terminate_pod(NS, pods[0]["metadata"]["name"], 0)
    assert live(cluster.pod(NS, pods[2]["metadata"]["name"]))  # the spare is parked as node 1 ends
    cluster.terminate_pod(NS, pods[1]["metadata"]["name"], 0)
    status = status_when(backend, handle, "succeeded", timeout=60)
    assert status.failure_class == "success" and "2 training node(s)" in status.message, status.message
    job = cluster.job(NS, handle.job_name)
    assert job["spec"]["successPolicy"] == {"rules": [{"succeededCount": 2}]}
    assert "SuccessCriteriaMet" in true_conditions(job), job["status"]
    wait_for(lambda: "Complete" in true_conditions(cluster.job(NS, handle.job_name)), what="the Job Complete")
    assert not [p for p in cluster.pods(NS, handle.job_name) if live(p)]  # the spare's pod ended
    # The Job controller ended it: the backend's own rule (suspend the Job) was not needed.
    assert not [r for r in cluster.requests if r.resource == "jobs" and r.verb == "patch"]
    assert backend.status(handle).state == "succeeded"


@pytest.mark.every_kube_version
def test_a_pod_the_job_recreates_keeps_the_hostname_and_gets_a_new_uid_in_its_environment(cluster, tmp_path):
    """The launch lock cannot tell a recreated pod from its predecessor by host name: the Job
    controller gives the pod it recreates for an index the same <job>-<index>. Each has its own
    metadata.uid, which the training container reads from the downward API (TRAINING_POD_UID),
    and the Job's UID (TRAINING_LAUNCH_UID, from the label the Job controller sets)."""
    from fsdp_resilience.control.backends.eks.constants import CONTAINER, JOB_UID_LABEL, LAUNCH_UID_ENV, POD_UID_ENV

    for i in range(2):
        add_gpu_node(cluster, f"gpu-{i}")
    backend = backend_for(tmp_path)
    handle = backend.submit(run_config(tmp_path), "0")
    first = running_pods(cluster, handle.job_name, 2)[1]
    cluster.terminate_pod(NS, first["metadata"]["name"], 1)  # unknown: retried within backoffLimit
    second = wait_for(
        lambda: [
            p
            for p in cluster.pods(NS, handle.job_name)
            if index_of(p) == 1
            and live(p)
            and p["status"]["phase"] == "Running"
            and p["metadata"]["uid"] != first["metadata"]["uid"]
        ],
        timeout=120,
        what="the Job controller to recreate index 1",
    )[0]
    job = cluster.job(NS, handle.job_name)
    assert second["metadata"]["uid"] != first["metadata"]["uid"]
    for pod in (first, second):
        assert (pod["spec"]["hostname"], pod["spec"]["subdomain"]) == (f"{handle.job_name}-1", handle.job_name)
        (container,) = [c for c in pod["spec"]["containers"] if c["name"] == CONTAINER]
        env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in container["env"]}
        assert env.get(POD_UID_ENV) == "metadata.uid", env
        assert env.get(LAUNCH_UID_ENV) == f"metadata.labels['{JOB_UID_LABEL}']", env
        assert pod["metadata"]["labels"][JOB_UID_LABEL] == job["metadata"]["uid"]  # what it resolves to


@pytest.mark.every_kube_version
def test_a_pod_that_exits_launch_ended_is_ignored_by_the_backoff_limit_and_its_index_recreated(cluster, tmp_path):
    """A pod the Job recreates after its launch ended exits launch_ended (69) at once. The Job's
    podFailurePolicy ignores it: with backoffLimit 0, where any counted failure fails the Job, the
    real Job controller counts nothing and recreates the index."""
    for i in range(4):
        add_gpu_node(cluster, f"gpu-{i}")
    backend = backend_for(tmp_path, pod={"backoff_limit": 0, "max_pod_disruptions": 0})
    handle = backend.submit(spare_run(tmp_path), "0")
    assert cluster.job(NS, handle.job_name)["spec"]["backoffLimit"] == 0
    spare = running_by_index(cluster, handle.job_name)[2]["metadata"]["name"]
    cluster.terminate_pod(NS, spare, int(ExitCode.LAUNCH_ENDED))

    def recreated_or_failed():
        job = cluster.job(NS, handle.job_name)
        if true_conditions(job) & {"Failed", "FailureTarget"}:
            return job
        pod = pods_by_index(cluster, handle.job_name).get(2)
        return pod and pod["metadata"]["name"] != spare and pod["status"]["phase"] == "Running" and job

    job = wait_for(recreated_or_failed, timeout=120, what="index 2 recreated or the Job failed")
    assert not true_conditions(job) & {"Failed", "FailureTarget"}, job["status"]
    assert not job["status"].get("failed"), job["status"]  # not counted against backoffLimit
    assert backend.status(handle).state == "running"
