"""The fake apiserver (fake_kube.py) behaves like the real one for what the EKS backend does, as seen
through the real `kubernetes` client and through `kubernetes_asyncio` (the provider's async hook):
the Job controller and scheduler, and as strict as EKS where a test can tell (immutability,
semantic validation, references that must exist, resourceVersion conflicts, Pod Security, RBAC by
token, admission policies, and the rendered deploy kit in ``cluster``)."""

from __future__ import annotations

import asyncio
import json
import os
import time

import kubernetes
import pytest
from kubernetes.client.exceptions import ApiException

from control.fake_kube import FakeKube, Request, fake_kube, pod_security_violations, schema_problems  # noqa: F401  (fixture)
from control.fakes.eks_cluster import cluster  # noqa: F401  (fixture)
from control.support import MEASURED

NS = "training"
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"}


def training_job(name: str, completions: int = 2, *, gpus: int = 8, backoff_limit: int = 0) -> dict:
    """An Indexed job shaped like the EKS backend's: one pod per node, FailJob on 75, Ignore disruptions."""
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "labels": {"app": "fsdp"}},
        "spec": {
            "completionMode": "Indexed",
            "completions": completions,
            "parallelism": completions,
            "backoffLimit": backoff_limit,
            "podFailurePolicy": {
                "rules": [
                    {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
                    {
                        "action": "FailJob",
                        "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [75, 78]},
                    },
                ]
            },
            "template": {
                "metadata": {"labels": {"app": "fsdp", "run": name}},
                "spec": {
                    "restartPolicy": "Never",
                    "subdomain": name,
                    "nodeSelector": {"node-type": "gpu"},
                    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                    "affinity": {
                        "podAntiAffinity": {
                            "requiredDuringSchedulingIgnoredDuringExecution": [
                                {
                                    "labelSelector": {"matchLabels": {"batch.kubernetes.io/job-name": name}},
                                    "topologyKey": "kubernetes.io/hostname",
                                }
                            ]
                        }
                    },
                    "containers": [
                        {
                            "name": "trainer",
                            "image": "trainer:1",
                            "resources": {"limits": {"nvidia.com/gpu": str(gpus)}},
                        }
                    ],
                },
            },
        },
    }


def add_gpu_node(kube: FakeKube, name: str, **kwargs) -> None:
    kube.add_node(
        name,
        labels={"node-type": "gpu"},
        taints=[GPU_TAINT],
        allocatable={"nvidia.com/gpu": "8", "vpc.amazonaws.com/efa": "4"},
        **kwargs,
    )


@pytest.fixture
def kube(fake_kube):
    yield fake_kube
    assert fake_kube.errors == []  # the fake itself never crashed on a request
    for res, schema in (
        ("pods", "pod-v1.json"),
        ("jobs", "job-batch-v1.json"),
        ("nodes", "node-v1.json"),
        ("events", "event-v1.json"),
    ):  # what the fake makes is valid 1.33 API too
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
    kube.add_node("cpu-a", labels={"node-type": "cpu"})  # selector mismatch
    add_gpu_node(kube, "gpu-cordoned", unschedulable=True)  # cordoned
    add_gpu_node(kube, "gpu-sick", ready=False)  # NotReady
    kube.add_node(
        "gpu-other",
        labels={"node-type": "gpu"},
        allocatable={"nvidia.com/gpu": "8"},
        taints=[{"key": "dedicated", "value": "other", "effect": "NoSchedule"}],
    )  # untolerated taint
    batch, core = kubernetes.client.BatchV1Api(api), kubernetes.client.CoreV1Api(api)

    # 1 GPU per pod: only the anti-affinity keeps the three pods on three different nodes.
    job = batch.create_namespaced_job(NS, training_job("run-a", completions=3, gpus=1))
    assert job.spec.selector.match_labels == {"batch.kubernetes.io/controller-uid": job.metadata.uid}
    pods = {
        p.metadata.annotations["batch.kubernetes.io/job-completion-index"]: p
        for p in core.list_namespaced_pod(NS, label_selector="job-name=run-a").items
    }
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
    for reason in (
        "1 node(s) didn't match Pod's node affinity/selector",
        "2 node(s) didn't match pod anti-affinity rules",
        "untolerated taint {dedicated: other}",
        "untolerated taint {node.kubernetes.io/not-ready: }",
        "1 node(s) were unschedulable",
    ):
        assert reason in scheduled.message
    events = core.list_namespaced_event(
        NS, field_selector=f"involvedObject.name={pending.metadata.name},involvedObject.kind=Pod"
    ).items
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
        409,
        "AlreadyExists",
        'jobs.batch "good" already exists',
    )

    # Typed client objects serialize to valid bodies; generateName and server-set metadata are filled.
    service = core.create_namespaced_service(
        NS,
        kubernetes.client.V1Service(
            metadata=kubernetes.client.V1ObjectMeta(generate_name="rdzv-"),
            spec=kubernetes.client.V1ServiceSpec(
                cluster_ip="None",
                selector={"run": "good"},
                ports=[kubernetes.client.V1ServicePort(port=29500, name="c10d")],
            ),
        ),
    )
    assert service.metadata.name.startswith("rdzv-") and service.metadata.uid and service.metadata.namespace == NS
    assert service.spec.cluster_ip == "None" and service.spec.ports[0].protocol == "TCP"
    assert int(service.metadata.resource_version) > 0 and service.metadata.creation_timestamp.tzinfo is not None
    with pytest.raises(ApiException) as exc:
        core.read_namespaced_service("missing", NS)
    assert (exc.value.status, error(exc)["reason"], error(exc)["message"]) == (
        404,
        "NotFound",
        'services "missing" not found',
    )

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
    expected = (
        f"Container trainer for pod {NS}/{pod0['metadata']['name']} failed with exit code 75 "
        "matching FailJob rule at index 0"
    )
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
    core.create_namespaced_pod_eviction(
        evicted, NS, kubernetes.client.V1Eviction(metadata=kubernetes.client.V1ObjectMeta(name=evicted, namespace=NS))
    )
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


