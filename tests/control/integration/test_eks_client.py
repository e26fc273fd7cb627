"""The EKS backend's Kubernetes client (eks/client.py): what each API error becomes (``kube_error``:
what failed and what to do), and ``KubeClient``'s calls against the real control plane
(tests/control/kube, as the cluster admin: RBAC is test_eks_rbac.py's) through the real
``kubernetes`` client and the provider's hooks: idempotent creates, the guarded resume, the
conflict-safe quarantine and return of a node (a real 409 from a second writer), evictions,
NodeClaims, and the triggerer's async read."""

from __future__ import annotations

import asyncio
import json
import re
import socket

import pytest

from fsdp_resilience.control.backends.base import BackendError, JobNotFoundError
from fsdp_resilience.control.backends.eks.client import connect, eks_kubeconfig, kube_error, read_job_async
from fsdp_resilience.control.backends.eks.constants import (
    CANCEL_ANNOTATION,
    LABEL_JOB,
    QUARANTINE_ANNOTATION,
    QUARANTINE_TAINT,
    RETURN_ANNOTATION,
)
from fsdp_resilience.control.backends.eks.manifests import training_job
from fsdp_resilience.control.backends.eks.pod_settings import PodTemplateSettings
from fsdp_resilience.training.contract import RunConfig

from control.fakes.eks_cluster import NS, add_gpu_node, render_kit
from control.kube.cluster import wait_for
from control.kube.control_plane import write_kubeconfig

CONN = "kubernetes_fake"


class ApiError(Exception):
    """The shape of the sync and async clients' ApiException: status, reason, body."""

    def __init__(self, status, reason="", body=None):
        super().__init__(f"({status}) {reason}")
        self.status, self.reason, self.body = status, reason, body


def status_body(message: str) -> bytes:
    return json.dumps({"kind": "Status", "status": "Failure", "message": message}).encode()


# --------------------------------------------------------------------------------------------
# kube_error
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "error, expected",
    [
        (
            ConnectionRefusedError("refused"),
            r"cannot reach the Kubernetes API to do x: ConnectionRefusedError.*"
            r"FSDP_KUBERNETES_CONN_ID",
        ),
        (ApiError(0, "no status"), r"cannot reach the Kubernetes API"),
        (ApiError(401, "Unauthorized", status_body("bad token")), r"refused the credentials to do x \(401.*bad token"),
        (
            ApiError(
                403,
                "Forbidden",
                status_body(
                    'jobs.batch "j" is forbidden: User "system:serviceaccount:airflow:airflow-worker" cannot delete '
                    "resource "
                    '"jobs" in API group "batch" in the namespace "fsdp-training"'
                ),
            ),
            r"forbidden to do x: identity system:serviceaccount:airflow:airflow-worker lacks the grant 'delete' on "
            r"jobs "
            r"\(API group batch\) in namespace fsdp-training.*deploy/base/rbac.yaml",
        ),
        (
            ApiError(403, "Forbidden", status_body('User "u" cannot list resource "nodes" in API group ""')),
            r"lacks the grant 'list' on nodes \(API group core\) \(cluster-wide\)",
        ),
        (
            ApiError(403, "Forbidden", status_body("denied by ValidatingAdmissionPolicy")),
            r"refused by RBAC or an admission policy.*denied by ValidatingAdmissionPolicy",
        ),
        (
            ApiError(404, "Not Found", status_body('namespaces "team-a" not found')),
            r"namespace team-a does not exist.*FSDP_EKS_NAMESPACE",
        ),
        (ApiError(404, "Not Found", status_body('jobs.batch "j" not found')), r"not found \(404.*right cluster"),
        (ApiError(409, "Conflict", status_body("the object has been modified")), r"conflict \(409.*retry the task"),
        (ApiError(422, "Unprocessable", status_body("spec.x: Invalid")), r"rejected the request to do x as invalid"),
        (ApiError(429, "Too Many Requests", b"slow down"), r"could not do x now \(429: slow down\).*later"),
        (ApiError(503, "Unavailable"), r"could not do x now \(503: Unavailable\)"),
        (ApiError(418, "Teapot", "short and stout"), r"cannot do x: 418 Teapot: short and stout"),
    ],
)
def test_kube_error_says_what_failed_and_what_to_do(error, expected):
    e = kube_error(error, "do x", "team-a")
    assert isinstance(e, BackendError)
    assert re.search(expected, str(e)), str(e)


# --------------------------------------------------------------------------------------------
# KubeClient against the real apiserver
# --------------------------------------------------------------------------------------------


