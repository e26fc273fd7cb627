"""The fake apiserver (fake_kube.py) behaves like the real one for what the EKS backend does, as seen
through the real `kubernetes` client and through `kubernetes_asyncio` (the provider's async hook)."""

from __future__ import annotations

import asyncio
import json
import time

import kubernetes
import pytest
from conftest import MEASURED
from fake_kube import FakeKube, Request, fake_kube, schema_problems  # noqa: F401  (fixture)
from kubernetes.client.exceptions import ApiException

NS = "training"
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"}


def training_job(name: str, completions: int = 2, *, gpus: int = 8, backoff_limit: int = 0) -> dict:
    """An Indexed job shaped like the EKS backend's: one pod per node, FailJob on 75, Ignore disruptions."""
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": name, "labels": {"app": "fsdp"}},
        "spec": {
            "completionMode": "Indexed", "completions": completions, "parallelism": completions,
            "backoffLimit": backoff_limit,
            "podFailurePolicy": {"rules": [
                {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
                {"action": "FailJob",
                 "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [75, 78]}},
            ]},
            "template": {
                "metadata": {"labels": {"app": "fsdp", "run": name}},
                "spec": {
                    "restartPolicy": "Never", "subdomain": name,
                    "nodeSelector": {"node-type": "gpu"},
                    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                    "affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
                        {"labelSelector": {"matchLabels": {"batch.kubernetes.io/job-name": name}},
                         "topologyKey": "kubernetes.io/hostname"}]}},
                    "containers": [{"name": "trainer", "image": "trainer:1",
                                    "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}],
                },
            },
        },
    }


def add_gpu_node(kube: FakeKube, name: str, **kwargs) -> None:
    kube.add_node(name, labels={"node-type": "gpu"}, taints=[GPU_TAINT],
                  allocatable={"nvidia.com/gpu": "8", "vpc.amazonaws.com/efa": "4"}, **kwargs)


@pytest.fixture
def kube(fake_kube):
    yield fake_kube
    assert fake_kube.errors == []  # the fake itself never crashed on a request
    for res, schema in (("pods", "pod-v1.json"), ("jobs", "job-batch-v1.json"), ("nodes", "node-v1.json"),
                        ("events", "event-v1.json")):  # what the fake makes is valid 1.33 API too
        for obj in [o for (r, _), o in _stored(fake_kube) if r == res]:
            assert schema_problems(obj, schema) == [], (res, obj["metadata"]["name"])


def _stored(kube: FakeKube):
    return [((res.plural, key), obj) for res, objs in kube._store.items() for key, obj in objs.items()]


@pytest.fixture
def api(kube):
    client = kubernetes.client.ApiClient(kubernetes.client.Configuration(host=kube.url))
    yield client
    client.close()


def error(exc: pytest.ExceptionInfo) -> dict:
    return json.loads(exc.value.body)