def test_a_lost_nodes_pod_keeps_its_index_until_terminal_then_is_replaced_for_that_index(kube, api):
    """A node that stops reporting: Ready=Unknown, tainted unreachable, its pod deleted by the taint
    manager (DisruptionTarget) but Terminating (no kubelet to end it). Under podReplacementPolicy
    Failed (the default with a podFailurePolicy) the Job controller waits; once PodGC fails the pod
    (the node object is deleted), it recreates the same index on another node, and the Ignore rule
    on DisruptionTarget leaves the failure uncounted. Without a podFailurePolicy
    (TerminatingOrFailed) the Terminating pod is replaced at once."""
    for name in ("gpu-a", "gpu-b", "gpu-c", "gpu-d"):
        add_gpu_node(kube, name)
    batch, core = kubernetes.client.BatchV1Api(api), kubernetes.client.CoreV1Api(api)
    batch.create_namespaced_job(NS, training_job("run-l", completions=3))
    assert batch.read_namespaced_job("run-l", NS).spec.pod_replacement_policy == "Failed"
    pods = {p["spec"]["hostname"]: p for p in kube.pods(NS, "run-l")}
    assert sorted(pods) == ["run-l-0", "run-l-1", "run-l-2"]
    assert len({p["spec"]["nodeName"] for p in pods.values()}) == 3
    lost = pods["run-l-1"]
    kube.lose_node(lost["spec"]["nodeName"])

    node = core.read_node(lost["spec"]["nodeName"])
    assert {c.type: c.status for c in node.status.conditions}["Ready"] == "Unknown"
    assert {(t.key, t.effect) for t in node.spec.taints} >= {
        ("node.kubernetes.io/unreachable", "NoSchedule"),
        ("node.kubernetes.io/unreachable", "NoExecute"),
    }
    terminating = core.read_namespaced_pod(lost["metadata"]["name"], NS)
    assert terminating.metadata.deletion_timestamp is not None and terminating.status.phase == "Running"
    disruption = {c.type: c for c in terminating.status.conditions}["DisruptionTarget"]
    assert (disruption.status, disruption.reason) == ("True", "DeletionByTaintManager")
    status = batch.read_namespaced_job_status("run-l", NS).status
    assert (status.active, status.terminating, status.failed) == (2, 1, None)
    assert len(kube.pods(NS, "run-l")) == 3  # no replacement while the old pod is Terminating

    # Evicting it (a drain, replace_nodes) changes nothing: no kubelet is left to end it.
    core.create_namespaced_pod_eviction(
        lost["metadata"]["name"],
        NS,
        kubernetes.client.V1Eviction(
            metadata=kubernetes.client.V1ObjectMeta(name=lost["metadata"]["name"], namespace=NS)
        ),
    )
    assert core.read_namespaced_pod(lost["metadata"]["name"], NS).status.phase == "Running"
    assert len(kube.pods(NS, "run-l")) == 3

    kube.remove_node(lost["spec"]["nodeName"])  # PodGC: the orphaned pod fails, the index is recreated
    pods = [p for p in kube.pods(NS, "run-l") if p["status"]["phase"] == "Running"]
    replacement = [p for p in pods if p["spec"]["hostname"] == "run-l-1"]
    assert len(pods) == 3 and len(replacement) == 1
    assert replacement[0]["metadata"]["name"] != lost["metadata"]["name"]
    assert replacement[0]["spec"]["nodeName"] == "gpu-d"  # the one node left that anti-affinity allows
    status = batch.read_namespaced_job_status("run-l", NS).status
    assert (status.active, status.terminating, status.failed) == (3, 0, None)  # Ignore: not counted

    # No podFailurePolicy: podReplacementPolicy defaults to TerminatingOrFailed, replaced at once.
    for name in ("gpu-e", "gpu-f", "gpu-g"):
        add_gpu_node(kube, name)
    plain = training_job("run-p", completions=1, backoff_limit=1)
    del plain["spec"]["podFailurePolicy"]
    batch.create_namespaced_job(NS, plain)
    assert batch.read_namespaced_job("run-p", NS).spec.pod_replacement_policy == "TerminatingOrFailed"
    (first,) = kube.pods(NS, "run-p")
    kube.lose_node(first["spec"]["nodeName"])
    pods = kube.pods(NS, "run-p")
    assert len(pods) == 2 and [p["spec"]["hostname"] for p in pods] == ["run-p-0", "run-p-0"]
    status = batch.read_namespaced_job_status("run-p", NS).status
    assert (status.active, status.terminating) == (1, 1)
    core.delete_namespaced_pod(first["metadata"]["name"], NS, grace_period_seconds=0)  # a force delete ends it
    assert [p["metadata"]["name"] for p in kube.pods(NS, "run-p")] != [first["metadata"]["name"]]
    assert len(kube.pods(NS, "run-p")) == 1  # its replacement; the failure counted (no podFailurePolicy)
    assert batch.read_namespaced_job_status("run-p", NS).status.failed == 1


def test_success_sets_success_criteria_and_complete(kube, api):
    for name in ("gpu-a", "gpu-b"):
        add_gpu_node(kube, name)
    batch = kubernetes.client.BatchV1Api(api)
    batch.create_namespaced_job(NS, training_job("run-d"))
    kube.succeed_pods(NS, "run-d")
    status = batch.read_namespaced_job_status("run-d", NS).status
    assert [(c.type, c.status, c.reason) for c in status.conditions] == [
        ("SuccessCriteriaMet", "True", "CompletionsReached"),
        ("Complete", "True", "CompletionsReached"),
    ]
    assert (status.succeeded, status.completed_indexes, status.active) == (2, "0-1", None)
    assert status.start_time is not None and status.completion_time is not None