@pytest.fixture
def client(permissive_cluster):
    """A KubeClient on the ``kubernetes_fake`` connection (the cluster admin), with the kit's FSx
    volume and claim in the training namespace (the pods mount it: without it they never schedule)."""
    training_fsx = [
        o for o in render_kit() if o["kind"] in ("PersistentVolume", "PersistentVolumeClaim")
        and (o["metadata"].get("namespace") == NS or (o["spec"].get("claimRef") or {}).get("namespace") == NS)
    ]  # fmt: skip
    permissive_cluster.apply(training_fsx)
    with connect(eks_kubeconfig(None, aws_conn_id=None, region_name=None, namespace=NS), CONN, NS) as client:
        yield client


def launch_job(launch_id: str = "0") -> dict:
    cfg = RunConfig(run_id="llm", run_dir="/fsx/runs/llm", dataset_dir="/fsx/datasets/c4", nodes=2, procs_per_node=8)
    return training_job(cfg, launch_id, PodTemplateSettings(image="example.com/fsdp-training:test", namespace=NS))


def scheduled_pods(cluster, job_name: str, count: int) -> list[dict]:
    """The Job's pods once the Job controller made ``count`` and the scheduler bound them."""
    return wait_for(
        lambda: len(pods := [p for p in cluster.pods(NS, job_name) if p["spec"].get("nodeName")]) == count and pods,
        what=f"{count} scheduled pod(s) of job {job_name}",
    )


def test_without_a_cluster_name_there_is_no_kubeconfig_to_build():
    with eks_kubeconfig(None, aws_conn_id="aws_default", region_name=None, namespace=NS) as path:
        assert path is None


def test_a_create_is_idempotent_and_a_missing_object_reads_as_none(client, permissive_cluster):
    body = launch_job()
    name = body["metadata"]["name"]
    assert client.get_job(name) is None
    first = client.create_job(body)
    again = client.create_job(body)  # a retried task: 409, and the existing Job back
    assert first["metadata"]["uid"] == again["metadata"]["uid"]
    assert [j["metadata"]["name"] for j in client.list_jobs(f"{LABEL_JOB}!=x")] == [name]
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name},
        "spec": {"clusterIP": "None", "selector": {LABEL_JOB: name}, "ports": [{"port": 29500}]},
    }
    assert client.ensure_service(service)["metadata"]["uid"] == client.ensure_service(service)["metadata"]["uid"]
    assert len([r for r in permissive_cluster.requests if r.resource == "services" and r.verb == "create"]) == 1
    assert client.get_service_account("nobody") is None and client.get_claim("nothing") is None


def test_resume_starts_a_suspended_job_but_never_one_a_cancel_stopped(client):
    job = client.create_job(launch_job())
    assert job["spec"]["suspend"] is True
    assert client.resume_job(job)["spec"]["suspend"] is False
    stopped = client.create_job(launch_job("1"))
    name = stopped["metadata"]["name"]
    client.patch_job(name, {"metadata": {"annotations": {CANCEL_ANNOTATION: json.dumps({"message": "stop"})}}})
    # The resume carries the resourceVersion it read: the cancel came in between, so 409, read
    # again, and the verdict keeps the Job suspended.
    assert client.resume_job(stopped)["spec"]["suspend"] is True
    assert client.get_job(name)["spec"]["suspend"] is True


def test_an_api_error_names_what_the_client_was_doing(client):
    with pytest.raises(BackendError, match=r"cannot patch job no-such-job: not found \(404"):
        client.patch_job("no-such-job", {"spec": {"suspend": True}})


def test_quarantine_keeps_a_taint_another_controller_added_meanwhile(client, permissive_cluster, monkeypatch):
    """Karpenter taints the node right after the client read it: the quarantine patch (the whole
    taint list, with the resourceVersion read) gets a real 409 from the apiserver, and the client
    reads the node again and keeps that taint."""
    add_gpu_node(permissive_cluster, "gpu-0")
    other = {"key": "karpenter.sh/disrupted", "effect": "NoSchedule"}
    read = client.get_node
    second_writer = []

    def read_then_another_controller_writes(name):
        node = read(name)
        if not second_writer:
            second_writer.append(permissive_cluster.add_node_taint(name, other))
        return node

    monkeypatch.setattr(client, "get_node", read_then_another_controller_writes)
    node = client.get_node("gpu-0")  # the read after which the other controller taints the node
    permissive_cluster.clear_requests()
    client.quarantine_node(node, "restarts exhausted (node 1)")  # stale: 409, read again, recompute
    taints = permissive_cluster.node("gpu-0")["spec"]["taints"]
    assert {t["key"] for t in taints} >= {other["key"], QUARANTINE_TAINT, "nvidia.com/gpu"}
    assert permissive_cluster.node("gpu-0")["spec"]["unschedulable"] is True
    (ours,) = [t for t in taints if t["key"] == QUARANTINE_TAINT]
    assert ours["value"] == "restarts-exhausted-node-1"
    patches = [r.code for r in permissive_cluster.requests if r.resource == "nodes" and r.verb == "patch"]
    assert patches[0] == 409 and patches[-1] == 200, patches  # the conflict, then the patch on a fresh read