def test_indexed_job_pods_land_one_per_matching_node(kube, api):
    add_gpu_node(kube, "gpu-a")
    add_gpu_node(kube, "gpu-b")
    kube.add_node("cpu-a", labels={"node-type": "cpu"})                       # selector mismatch
    add_gpu_node(kube, "gpu-cordoned", unschedulable=True)                    # cordoned
    add_gpu_node(kube, "gpu-sick", ready=False)                               # NotReady
    kube.add_node("gpu-other", labels={"node-type": "gpu"}, allocatable={"nvidia.com/gpu": "8"},
                  taints=[{"key": "dedicated", "value": "other", "effect": "NoSchedule"}])  # untolerated taint
    batch, core = kubernetes.client.BatchV1Api(api), kubernetes.client.CoreV1Api(api)

    # 1 GPU per pod: only the anti-affinity keeps the three pods on three different nodes.
    job = batch.create_namespaced_job(NS, training_job("run-a", completions=3, gpus=1))
    assert job.spec.selector.match_labels == {"batch.kubernetes.io/controller-uid": job.metadata.uid}
    pods = {p.metadata.annotations["batch.kubernetes.io/job-completion-index"]: p
            for p in core.list_namespaced_pod(NS, label_selector="job-name=run-a").items}
    assert sorted(pods) == ["0", "1", "2"]
    for index, pod in pods.items():
        assert pod.metadata.name.startswith(f"run-a-{index}-") and len(pod.metadata.name) == len(f"run-a-{index}-") + 5
        assert pod.spec.hostname == f"run-a-{index}" and pod.spec.subdomain == "run-a"
        assert pod.metadata.labels["batch.kubernetes.io/job-completion-index"] == index
        assert pod.metadata.labels["controller-uid"] == job.metadata.uid == pod.metadata.owner_references[0].uid
        assert pod.metadata.owner_references[0].kind == "Job" and pod.metadata.owner_references[0].controller
        assert {e.name for e in pod.spec.containers[0].env} == {"JOB_COMPLETION_INDEX"}
    running = {p.spec.node_name for p in pods.values() if p.status.phase == "Running"}
    assert running == {"gpu-a", "gpu-b"}
    (pending,) = [p for p in pods.values() if p.status.phase == "Pending"]
    scheduled = next(c for c in pending.status.conditions if c.type == "PodScheduled")
    assert (scheduled.status, scheduled.reason) == ("False", "Unschedulable")
    assert scheduled.message.startswith("0/6 nodes are available: ")
    for reason in ("1 node(s) didn't match Pod's node affinity/selector",
                   "2 node(s) didn't match pod anti-affinity rules",
                   "untolerated taint {dedicated: other}", "untolerated taint {node.kubernetes.io/not-ready: }",
                   "1 node(s) were unschedulable"):
        assert reason in scheduled.message
    events = core.list_namespaced_event(NS, field_selector=f"involvedObject.name={pending.metadata.name},"
                                                           "involvedObject.kind=Pod").items
    assert [e.reason for e in events] == ["FailedScheduling"] and events[0].type == "Warning"
    status = batch.read_namespaced_job_status("run-a", NS).status
    assert (status.active, status.ready, status.failed) == (3, 2, None)

    # Uncordoning a node (the client's default strategic merge patch) lets the pending pod in.
    core.patch_node("gpu-cordoned", {"spec": {"unschedulable": None}})
    assert kube.pod(NS, pending.metadata.name)["spec"]["nodeName"] == "gpu-cordoned"
    assert batch.read_namespaced_job("run-a", NS).status.ready == 3

    # Extended resources are counted per node: 8 GPUs each, 1 used on each of the three nodes.
    greedy = batch.create_namespaced_job(NS, training_job("greedy", completions=1, gpus=8))
    (pod,) = kube.pods(NS, job_name="greedy")
    assert pod["status"]["phase"] == "Pending"
    assert "3 Insufficient nvidia.com/gpu" in pod["status"]["conditions"][0]["message"]
    add_gpu_node(kube, "gpu-new")  # a new Ready node picks the pending pod up
    assert kube.pods(NS, job_name="greedy")[0]["spec"]["nodeName"] == "gpu-new"
    assert greedy.metadata.name == "greedy"