def test_node_patch_cordon_and_taint_in_all_three_patch_types(kube, api):
    add_gpu_node(kube, "gpu-a")
    core = kubernetes.client.CoreV1Api(api)
    # Strategic merge (the client's choice for a dict body): taints are an atomic list, replaced whole.
    quarantine = {"key": "fsdp.example.com/quarantine", "value": "xid-79", "effect": "NoSchedule"}
    node = core.patch_node(
        "gpu-a",
        {
            "spec": {"unschedulable": True, "taints": [GPU_TAINT, quarantine]},
            "metadata": {"labels": {"fsdp.example.com/health": "bad"}},
        },
    )
    assert node.spec.unschedulable is True
    assert [t.key for t in node.spec.taints] == [GPU_TAINT["key"], quarantine["key"]]
    assert node.metadata.labels["fsdp.example.com/health"] == "bad" and node.metadata.labels["node-type"] == "gpu"
    # Merge patch and JSON patch, both as the client sends them.
    core.patch_node("gpu-a", {"spec": {"taints": [GPU_TAINT]}}, _content_type="application/merge-patch+json")
    assert kube.node("gpu-a")["spec"]["taints"] == [GPU_TAINT]
    core.patch_node(
        "gpu-a",
        [
            {"op": "add", "path": "/spec/taints/-", "value": quarantine},
            {"op": "replace", "path": "/spec/unschedulable", "value": False},
        ],
    )
    assert kube.node("gpu-a")["spec"] == {
        **kube.node("gpu-a")["spec"],
        "taints": [GPU_TAINT, quarantine],
        "unschedulable": False,
    }
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
    core.create_namespaced_pod(
        NS,
        {
            "metadata": {"name": "two"},
            "spec": {"containers": [{"name": "trainer", "image": "t"}, {"name": "sidecar", "image": "s"}]},
        },
    )
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
        Request("create", "batch", "jobs", "", NS, "rbac"),
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
    # The Job's Service goes with it (the garbage collector follows ownerReferences).
    owner = kube.job(NS, "drop")
    core.create_namespaced_service(
        NS,
        {
            "metadata": {
                "name": "drop",
                "ownerReferences": [
                    {"apiVersion": "batch/v1", "kind": "Job", "name": "drop", "uid": owner["metadata"]["uid"]}
                ],
            },
            "spec": {"clusterIP": "None", "ports": [{"port": 29500}]},
        },
    )
    foreground = kubernetes.client.V1DeleteOptions(propagation_policy="Foreground")
    status = batch.delete_namespaced_job("drop", NS, body=foreground)
    assert status.status == "Success" and kube.pods(NS, "drop") == []
    assert core.list_namespaced_service(NS).items == []
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
            await core.create_namespaced_pod_eviction(
                pods[0].metadata.name,
                NS,
                kubernetes_asyncio.client.V1Eviction(
                    metadata=kubernetes_asyncio.client.V1ObjectMeta(name=pods[0].metadata.name, namespace=NS)
                ),
            )
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
    job = {
        "metadata": {"name": "plain"},
        "spec": {
            "completions": 2,
            "parallelism": 2,
            "backoffLimit": 3,
            "template": {
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [{"name": "main", "image": "busybox"}],
                    "affinity": {
                        "nodeAffinity": {
                            "requiredDuringSchedulingIgnoredDuringExecution": {
                                "nodeSelectorTerms": [
                                    {
                                        "matchExpressions": [
                                            {
                                                "key": "node.kubernetes.io/instance-type",
                                                "operator": "In",
                                                "values": ["p5.48xlarge", "p5e.48xlarge"],
                                            }
                                        ]
                                    }
                                ]
                            }
                        }
                    },
                }
            },
        },
    }
    created = batch.create_namespaced_job(NS, job)
    assert (created.spec.completion_mode, created.spec.backoff_limit, created.spec.pod_replacement_policy) == (
        "NonIndexed",
        3,
        "TerminatingOrFailed",
    )
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
    core.patch_namespaced_pod_status(
        name,
        NS,
        {"status": {"conditions": [{"type": "fsdp.example.com/Drained", "status": "True", "reason": "Checked"}]}},
    )
    pod = core.read_namespaced_pod(name, NS)
    assert pod.metadata.labels["checked"] == "yes" and pod.metadata.labels["job-name"] == "plain"
    assert {c.type for c in pod.status.conditions} >= {"PodScheduled", "Ready", "fsdp.example.com/Drained"}

    # Events can be created too (strictly validated); nodes can be deleted through the API.
    event = core.create_namespaced_event(
        NS,
        kubernetes.client.CoreV1Event(
            metadata=kubernetes.client.V1ObjectMeta(generate_name="plain."),
            reason="RunRestarted",
            type="Normal",
            message="restart 1 of 3",
            involved_object=kubernetes.client.V1ObjectReference(kind="Job", name="plain", namespace=NS),
        ),
    )
    listed = core.list_namespaced_event(NS, field_selector="reason=RunRestarted").items
    assert [e.metadata.name for e in listed] == [event.metadata.name]
    assert core.delete_node("p4-a").status == "Success" and [n["metadata"]["name"] for n in kube.nodes()] == ["p5-a"]


# ---------------------------------------------------------------------------------------------
# As strict as EKS: immutability, semantic validation, references, conflicts, Pod Security,
# RBAC and admission policies.


def invalid_message(call, *args, **kwargs) -> str:
    """The 422 message the apiserver answers ``call`` with."""
    with pytest.raises(ApiException) as exc:
        call(*args, **kwargs)
    assert (exc.value.status, error(exc)["reason"]) == (422, "Invalid"), error(exc)
    return error(exc)["message"]


def test_a_jobs_template_selector_completion_mode_and_failure_policy_are_immutable(kube, api):
    add_gpu_node(kube, "gpu-a")
    batch = kubernetes.client.BatchV1Api(api)
    batch.create_namespaced_job(NS, training_job("fixed", completions=1))
    image = [{"op": "replace", "path": "/spec/template/spec/containers/0/image", "value": "trainer:2"}]
    message = invalid_message(batch.patch_namespaced_job, "fixed", NS, image)
    assert message.startswith('Job.batch "fixed" is invalid: spec.template: Invalid value: ')
    assert message.endswith(": field is immutable")
    for path, value in (
        ("/spec/completionMode", "NonIndexed"),
        ("/spec/selector/matchLabels/x", "y"),
        ("/spec/podFailurePolicy/rules/1/onExitCodes/values", [75]),
    ):
        key = path.split("/")[2]
        patch = [{"op": "add", "path": path, "value": value}]
        message = invalid_message(batch.patch_namespaced_job, "fixed", NS, patch)
        assert f"spec.{key}: Invalid value: " in message and "field is immutable" in message
    # What may change does (labels, parallelism, suspend), through a strategic merge patch too.
    job = batch.patch_namespaced_job("fixed", NS, {"metadata": {"labels": {"seen": "yes"}}, "spec": {"parallelism": 0}})
    assert job.metadata.labels["seen"] == "yes" and job.spec.parallelism == 0

    # A suspended Job that never started may still change its pods' scheduling directives (only).
    suspended = training_job("waiting", completions=1)
    suspended["spec"]["suspend"] = True
    batch.create_namespaced_job(NS, suspended)
    moved = batch.patch_namespaced_job("waiting", NS, {"spec": {"template": {"spec": {"nodeSelector": {"pool": "b"}}}}})
    assert moved.spec.template.spec.node_selector == {"node-type": "gpu", "pool": "b"}
    assert "spec.template" in invalid_message(batch.patch_namespaced_job, "waiting", NS, image)

    # A pod's spec: its image may change, its resources may not.
    core = kubernetes.client.CoreV1Api(api)
    (pod,) = kube.pods(NS, "fixed")
    name = pod["metadata"]["name"]
    new_image = [{"op": "replace", "path": "/spec/containers/0/image", "value": "trainer:2"}]
    assert core.patch_namespaced_pod(name, NS, new_image).spec.containers[0].image == "trainer:2"
    resources = [{"op": "add", "path": "/spec/containers/0/resources/limits/nvidia.com~1gpu", "value": "4"}]
    assert "spec: Forbidden: pod updates may not change fields other than" in invalid_message(
        core.patch_namespaced_pod, name, NS, resources
    )