def test_return_node_undoes_only_our_quarantine(client, permissive_cluster):
    node = add_gpu_node(permissive_cluster, "gpu-0")
    add_gpu_node(permissive_cluster, "gpu-1", unschedulable=True)  # cordoned by hand: not ours
    client.quarantine_node(node, "bad GPU")
    assert client.return_node("gpu-0", "fixed", "ops", quarantined_before=0.0) == "not_quarantined"  # too recent
    assert client.return_node("gpu-0", "fixed", "ops") == "returned"
    returned = permissive_cluster.node("gpu-0")
    assert not returned["spec"].get("unschedulable") and QUARANTINE_TAINT not in {
        t["key"] for t in returned["spec"].get("taints", [])
    }
    note = json.loads(returned["metadata"]["annotations"][RETURN_ANNOTATION])
    assert note["by"] == "ops" and note["reason"] == "fixed" and note["quarantine"].endswith("bad GPU")
    assert QUARANTINE_ANNOTATION not in returned["metadata"]["annotations"]
    assert client.return_node("gpu-1", "fixed", "ops") == "not_quarantined"
    assert client.return_node("gpu-9", "fixed", "ops") == "gone"


def test_evictions_logs_and_nodeclaims(client, permissive_cluster):
    for i in range(2):
        add_gpu_node(permissive_cluster, f"gpu-{i}")
    job = client.resume_job(client.create_job(launch_job()))
    name = job["metadata"]["name"]
    scheduled_pods(permissive_cluster, name, 2)
    pods = client.list_pods(f"{LABEL_JOB}={name}")
    assert sorted(p["spec"]["nodeName"] for p in pods) == ["gpu-0", "gpu-1"]
    assert client.evict_pods_on("gpu-0", f"{LABEL_JOB}={name}") == [
        p["metadata"]["name"] for p in pods if p["spec"]["nodeName"] == "gpu-0"
    ]
    assert client.evict_pods_on("gpu-7", f"{LABEL_JOB}={name}") == []
    assert client.pod_log("no-such-pod", 10).startswith("(no log: 404")
    permissive_cluster.add_nodeclaim("claim-a", "gpu-1")
    assert [c["metadata"]["name"] for c in client.list_nodeclaims()] == ["claim-a"]
    client.delete_nodeclaim("claim-a")
    client.delete_nodeclaim("claim-a")  # being deleted already (Karpenter's finalizer holds it): fine


def test_the_async_read_returns_the_job_and_its_pods_or_says_there_is_none(client, permissive_cluster):
    add_gpu_node(permissive_cluster, "gpu-0")
    add_gpu_node(permissive_cluster, "gpu-1")
    name = client.resume_job(client.create_job(launch_job()))["metadata"]["name"]
    wait_for(lambda: len(permissive_cluster.pods(NS, name)) == 2, what="the Job controller's two pods")
    job, pods = asyncio.run(read_job_async(None, CONN, NS, name))
    assert job["metadata"]["name"] == name and len(pods) == 2
    with pytest.raises(JobNotFoundError, match=f"no job missing in namespace {NS}"):
        asyncio.run(read_job_async(None, CONN, NS, "missing"))


def test_an_unreachable_apiserver_is_a_backend_error_that_says_so(permissive_cluster, tmp_path, monkeypatch):
    """A connection to an address where nothing listens (the shared control plane keeps running)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]  # free again once closed: nothing listens there
    gone = write_kubeconfig(tmp_path / "gone", f"https://127.0.0.1:{closed}", permissive_cluster.plane.pki / "ca.crt",
                            token="unused", namespace=NS)  # fmt: skip
    monkeypatch.setenv("AIRFLOW_CONN_KUBERNETES_GONE", permissive_cluster.airflow_connection(gone, namespace=NS))
    with connect(eks_kubeconfig(None, aws_conn_id=None, region_name=None, namespace=NS), "kubernetes_gone", NS) as c:
        with pytest.raises(BackendError, match="cannot reach the Kubernetes API to read job j"):
            c.get_job("j")