def test_strict_validation_rejects_unknown_fields_and_accepts_valid_objects(kube, api):
    batch, core = kubernetes.client.BatchV1Api(api), kubernetes.client.CoreV1Api(api)
    bad = training_job("typo")
    bad["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(ApiException) as exc:
        batch.create_namespaced_job(NS, bad)
    status = error(exc)
    assert (exc.value.status, status["kind"], status["reason"], status["code"]) == (422, "Status", "Invalid", 422)
    assert 'unknown field "spec.template.spec.containers[0].imagePullPolicyy"' in status["message"]
    assert status["message"].startswith('Job.batch "typo" is invalid')

    wrong_type = training_job("typed")
    wrong_type["spec"]["completions"] = "two"
    with pytest.raises(ApiException) as exc:
        batch.create_namespaced_job(NS, wrong_type)
    assert exc.value.status == 422 and "spec.completions" in error(exc)["message"]

    restart_always = training_job("always")
    restart_always["spec"]["template"]["spec"]["restartPolicy"] = "Always"
    with pytest.raises(ApiException) as exc:
        batch.create_namespaced_job(NS, restart_always)
    assert exc.value.status == 422 and "restartPolicy" in error(exc)["message"]

    with pytest.raises(ApiException) as exc:
        batch.create_namespaced_job(NS, training_job("Bad_Name"))
    assert exc.value.status == 422 and "RFC 1123" in error(exc)["message"]

    started = time.perf_counter()
    assert batch.create_namespaced_job(NS, training_job("good")).metadata.name == "good"
    elapsed_ms = 1e3 * (time.perf_counter() - started)
    MEASURED.append(f"fake kube: strict create of a Job over HTTP (cached validator): {elapsed_ms:.1f} ms")
    with pytest.raises(ApiException) as exc:
        batch.create_namespaced_job(NS, training_job("good"))
    assert (exc.value.status, error(exc)["reason"], error(exc)["message"]) == (
        409, "AlreadyExists", 'jobs.batch "good" already exists')

    # Typed client objects serialize to valid bodies; generateName and server-set metadata are filled.
    service = core.create_namespaced_service(NS, kubernetes.client.V1Service(
        metadata=kubernetes.client.V1ObjectMeta(generate_name="rdzv-"),
        spec=kubernetes.client.V1ServiceSpec(cluster_ip="None", selector={"run": "good"},
                                             ports=[kubernetes.client.V1ServicePort(port=29500, name="c10d")])))
    assert service.metadata.name.startswith("rdzv-") and service.metadata.uid and service.metadata.namespace == NS
    assert service.spec.cluster_ip == "None" and service.spec.ports[0].protocol == "TCP"
    assert int(service.metadata.resource_version) > 0 and service.metadata.creation_timestamp.tzinfo is not None
    with pytest.raises(ApiException) as exc:
        core.read_namespaced_service("missing", NS)
    assert (exc.value.status, error(exc)["reason"], error(exc)["message"]) == (
        404, "NotFound", 'services "missing" not found')

    # A server-side dry run validates without storing.
    dry_pod = {"metadata": {"name": "dry"}, "spec": {"containers": [{"name": "c", "image": "i"}]}}
    dry = core.create_namespaced_pod(NS, dry_pod, dry_run="All")
    assert dry.metadata.uid and core.list_namespaced_pod(NS, field_selector="metadata.name=dry").items == []


def test_pod_failure_policy_fail_job_on_exit_75_deletes_the_other_pods(kube, api):
    for name in ("gpu-a", "gpu-b"):
        add_gpu_node(kube, name)
    batch = kubernetes.client.BatchV1Api(api)
    batch.create_namespaced_job(NS, training_job("run-b"))
    pod0, pod1 = sorted(kube.pods(NS, "run-b"), key=lambda p: p["spec"]["hostname"])
    kube.terminate_pod(NS, pod0["metadata"]["name"], 75, message="restarts exhausted")

    job = batch.read_namespaced_job_status("run-b", NS)
    failed = {c.type: c for c in job.status.conditions}
    expected = (f"Container trainer for pod {NS}/{pod0['metadata']['name']} failed with exit code 75 "
                "matching FailJob rule at index 0")
    for type_ in ("FailureTarget", "Failed"):
        condition = failed[type_]
        assert (condition.status, condition.reason, condition.message) == ("True", "PodFailurePolicy", expected)
    assert (job.status.active, job.status.failed) == (None, 2)
    (left,) = kubernetes.client.CoreV1Api(api).list_namespaced_pod(NS).items  # pod1 was terminated and deleted
    assert left.metadata.name == pod0["metadata"]["name"] and left.status.phase == "Failed"
    terminated = left.status.container_statuses[0].state.terminated
    assert (terminated.exit_code, terminated.reason, terminated.message) == (75, "Error", "restarts exhausted")
    assert not any(p["metadata"]["name"] == pod1["metadata"]["name"] for p in kube.pods(NS))


def test_disruptions_are_ignored_and_replaced_while_other_failures_count_to_backoff(kube, api):
    for name in ("gpu-a", "gpu-b", "gpu-c", "gpu-d"):
        add_gpu_node(kube, name)
    batch, core = kubernetes.client.BatchV1Api(api), kubernetes.client.CoreV1Api(api)
    batch.create_namespaced_job(NS, training_job("run-c", backoff_limit=1))

    def by_index():
        return {p["spec"]["hostname"]: p for p in kube.pods(NS, "run-c") if p["status"]["phase"] == "Running"}

    # Eviction (Ignore on DisruptionTarget): the pod goes, a new pod for index 1 comes, nothing counted.
    evicted = by_index()["run-c-1"]["metadata"]["name"]
    core.create_namespaced_pod_eviction(evicted, NS, kubernetes.client.V1Eviction(
        metadata=kubernetes.client.V1ObjectMeta(name=evicted, namespace=NS)))
    with pytest.raises(ApiException) as exc:
        core.read_namespaced_pod(evicted, NS)
    assert exc.value.status == 404
    assert by_index()["run-c-1"]["metadata"]["name"] != evicted
    assert batch.read_namespaced_job("run-c", NS).status.failed is None
    with pytest.raises(ApiException) as exc:
        core.create_namespaced_pod_eviction("gone", NS, {"metadata": {"name": "gone", "namespace": NS}})
    assert exc.value.status == 404

    # A node that disappears: its pod fails with DisruptionTarget (PodGC) and is replaced elsewhere.
    lost = by_index()["run-c-0"]
    kube.remove_node(lost["spec"]["nodeName"])
    now_on = by_index()["run-c-0"]["spec"]["nodeName"]
    assert now_on not in (lost["spec"]["nodeName"], by_index()["run-c-1"]["spec"]["nodeName"])

    # Exit 1 matches no rule: counted, replaced while failed <= backoffLimit, then BackoffLimitExceeded.
    kube.terminate_pod(NS, by_index()["run-c-0"]["metadata"]["name"], 1)
    status = batch.read_namespaced_job_status("run-c", NS).status
    assert (status.failed, status.active, status.conditions) == (1, 2, None)
    kube.terminate_pod(NS, by_index()["run-c-1"]["metadata"]["name"], 137, reason="OOMKilled")
    status = batch.read_namespaced_job_status("run-c", NS).status
    conditions = {c.type: c for c in status.conditions}
    assert conditions["Failed"].reason == "BackoffLimitExceeded" and conditions["FailureTarget"].status == "True"
    assert status.active is None and by_index() == {}
    oom = [p for p in kube.pods(NS, "run-c") if p["spec"]["hostname"] == "run-c-1"][0]
    assert oom["status"]["containerStatuses"][0]["state"]["terminated"]["reason"] == "OOMKilled"


def test_success_sets_success_criteria_and_complete(kube, api):
    for name in ("gpu-a", "gpu-b"):
        add_gpu_node(kube, name)
    batch = kubernetes.client.BatchV1Api(api)
    batch.create_namespaced_job(NS, training_job("run-d"))
    kube.succeed_pods(NS, "run-d")
    status = batch.read_namespaced_job_status("run-d", NS).status
    assert [(c.type, c.status, c.reason) for c in status.conditions] == [
        ("SuccessCriteriaMet", "True", "CompletionsReached"), ("Complete", "True", "CompletionsReached")]
    assert (status.succeeded, status.completed_indexes, status.active) == (2, "0-1", None)
    assert status.start_time is not None and status.completion_time is not None


def test_node_patch_cordon_and_taint_in_all_three_patch_types(kube, api):
    add_gpu_node(kube, "gpu-a")
    core = kubernetes.client.CoreV1Api(api)
    # Strategic merge (the client's choice for a dict body): taints are an atomic list, replaced whole.
    quarantine = {"key": "fsdp.example.com/quarantine", "value": "xid-79", "effect": "NoSchedule"}
    node = core.patch_node("gpu-a", {"spec": {"unschedulable": True, "taints": [GPU_TAINT, quarantine]},
                                     "metadata": {"labels": {"fsdp.example.com/health": "bad"}}})
    assert node.spec.unschedulable is True
    assert [t.key for t in node.spec.taints] == [GPU_TAINT["key"], quarantine["key"]]
    assert node.metadata.labels["fsdp.example.com/health"] == "bad" and node.metadata.labels["node-type"] == "gpu"
    # Merge patch and JSON patch, both as the client sends them.
    core.patch_node("gpu-a", {"spec": {"taints": [GPU_TAINT]}}, _content_type="application/merge-patch+json")
    assert kube.node("gpu-a")["spec"]["taints"] == [GPU_TAINT]
    core.patch_node("gpu-a", [{"op": "add", "path": "/spec/taints/-", "value": quarantine},
                              {"op": "replace", "path": "/spec/unschedulable", "value": False}])
    assert kube.node("gpu-a")["spec"] == {**kube.node("gpu-a")["spec"], "taints": [GPU_TAINT, quarantine],
                                          "unschedulable": False}
    # Untolerated quarantine taint: a new job's pod stays pending until the taint goes.
    kubernetes.client.BatchV1Api(api).create_namespaced_job(NS, training_job("run-e", completions=1))
    assert kube.pods(NS, "run-e")[0]["status"]["phase"] == "Pending"
    core.patch_node("gpu-a", [{"op": "remove", "path": "/spec/taints/1"}])
    assert kube.pods(NS, "run-e")[0]["spec"]["nodeName"] == "gpu-a"
    # Status is not changed through the main resource; a bad JSON patch is refused.
    core.patch_node("gpu-a", {"status": {"allocatable": {"nvidia.com/gpu": "0"}}})
    assert kube.node("gpu-a")["status"]["allocatable"]["nvidia.com/gpu"] == "8"
    with pytest.raises(ApiException) as exc:
        core.patch_node("gpu-a", [{"op": "replace", "path": "/spec/nope/x", "value": 1}])
    assert exc.value.status == 422
    kube.set_node_condition("gpu-a", "Ready", "False", "KubeletNotReady", "PLEG is not healthy")
    ready = [c for c in core.read_node("gpu-a").status.conditions if c.type == "Ready"][0]
    assert (ready.status, ready.reason) == ("False", "KubeletNotReady")


def test_label_and_field_selectors(kube, api):
    for name in ("gpu-a", "gpu-b"):
        add_gpu_node(kube, name)
    batch, core = kubernetes.client.BatchV1Api(api), kubernetes.client.CoreV1Api(api)
    batch.create_namespaced_job(NS, training_job("sel-a"))
    batch.create_namespaced_job("other", training_job("sel-b", completions=1))

    def names(**kwargs):
        return sorted(p.metadata.labels["job-name"] for p in core.list_namespaced_pod(NS, **kwargs).items)

    assert names(label_selector="app=fsdp,run==sel-a") == ["sel-a", "sel-a"]
    assert names(label_selector="run!=sel-a") == []
    assert names(label_selector="app,!missing") == ["sel-a", "sel-a"]
    assert names(label_selector="run in (sel-a, sel-z)") == ["sel-a", "sel-a"]
    assert names(label_selector="run notin (sel-a),app") == []
    assert names(label_selector="batch.kubernetes.io/job-completion-index=1") == ["sel-a"]
    assert names(field_selector="status.phase=Running") == ["sel-a", "sel-a"]
    assert names(field_selector="status.phase!=Running") == []
    on_a = core.list_pod_for_all_namespaces(field_selector="spec.nodeName=gpu-a").items
    assert {p.metadata.namespace for p in on_a} <= {NS, "other"} and all(p.spec.node_name == "gpu-a" for p in on_a)
    assert len(core.list_pod_for_all_namespaces().items) == 3
    first = core.list_namespaced_pod(NS).items[0].metadata.name
    by_name = core.list_namespaced_pod(NS, field_selector=f"metadata.name={first}").items
    assert [p.metadata.name for p in by_name] == [first]
    listing = core.list_namespaced_pod(NS, limit=1)
    assert len(listing.items) == 1 and listing.metadata._continue
    assert len(core.list_namespaced_pod(NS, limit=1, _continue=listing.metadata._continue).items) == 1
    jobs = batch.list_namespaced_job(NS, label_selector="app=fsdp")
    assert [j.metadata.name for j in jobs.items] == ["sel-a"]
    assert jobs.kind == "JobList" and jobs.metadata.resource_version
    for bad in ({"field_selector": "spec.unknownField=x"}, {"label_selector": "a in x"}):
        with pytest.raises(ApiException) as exc:
            core.list_namespaced_pod(NS, **bad)
        assert (exc.value.status, error(exc)["reason"]) == (400, "BadRequest")
    nodes = core.list_node(label_selector="node-type=gpu", field_selector="metadata.name=gpu-b").items
    assert [n.metadata.name for n in nodes] == ["gpu-b"]


def test_pod_log_honours_tail_lines_and_container(kube, api):
    kube.add_node("cpu-a")
    core = kubernetes.client.CoreV1Api(api)
    core.create_namespaced_pod(NS, {"metadata": {"name": "two"}, "spec": {"containers": [
        {"name": "trainer", "image": "t"}, {"name": "sidecar", "image": "s"}]}})
    kube.set_pod_log(NS, "two", "".join(f"step {i}\n" for i in range(10)), container="trainer")
    kube.logs[(NS, "two", "sidecar")] = "sidecar up\n"

    def log(**kwargs) -> str:
        # kubernetes 36.0.x returns str(bytes) for logs (kubernetes-client/python#2596): read the raw body.
        return core.read_namespaced_pod_log("two", NS, _preload_content=False, **kwargs).data.decode()

    assert log(container="trainer", tail_lines=3) == "step 7\nstep 8\nstep 9\n"
    assert log(container="sidecar") == "sidecar up\n"
    assert core.read_namespaced_pod_log("two", NS, container="sidecar") in ("sidecar up\n", "b'sidecar up\\n'")
    with pytest.raises(ApiException) as exc:  # two containers: the apiserver wants a name
        core.read_namespaced_pod_log("two", NS)
    assert exc.value.status == 400 and "choose one of: [trainer sidecar]" in error(exc)["message"]
    with pytest.raises(ApiException) as exc:
        core.read_namespaced_pod_log("missing", NS)
    assert exc.value.status == 404


def test_requests_are_recorded_with_rbac_verbs(kube, api):
    add_gpu_node(kube, "gpu-a")
    kube.add_nodeclaim("claim-a", "gpu-a")
    batch, core = kubernetes.client.BatchV1Api(api), kubernetes.client.CoreV1Api(api)
    custom = kubernetes.client.CustomObjectsApi(api)
    kube.clear_requests()
    batch.create_namespaced_job(NS, training_job("rbac", completions=1))
    batch.read_namespaced_job_status("rbac", NS)
    pod = core.list_namespaced_pod(NS, label_selector="job-name=rbac").items[0].metadata.name
    core.read_namespaced_pod_log(pod, NS, _preload_content=False)
    core.patch_node("gpu-a", {"spec": {"unschedulable": True}})
    core.list_namespaced_event(NS)
    claim = custom.get_cluster_custom_object("karpenter.sh", "v1", "nodeclaims", "claim-a")
    assert claim["status"]["nodeName"] == "gpu-a"
    custom.list_cluster_custom_object("karpenter.sh", "v1", "nodeclaims")
    batch.delete_namespaced_job("rbac", NS, propagation_policy="Background")
    assert kube.requests == [
        Request("create", "batch", "jobs", "", NS, ""),
        Request("get", "batch", "jobs", "status", NS, "rbac"),
        Request("list", "", "pods", "", NS, ""),
        Request("get", "", "pods", "log", NS, pod),
        Request("patch", "", "nodes", "", "", "gpu-a"),
        Request("list", "", "events", "", NS, ""),
        Request("get", "karpenter.sh", "nodeclaims", "", "", "claim-a"),
        Request("list", "karpenter.sh", "nodeclaims", "", "", ""),
        Request("delete", "batch", "jobs", "", NS, "rbac"),
    ]
    assert ("", "pods/log", "get") in kube.rbac_usage() and ("batch", "jobs/status", "get") in kube.rbac_usage()


def test_job_deletion_propagation_and_nodeclaim_deletion(kube, api):
    for name in ("gpu-a", "gpu-b", "gpu-c"):
        add_gpu_node(kube, name)
    batch, core = kubernetes.client.BatchV1Api(api), kubernetes.client.CoreV1Api(api)
    batch.create_namespaced_job(NS, training_job("keep", completions=1))
    batch.create_namespaced_job(NS, training_job("drop", completions=1))
    # No propagationPolicy: batch/v1 orphans the pods (and says so in a Warning header).
    _, _, headers = batch.delete_namespaced_job_with_http_info("keep", NS)
    assert "child pods are preserved" in headers["Warning"]
    (orphan,) = kube.pods(NS, "keep")
    assert orphan["status"]["phase"] == "Running" and orphan["metadata"]["ownerReferences"] == []
    foreground = kubernetes.client.V1DeleteOptions(propagation_policy="Foreground")
    status = batch.delete_namespaced_job("drop", NS, body=foreground)
    assert status.status == "Success" and kube.pods(NS, "drop") == []
    deleted = core.delete_namespaced_pod(orphan["metadata"]["name"], NS)
    assert deleted.metadata.name == orphan["metadata"]["name"] and deleted.metadata.deletion_timestamp is not None
    assert kube.pods(NS) == []

    # Deleting a NodeClaim (Karpenter) drains and removes its node; the job's pod moves elsewhere.
    batch.create_namespaced_job(NS, training_job("moving", completions=1))
    first = kube.pods(NS, "moving")[0]
    kube.add_nodeclaim("claim-x", first["spec"]["nodeName"])
    kubernetes.client.CustomObjectsApi(api).delete_cluster_custom_object("karpenter.sh", "v1", "nodeclaims", "claim-x")
    assert first["spec"]["nodeName"] not in [n["metadata"]["name"] for n in kube.nodes()]
    (moved,) = kube.pods(NS, "moving")
    assert moved["status"]["phase"] == "Running" and moved["spec"]["nodeName"] != first["spec"]["nodeName"]
    assert batch.read_namespaced_job("moving", NS).status.failed is None
    with pytest.raises(ApiException) as exc:
        kubernetes.client.CustomObjectsApi(api).get_cluster_custom_object("karpenter.sh", "v1", "nodeclaims", "claim-x")
    assert exc.value.status == 404


def test_kubernetes_asyncio_and_kubeconfig(kube, tmp_path):
    import kubernetes_asyncio

    for name in ("gpu-a", "gpu-b"):
        add_gpu_node(kube, name)
    path = kube.kubeconfig(tmp_path / "kubeconfig", namespace=NS)
    # The sync client through the kubeconfig too.
    sync = kubernetes.config.new_client_from_config(config_file=str(path))
    assert kubernetes.client.VersionApi(sync).get_code().minor == "33"
    sync.close()

    async def scenario():
        configuration = kubernetes_asyncio.client.Configuration()
        await kubernetes_asyncio.config.load_kube_config(config_file=str(path), client_configuration=configuration)
        async with kubernetes_asyncio.client.ApiClient(configuration) as api:
            batch = kubernetes_asyncio.client.BatchV1Api(api)
            core = kubernetes_asyncio.client.CoreV1Api(api)
            await batch.create_namespaced_job(NS, training_job("async"))
            pods = (await core.list_namespaced_pod(NS, label_selector="job-name=async")).items
            assert sorted(p.spec.node_name for p in pods) == ["gpu-a", "gpu-b"]
            job = await batch.read_namespaced_job_status("async", NS)
            assert job.status.active == 2 and job.status.ready == 2
            kube.set_pod_log(NS, pods[0].metadata.name, "a\nb\nc\n")
            assert await core.read_namespaced_pod_log(pods[0].metadata.name, NS, tail_lines=1) == "c\n"
            node = await core.patch_node("gpu-a", {"spec": {"unschedulable": True}})  # strategic merge here
            assert node.spec.unschedulable is True
            nodes = (await core.list_node(field_selector="spec.unschedulable=true")).items
            assert [n.metadata.name for n in nodes] == ["gpu-a"]
            await core.create_namespaced_pod_eviction(pods[0].metadata.name, NS, kubernetes_asyncio.client.V1Eviction(
                metadata=kubernetes_asyncio.client.V1ObjectMeta(name=pods[0].metadata.name, namespace=NS)))
            pending = [p for p in (await core.list_namespaced_pod(NS)).items if p.status.phase == "Pending"]
            assert len(pending) == 1  # the only free GPU node is cordoned
            await batch.delete_namespaced_job("async", NS, propagation_policy="Background")
            assert (await core.list_namespaced_pod(NS)).items == []
            with pytest.raises(kubernetes_asyncio.client.exceptions.ApiException) as exc:
                await batch.read_namespaced_job("async", NS)
            assert exc.value.status == 404

    asyncio.run(scenario())


def test_non_indexed_job_node_affinity_pod_delete_and_events(kube, api):
    kube.add_node("p5-a", labels={"node.kubernetes.io/instance-type": "p5.48xlarge"})
    kube.add_node("p4-a", labels={"node.kubernetes.io/instance-type": "p4d.24xlarge"})
    batch, core = kubernetes.client.BatchV1Api(api), kubernetes.client.CoreV1Api(api)
    job = {"metadata": {"name": "plain"}, "spec": {"completions": 2, "parallelism": 2, "backoffLimit": 3, "template": {
        "spec": {"restartPolicy": "Never", "containers": [{"name": "main", "image": "busybox"}],
                 "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                     {"matchExpressions": [{"key": "node.kubernetes.io/instance-type", "operator": "In",
                                            "values": ["p5.48xlarge", "p5e.48xlarge"]}]}]}}}}}}}
    created = batch.create_namespaced_job(NS, job)
    assert (created.spec.completion_mode, created.spec.backoff_limit, created.spec.pod_replacement_policy) == (
        "NonIndexed", 3, "TerminatingOrFailed")
    pods = kube.pods(NS, "plain")
    assert len(pods) == 2 and {p["spec"]["nodeName"] for p in pods} == {"p5-a"}
    assert all(p["metadata"]["name"].startswith("plain-") and "hostname" not in p["spec"] for p in pods)
    assert all("batch.kubernetes.io/job-completion-index" not in p["metadata"]["labels"] for p in pods)

    # A plain DELETE of a running pod: SIGTERM (143), counted as a failure, replaced.
    core.delete_namespaced_pod(pods[0]["metadata"]["name"], NS, body=kubernetes.client.V1DeleteOptions())
    status = batch.read_namespaced_job_status("plain", NS).status
    assert (status.failed, status.active) == (1, 2)
    kube.succeed_pods(NS, "plain")
    status = batch.read_namespaced_job_status("plain", NS).status
    assert status.succeeded == 2 and status.completed_indexes is None and status.conditions[-1].type == "Complete"
    reasons = [e.reason for e in core.list_namespaced_event(NS, field_selector="involvedObject.kind=Job").items]
    assert reasons.count("SuccessfulCreate") == 3 and reasons[-1] == "Completed"

    # Pod labels (strategic merge on the pod) and pod conditions (merged by type on pods/status).
    name = kube.pods(NS, "plain")[0]["metadata"]["name"]
    core.patch_namespaced_pod(name, NS, {"metadata": {"labels": {"checked": "yes"}}})
    core.patch_namespaced_pod_status(name, NS, {"status": {"conditions": [
        {"type": "fsdp.example.com/Drained", "status": "True", "reason": "Checked"}]}})
    pod = core.read_namespaced_pod(name, NS)
    assert pod.metadata.labels["checked"] == "yes" and pod.metadata.labels["job-name"] == "plain"
    assert {c.type for c in pod.status.conditions} >= {"PodScheduled", "Ready", "fsdp.example.com/Drained"}

    # Events can be created too (strictly validated); nodes can be deleted through the API.
    event = core.create_namespaced_event(NS, kubernetes.client.CoreV1Event(
        metadata=kubernetes.client.V1ObjectMeta(generate_name="plain."), reason="RunRestarted", type="Normal",
        message="restart 1 of 3",
        involved_object=kubernetes.client.V1ObjectReference(kind="Job", name="plain", namespace=NS)))
    listed = core.list_namespaced_event(NS, field_selector="reason=RunRestarted").items
    assert [e.metadata.name for e in listed] == [event.metadata.name]
    assert core.delete_node("p4-a").status == "Success" and [n["metadata"]["name"] for n in kube.nodes()] == ["p5-a"]