def test_semantic_validation_beyond_the_schema(kube, api):
    batch, core = kubernetes.client.BatchV1Api(api), kubernetes.client.CoreV1Api(api)

    def job_with(edit) -> dict:
        job = training_job("semantic")
        edit(job["spec"])
        return job

    def rules(spec):
        return spec["podFailurePolicy"]["rules"]

    def container(spec):
        return spec["template"]["spec"]["containers"][0]

    cases = [
        (
            lambda s: rules(s)[1]["onExitCodes"].update(values=[0, 75]),
            "spec.podFailurePolicy.rules[1].onExitCodes.values[0]: Invalid value: 0: must not be 0 for the In operator",
        ),
        (
            lambda s: rules(s)[1]["onExitCodes"].update(values=[78, 75]),
            "spec.podFailurePolicy.rules[1].onExitCodes.values[1]: Invalid value: 75: must be ordered",
        ),
        (
            lambda s: rules(s)[1]["onExitCodes"].update(containerName="launcher"),
            'spec.podFailurePolicy.rules[1].onExitCodes.containerName: Invalid value: "launcher": must be one of the '
            "container or initContainer names in the pod template",
        ),
        (
            lambda s: container(s).update(
                resources={"requests": {"nvidia.com/gpu": "4"}, "limits": {"nvidia.com/gpu": "8"}}
            ),
            'spec.template.spec.containers[0].resources.requests: Invalid value: "4": must be equal to nvidia.com/gpu '
            "limit of 8",
        ),
        (
            lambda s: container(s).update(resources={"requests": {"vpc.amazonaws.com/efa": "4"}}),
            "spec.template.spec.containers[0].resources.limits: Required value: Limit must be set for non "
            "overcommitable resources (vpc.amazonaws.com/efa)",
        ),
        (
            lambda s: container(s).update(resources={"limits": {"hugepages-2Mi": "1Gi"}}),
            "spec.template.spec.containers[0].resources: Forbidden: HugePages require cpu or memory",
        ),
        (
            lambda s: container(s).update(
                resources={"requests": {"hugepages-2Mi": "1Gi"}, "limits": {"hugepages-2Mi": "2Gi", "memory": "8Gi"}}
            ),
            "must be equal to hugepages-2Mi limit of 2Gi",
        ),
        (
            lambda s: container(s).update(resources={"requests": {"cpu": "8"}, "limits": {"cpu": "4"}}),
            'resources.requests: Invalid value: "8": must be less than or equal to cpu limit of 4',
        ),
    ]
    for edit, expected in cases:
        assert expected in invalid_message(batch.create_namespaced_job, NS, job_with(edit))
    # Limits alone are fine (requests default to them), and so are cpu/memory requests below limits.
    batch.create_namespaced_job(
        NS,
        job_with(
            lambda s: container(s).update(
                resources={
                    "requests": {"cpu": "4", "memory": "8Gi"},
                    "limits": {"cpu": "8", "memory": "8Gi", "nvidia.com/gpu": "8", "hugepages-2Mi": "1Gi"},
                }
            )
        ),
    )

    # Names per kind: a Service is a DNS-1035 label (a letter first), a Job at most 63 characters,
    # a namespace an RFC 1123 label; a pod's hostname and subdomain are RFC 1123 labels.
    service = {"metadata": {"name": "7b-llama"}, "spec": {"clusterIP": "None", "ports": [{"port": 29500}]}}
    assert 'metadata.name: Invalid value: "7b-llama": a DNS-1035 label' in invalid_message(
        core.create_namespaced_service, NS, service
    )
    renamed = core.create_namespaced_service(NS, {**service, "metadata": {"name": "r7b-llama"}})
    assert renamed.metadata.name == "r7b-llama"
    assert batch.create_namespaced_job(NS, training_job("7b-llama", completions=1)).metadata.name == "7b-llama"
    long_name = training_job("j" * 64, completions=1)
    del long_name["spec"]["template"]["metadata"]["labels"]["run"], long_name["spec"]["template"]["spec"]["subdomain"]
    assert invalid_message(batch.create_namespaced_job, NS, long_name).endswith(
        f'metadata.name: Invalid value: "{"j" * 64}": must be no more than 63 characters'
    )
    assert "RFC 1123 label" in invalid_message(core.create_namespace, {"metadata": {"name": "team.a"}})
    pod = {"metadata": {"name": "named"}, "spec": {"hostname": "Node_0", "containers": [{"name": "c", "image": "i"}]}}
    assert 'spec.hostname: Invalid value: "Node_0"' in invalid_message(core.create_namespaced_pod, NS, pod)

    # Ports: in range, named ports by IANA_SVC_NAME, several Service ports each with a name.
    bad_port = {"metadata": {"name": "rdzv"}, "spec": {"clusterIP": "None", "ports": [{"port": 70000}]}}
    assert "spec.ports[0].port: Invalid value: 70000: must be between 1 and 65535, inclusive" in invalid_message(
        core.create_namespaced_service, NS, bad_port
    )
    two = {"metadata": {"name": "rdzv"}, "spec": {"ports": [{"port": 29500, "name": "c10d"}, {"port": 29501}]}}
    assert "spec.ports[1].name: Required value" in invalid_message(core.create_namespaced_service, NS, two)
    pod["spec"] = {"containers": [{"name": "c", "image": "i", "ports": [{"containerPort": 0}]}]}
    assert "spec.containers[0].ports[0].containerPort: Invalid value: 0" in invalid_message(
        core.create_namespaced_pod, NS, pod
    )
    policy = {
        "metadata": {"name": "np"},
        "spec": {"podSelector": {}, "ingress": [{"from": [{}], "ports": [{"port": 29500, "endPort": 29400}]}]},
    }
    message = invalid_message(kubernetes.client.NetworkingV1Api(api).create_namespaced_network_policy, NS, policy)
    assert "spec.ingress[0].ports[0].endPort: Invalid value: 29400" in message
    assert "spec.ingress[0].from[0]: Required value: must specify a peer" in message


def test_references_to_service_accounts_priority_classes_and_claims_must_exist_once_a_kit_is_loaded(kube, api):
    add_gpu_node(kube, "gpu-a")
    kube.add_node("cpu-a")
    batch, core = kubernetes.client.BatchV1Api(api), kubernetes.client.CoreV1Api(api)
    scheduling = kubernetes.client.SchedulingV1Api(api)
    kube.load(
        [
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}},
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "trainer", "namespace": NS}},
            {
                "apiVersion": "scheduling.k8s.io/v1",
                "kind": "PriorityClass",
                "metadata": {"name": "training"},
                "value": 1000,
            },
        ]
    )
    assert [a.metadata.name for a in core.list_namespaced_service_account(NS).items] == ["trainer"]
    assert scheduling.read_priority_class("training").value == 1000

    # A missing ServiceAccount: the job controller's pods are refused; a FailedCreate event says why.
    job = training_job("needs-sa", completions=1)
    job["spec"]["template"]["spec"]["serviceAccountName"] = "launcher"
    batch.create_namespaced_job(NS, job)
    assert kube.pods(NS, "needs-sa") == []
    (event,) = [e for e in kube.events(NS, "needs-sa") if e["reason"] == "FailedCreate"]
    assert event["type"] == "Warning" and event["message"] == (
        f'Error creating: pods "needs-sa-0-" is forbidden: error looking up service account {NS}/launcher: '
        'serviceaccount "launcher" not found'
    )
    core.create_namespaced_service_account(NS, {"metadata": {"name": "launcher"}})
    assert [p["status"]["phase"] for p in kube.pods(NS, "needs-sa")] == ["Running"]  # created once it exists

    # A missing PriorityClass: refused the same way; an existing one sets the pod's priority.
    job = training_job("needs-pc", completions=1)
    job["spec"]["template"]["spec"]["priorityClassName"] = "urgent"
    batch.create_namespaced_job(NS, job)
    assert [e["message"] for e in kube.events(NS, "needs-pc") if e["reason"] == "FailedCreate"] == [
        'Error creating: pods "needs-pc-0-" is forbidden: no PriorityClass with name urgent was found'
    ]
    direct = {
        "metadata": {"name": "direct"},
        "spec": {
            "serviceAccountName": "trainer",
            "priorityClassName": "training",
            "containers": [{"name": "c", "image": "i"}],
        },
    }
    assert core.create_namespaced_pod(NS, direct).spec.priority == 1000
    with pytest.raises(ApiException) as exc:  # a client's own pod: 403 from the ServiceAccount admission
        core.create_namespaced_pod(NS, {**direct, "spec": {**direct["spec"], "serviceAccountName": "nobody"}})
    assert (exc.value.status, error(exc)["message"]) == (
        403,
        f'pods "direct" is forbidden: error looking up service account {NS}/nobody: serviceaccount "nobody" not found',
    )

    # A missing claim: the pod is created but stays Pending until the claim exists.
    claimed = {
        "metadata": {"name": "claimed"},
        "spec": {
            "containers": [{"name": "c", "image": "i", "volumeMounts": [{"name": "fsx", "mountPath": "/fsx"}]}],
            "volumes": [{"name": "fsx", "persistentVolumeClaim": {"claimName": "fsx-training"}}],
        },
    }
    assert core.create_namespaced_pod(NS, claimed).status.phase == "Pending"
    (event,) = [e for e in kube.events(NS, "claimed") if e["reason"] == "FailedScheduling"]
    assert event["message"].startswith('0/2 nodes are available: persistentvolumeclaim "fsx-training" not found.')
    core.create_namespaced_persistent_volume_claim(
        NS,
        {
            "metadata": {"name": "fsx-training"},
            "spec": {
                "accessModes": ["ReadWriteMany"],
                "storageClassName": "",
                "resources": {"requests": {"storage": "1200Gi"}},
            },
        },
    )
    assert kube.pod(NS, "claimed")["status"]["phase"] == "Running"
    assert [c.metadata.name for c in core.list_namespaced_persistent_volume_claim(NS).items] == ["fsx-training"]


def test_network_policies_are_served_and_strictly_validated(kube, api):
    networking = kubernetes.client.NetworkingV1Api(api)
    policy = {
        "metadata": {"name": "rdzv", "labels": {"app": "fsdp"}},
        "spec": {
            "podSelector": {"matchLabels": {"fsdp-resilience/job-name": "run-a"}},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [{"podSelector": {"matchLabels": {"fsdp-resilience/job-name": "run-a"}}}]}],
        },
    }
    created = networking.create_namespaced_network_policy(NS, policy)
    assert created.metadata.uid
    assert networking.read_namespaced_network_policy("rdzv", NS).spec.policy_types == ["Ingress"]
    listed = networking.list_namespaced_network_policy(NS, label_selector="app=fsdp").items
    assert [p.metadata.name for p in listed] == ["rdzv"]
    typo = {**policy, "metadata": {"name": "typo"}, "spec": {**policy["spec"], "ingres": []}}
    assert 'unknown field "spec.ingres"' in invalid_message(networking.create_namespaced_network_policy, NS, typo)
    assert networking.delete_namespaced_network_policy("rdzv", NS).status == "Success"
    assert networking.list_namespaced_network_policy(NS).items == []


def test_a_stale_resource_version_conflicts_and_a_second_controller_races_a_taint_patch(kube, api):
    add_gpu_node(kube, "gpu-a")
    core = kubernetes.client.CoreV1Api(api)
    quarantine = {"key": "fsdp-resilience/quarantined", "value": "xid-79", "effect": "NoSchedule"}
    unreachable = {"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"}

    # Read-modify-write without the resourceVersion: the taint added in between is lost.
    kube.taint_on_next_read("gpu-a", unreachable)
    node = core.read_node("gpu-a")
    assert [t.key for t in node.spec.taints] == [GPU_TAINT["key"]]  # read before the other controller wrote
    assert [t["key"] for t in kube.node("gpu-a")["spec"]["taints"]] == [GPU_TAINT["key"], unreachable["key"]]
    core.patch_node("gpu-a", {"spec": {"taints": [GPU_TAINT, quarantine]}})
    assert [t["key"] for t in kube.node("gpu-a")["spec"]["taints"]] == [GPU_TAINT["key"], quarantine["key"]]

    # With the resourceVersion it read: 409 Conflict, and a fresh read keeps both taints.
    kube.taint_on_next_read("gpu-a", unreachable)
    node = core.list_node(field_selector="metadata.name=gpu-a").items[0]  # a list is a read too
    stale = node.metadata.resource_version
    with pytest.raises(ApiException) as exc:
        core.patch_node("gpu-a", {"metadata": {"resourceVersion": stale}, "spec": {"taints": [GPU_TAINT, quarantine]}})
    assert (exc.value.status, error(exc)["reason"], error(exc)["message"]) == (
        409,
        "Conflict",
        'Operation cannot be fulfilled on nodes "gpu-a": the object has been modified; please apply '
        "your changes to the latest version and try again",
    )
    node = core.read_node("gpu-a")
    taints = api.sanitize_for_serialization(node.spec.taints) + [quarantine]
    core.patch_node(
        "gpu-a", {"metadata": {"resourceVersion": node.metadata.resource_version}, "spec": {"taints": taints}}
    )
    assert {t["key"] for t in kube.node("gpu-a")["spec"]["taints"]} == {
        GPU_TAINT["key"],
        quarantine["key"],
        unreachable["key"],
    }
    # The client sent timeAdded as "+00:00"; stored as the apiserver re-encodes it (UTC, Z).
    (added,) = [t["timeAdded"] for t in kube.node("gpu-a")["spec"]["taints"] if t["key"] == unreachable["key"]]
    assert "+00:00" in str(taints) and added.endswith("Z") and "+" not in added
    # The same for a JSON patch and for a PUT with a stale resourceVersion.
    with pytest.raises(ApiException) as exc:
        core.patch_node(
            "gpu-a",
            [
                {"op": "replace", "path": "/metadata/resourceVersion", "value": stale},
                {"op": "add", "path": "/spec/unschedulable", "value": True},
            ],
        )
    assert exc.value.status == 409
    body = core.read_node("gpu-a")
    kube.add_node_taint("gpu-a", {"key": "karpenter.sh/disrupted", "effect": "NoSchedule"})
    with pytest.raises(ApiException) as exc:
        core.replace_node("gpu-a", body)
    assert exc.value.status == 409


def hardened_pod(name: str, add: list[str] | None = None) -> dict:
    """A pod as the EKS backend makes it: non-root, no escalation, drop ALL, RuntimeDefault."""
    return {
        "metadata": {"name": name},
        "spec": {
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": 1000,
                "runAsGroup": 1000,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "containers": [
                {
                    "name": "trainer",
                    "image": "trainer:1",
                    "securityContext": {
                        "allowPrivilegeEscalation": False,
                        "capabilities": {"drop": ["ALL"], "add": add or []},
                    },
                }
            ],
        },
    }


def test_pod_security_violations_word_for_word():
    assert pod_security_violations(hardened_pod("p")["spec"], "restricted") == []
    ipc_lock = hardened_pod("p", add=["IPC_LOCK"])["spec"]
    assert pod_security_violations(ipc_lock, "baseline") == [
        'non-default capabilities (container "trainer" must not include "IPC_LOCK" in securityContext.capabilities.add)'
    ]
    assert pod_security_violations(ipc_lock, "restricted")[-1] == (
        'unrestricted capabilities (container "trainer" must not include "IPC_LOCK" in '
        "securityContext.capabilities.add)"
    )
    assert pod_security_violations(hardened_pod("p", add=["NET_BIND_SERVICE"])["spec"], "restricted") == []
    plain = {
        "containers": [
            {"name": "a", "image": "i"},
            {"name": "b", "image": "i", "ports": [{"containerPort": 80, "hostPort": 80}]},
        ],
        "hostNetwork": True,
        "volumes": [{"name": "host", "hostPath": {"path": "/dev"}}],
    }
    assert pod_security_violations(plain, "privileged") == []
    assert pod_security_violations(plain, "baseline") == [
        "host namespaces (hostNetwork=true)",
        'hostPath volume ("host")',
        'hostPort (container "b" uses hostPort 80)',
    ]
    assert pod_security_violations(plain, "restricted")[3:] == [
        'restricted volume types (volume "host" uses restricted volume type "hostPath")',
        'allowPrivilegeEscalation != false (containers "a", "b" must set '
        "securityContext.allowPrivilegeEscalation=false)",
        'unrestricted capabilities (containers "a", "b" must set securityContext.capabilities.drop=["ALL"])',
        'runAsNonRoot != true (pod or containers "a", "b" must set securityContext.runAsNonRoot=true)',
        'seccompProfile (pod or containers "a", "b" must set securityContext.seccompProfile.type to '
        '"RuntimeDefault" or "Localhost")',
    ]
    root = {
        **hardened_pod("p")["spec"],
        "securityContext": {"runAsUser": 0, "runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
    }
    assert pod_security_violations(root, "restricted") == ["runAsUser=0 (pod must not set runAsUser=0)"]


def test_pod_security_admission_enforces_and_warns_per_namespace_label(kube, api):
    add_gpu_node(kube, "gpu-a")
    kube.add_node("cpu-a")
    batch, core = kubernetes.client.BatchV1Api(api), kubernetes.client.CoreV1Api(api)
    kube.add_namespace(
        "psa-baseline",
        {"pod-security.kubernetes.io/enforce": "baseline", "pod-security.kubernetes.io/warn": "restricted"},
    )
    kube.add_namespace(
        "psa-restricted",
        {"pod-security.kubernetes.io/enforce": "restricted", "pod-security.kubernetes.io/enforce-version": "v1.30"},
    )
    with pytest.raises(ApiException) as exc:
        core.create_namespaced_pod("psa-baseline", hardened_pod("efa", add=["IPC_LOCK"]))
    assert (exc.value.status, error(exc)["reason"], error(exc)["message"]) == (
        403,
        "Forbidden",
        'pods "efa" is forbidden: violates PodSecurity "baseline:latest": non-default capabilities '
        '(container "trainer" must not include "IPC_LOCK" in securityContext.capabilities.add)',
    )
    # Admitted at baseline, with a warning for what restricted would reject.
    plain = {"metadata": {"name": "plain"}, "spec": {"containers": [{"name": "c", "image": "i"}]}}
    _, code, headers = core.create_namespaced_pod_with_http_info("psa-baseline", plain)
    assert code == 201 and headers["Warning"].startswith(
        '299 - "would violate PodSecurity "restricted:latest": allowPrivilegeEscalation != false'
    )
    _, _, headers = core.create_namespaced_pod_with_http_info("psa-baseline", hardened_pod("hardened"))
    assert "Warning" not in headers
    core.create_namespaced_pod(NS, hardened_pod("efa", add=["IPC_LOCK"]))  # no labels: privileged

    # The job controller's pods: a Job whose template violates is created (with a warning), its
    # pods are refused and a FailedCreate event says why.
    job = training_job("loose", completions=1)
    _, code, headers = batch.create_namespaced_job_with_http_info("psa-restricted", job)
    assert code == 201 and 'would violate PodSecurity "restricted:v1.30"' in headers["Warning"]
    assert kube.pods("psa-restricted") == []
    (event,) = [e for e in kube.events("psa-restricted", "loose") if e["reason"] == "FailedCreate"]
    assert event["message"].startswith(
        'Error creating: pods "loose-0-" is forbidden: violates PodSecurity '
        '"restricted:v1.30": allowPrivilegeEscalation != false (container "trainer" '
        "must set securityContext.allowPrivilegeEscalation=false)"
    )
    good = training_job("tight", completions=1)
    good["spec"]["template"]["spec"].update(securityContext=hardened_pod("x")["spec"]["securityContext"])
    good["spec"]["template"]["spec"]["containers"][0]["securityContext"] = hardened_pod("x")["spec"]["containers"][0][
        "securityContext"
    ]
    _, _, headers = batch.create_namespaced_job_with_http_info("psa-restricted", good)
    assert "Warning" not in headers and len(kube.pods("psa-restricted", "tight")) == 1


def test_tokens_rbac_and_admission_policies_once_a_kit_is_loaded(kube, api, tmp_path):
    from control.kube_authz import ADMIN, UserInfo, service_account_user

    add_gpu_node(kube, "gpu-a")
    kube.add_node("cpu-a", labels={"node-type": "cpu"})
    worker, triggerer = service_account_user("airflow", "worker"), service_account_user("airflow", "triggerer")
    rbac = "rbac.authorization.k8s.io/v1"
    kube.load(
        [
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}},
            {
                "apiVersion": rbac,
                "kind": "Role",
                "metadata": {"name": "launcher", "namespace": NS},
                "rules": [
                    {"apiGroups": ["batch"], "resources": ["jobs"], "verbs": ["create", "get"]},
                    {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
                ],
            },
            {
                "apiVersion": rbac,
                "kind": "RoleBinding",
                "metadata": {"name": "launcher", "namespace": NS},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "launcher"},
                "subjects": [{"kind": "ServiceAccount", "name": "worker", "namespace": "airflow"}],
            },
            {
                "apiVersion": rbac,
                "kind": "ClusterRole",
                "metadata": {"name": "nodes"},
                "rules": [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "patch"]}],
            },
            {
                "apiVersion": rbac,
                "kind": "ClusterRoleBinding",
                "metadata": {"name": "nodes"},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "nodes"},
                "subjects": [
                    {"kind": "ServiceAccount", "name": "worker", "namespace": "airflow"},
                    {"kind": "ServiceAccount", "name": "triggerer", "namespace": "airflow"},
                ],
            },
            # Node patches only on GPU nodes; the job controller's pods need a team label.
            {
                "apiVersion": "admissionregistration.k8s.io/v1",
                "kind": "ValidatingAdmissionPolicy",
                "metadata": {"name": "gpu-nodes-only"},
                "spec": {
                    "failurePolicy": "Fail",
                    "matchConstraints": {
                        "resourceRules": [
                            {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["UPDATE"], "resources": ["nodes"]}
                        ]
                    },
                    "matchConditions": [
                        {
                            "name": "airflow",
                            "expression": "request.userInfo.username.startsWith('system:serviceaccount:airflow:')",
                        }
                    ],
                    "validations": [
                        {
                            "expression": "has(oldObject.metadata.labels) && "
                            "'node-type' in oldObject.metadata.labels && "
                            "oldObject.metadata.labels['node-type'] == 'gpu'",
                            "message": "only GPU nodes",
                        }
                    ],
                },
            },
            {
                "apiVersion": "admissionregistration.k8s.io/v1",
                "kind": "ValidatingAdmissionPolicyBinding",
                "metadata": {"name": "gpu-nodes-only"},
                "spec": {"policyName": "gpu-nodes-only", "validationActions": ["Deny"]},
            },
            {
                "apiVersion": "admissionregistration.k8s.io/v1",
                "kind": "ValidatingAdmissionPolicy",
                "metadata": {"name": "team-pods"},
                "spec": {
                    "matchConstraints": {
                        "resourceRules": [
                            {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"]}
                        ]
                    },
                    "matchConditions": [
                        {
                            "name": "job-controller",
                            "expression": "request.userInfo.username == "
                            "'system:serviceaccount:kube-system:job-controller'",
                        }
                    ],
                    "validations": [
                        {
                            "expression": "has(object.metadata.labels) && 'team' in object.metadata.labels",
                            "message": "pods need a team",
                        }
                    ],
                },
            },
            {
                "apiVersion": "admissionregistration.k8s.io/v1",
                "kind": "ValidatingAdmissionPolicyBinding",
                "metadata": {"name": "team-pods"},
                "spec": {"policyName": "team-pods", "validationActions": ["Deny"]},
            },
        ]
    )

    def client(user) -> kubernetes.client.ApiClient:
        return kubernetes.config.new_client_from_config(
            config_file=str(kube.kubeconfig(tmp_path / f"{user.username.replace(':', '-')}.json", NS, user))
        )

    as_worker, as_triggerer, as_admin = client(worker), client(triggerer), client(ADMIN)
    try:
        job = training_job("owned", completions=1)
        job["spec"]["template"]["metadata"]["labels"]["team"] = "ml"
        kube.clear_requests()
        kubernetes.client.BatchV1Api(as_worker).create_namespaced_job(NS, job)
        assert kube.requests == [Request("create", "batch", "jobs", "", NS, "owned")]
        assert kube.requests[0].user == worker
        assert len(kube.pods(NS, "owned")) == 1

        with pytest.raises(ApiException) as exc:
            kubernetes.client.BatchV1Api(as_triggerer).create_namespaced_job(NS, training_job("nope"))
        assert (exc.value.status, error(exc)["reason"], error(exc)["message"]) == (
            403,
            "Forbidden",
            'jobs.batch is forbidden: User "system:serviceaccount:airflow:triggerer" cannot create '
            f'resource "jobs" in API group "batch" in the namespace "{NS}"',
        )
        with pytest.raises(ApiException) as exc:  # no grant for deletes either
            kubernetes.client.BatchV1Api(as_worker).delete_namespaced_job("owned", NS)
        assert exc.value.status == 403 and 'cannot delete resource "jobs"' in error(exc)["message"]
        with pytest.raises(ApiException) as exc:  # no token: system:anonymous
            kubernetes.client.CoreV1Api(api).list_node()
        assert exc.value.status == 403
        assert 'User "system:anonymous" cannot list resource "nodes"' in error(exc)["message"]
        bogus = kubernetes.client.Configuration(host=kube.url, api_key={"authorization": "Bearer forged"})
        with pytest.raises(ApiException) as exc, kubernetes.client.ApiClient(bogus) as forged:
            kubernetes.client.CoreV1Api(forged).list_node()
        assert exc.value.status == 401

        # Admission: the worker may patch a GPU node, not a CPU node; the admin is not matched.
        worker_core = kubernetes.client.CoreV1Api(as_worker)
        worker_core.patch_node("gpu-a", {"spec": {"unschedulable": True}})
        with pytest.raises(ApiException) as exc:
            worker_core.patch_node("cpu-a", {"spec": {"unschedulable": True}})
        assert exc.value.status == 422 and "only GPU nodes" in error(exc)["message"], error(exc)  # reason Invalid
        assert "gpu-nodes-only" in error(exc)["message"]
        kubernetes.client.CoreV1Api(as_admin).patch_node("cpu-a", {"spec": {"unschedulable": True}})
        assert kube.node("cpu-a")["spec"]["unschedulable"] is True

        # The job controller's pods go through admission as the job controller.
        kubernetes.client.BatchV1Api(as_admin).create_namespaced_job(NS, training_job("teamless", completions=1))
        assert kube.pods(NS, "teamless") == []
        (event,) = [e for e in kube.events(NS, "teamless") if e["reason"] == "FailedCreate"]
        assert event["message"].startswith('Error creating: pods "teamless-0-" is forbidden: ')
        assert "pods need a team" in event["message"]
        assert isinstance(kube.requests[-1].user, UserInfo)
    finally:
        for c in (as_worker, as_triggerer, as_admin):
            c.close()


def test_strict_cluster_loads_the_kit_and_calls_as_worker_in_tasks_and_as_triggerer_in_triggers(cluster):
    from fsdp_resilience.control.triggers.node_capacity import NodeCapacityTrigger

    from control.fakes.eks_cluster import NS as TRAINING_NS
    from control.fakes.eks_cluster import TRIGGERER, WORKER, acting_as
    from control.fakes.eks_cluster import add_gpu_node as add_pool_node

    kube = cluster
    add_pool_node(kube, "gpu-0")
    connection = json.loads(os.environ["AIRFLOW_CONN_KUBERNETES_FAKE"])
    api = kubernetes.config.new_client_from_config(config_file=connection["extra"]["kube_config_path"])
    batch = kubernetes.client.BatchV1Api(api)
    try:
        job = training_job("kit-run", completions=1)
        spec = job["spec"]["template"]["spec"]
        spec.update(
            serviceAccountName="fsdp-training",
            nodeSelector={"fsdp-resilience/pool": "gpu"},
            securityContext=hardened_pod("x")["spec"]["securityContext"],
            volumes=[{"name": "fsx", "persistentVolumeClaim": {"claimName": "fsx-training"}}],
        )
        spec["containers"][0]["securityContext"] = hardened_pod("x")["spec"]["containers"][0]["securityContext"]
        batch.create_namespaced_job(TRAINING_NS, job)
        assert kube.requests[-1].user == WORKER
        assert [p["status"]["phase"] for p in kube.pods(TRAINING_NS, "kit-run")] == ["Running"]

        with acting_as(kube, TRIGGERER), pytest.raises(ApiException) as exc:
            batch.create_namespaced_job(TRAINING_NS, training_job("from-trigger"))
        assert (exc.value.status, error(exc)["message"]) == (
            403,
            'jobs.batch is forbidden: User "system:serviceaccount:airflow:airflow-triggerer" cannot create '
            f'resource "jobs" in API group "batch" in the namespace "{TRAINING_NS}"',
        )
        assert kube.requests[-1].user == TRIGGERER

        # The kit's node-write policy: the worker may cordon a GPU-pool node, not another node.
        kube.add_node("system-0")
        core = kubernetes.client.CoreV1Api(api)
        with pytest.raises(ApiException) as exc:
            core.patch_node("system-0", {"spec": {"unschedulable": True}})
        assert exc.value.status == 403
        assert "ValidatingAdmissionPolicy 'fsdp-airflow-node-writes'" in error(exc)["message"]
        add_pool_node(kube, "gpu-1")
        assert core.patch_node("gpu-1", {"spec": {"unschedulable": True}}).spec.unschedulable is True
    finally:
        api.close()

    # A trigger's requests (here through asyncio.to_thread) carry the triggerer's token.
    kube.clear_requests()
    backend = {
        "name": "eks",
        "namespace": TRAINING_NS,
        "kubernetes_conn_id": "kubernetes_fake",
        "image": "example.com/fsdp-training:test",
    }
    trigger = NodeCapacityTrigger(backend=backend, nodes=1, timeout_s=30, started_at=time.time(), poll_interval_s=0.1)

    async def first_event():
        return await anext(trigger.run())

    event = asyncio.run(first_event())
    assert event.payload["status"] == "success"
    assert kube.requests and {r.user for r in kube.requests} == {TRIGGERER}
