"""The deploy kit's RBAC and the EKS backend agree, per identity: the worker is granted exactly what
the tasks call, the triggerer exactly what the triggers call (EksBackend.status_async and
EksBackend.capacity), and nothing else, whether Airflow authenticates as its ServiceAccounts (in
the cluster) or as the Kubernetes groups an EKS access entry maps its IAM roles to (outside it).

The calls are not listed by hand: a session that uses every backend method runs against the real
control plane with the kit applied (the RBAC authorizer enforces it, so a missing grant is a 403),
and the apiserver's audit log gives each request's RBAC (apiGroup, resource, verb) and the user who
made it; the grants come from the rendered kit (deploy/render.py, kubectl's kustomize).
An IAM role is authenticated by EKS (an access entry maps it to the kit's groups); here a
ServiceAccount allowed to impersonate sends the role's name and groups (Impersonate-User and
Impersonate-Group), and the apiserver authorizes, admits and audits the request as that user.
"""

from __future__ import annotations

import asyncio
import sys
import threading

import pytest

from fsdp_resilience.control.backends.base import BackendError
from fsdp_resilience.training.contract import ExitCode

from control.fakes.eks_cluster import (  # noqa: F401
    NS,
    TRIGGERER,
    WORKER,
    acting_as,
    add_gpu_node,
    asg_instances,
    aws,
    backend_for,
    commit_checkpoint,
    make_asg,
    render_kit,
    run_config,
    start_strict_cluster,
    wait_for,
)
from control.kube.cluster import UserInfo
from control.support import REPO

sys.path.insert(0, str(REPO / "deploy"))
render = pytest.importorskip("render")

AIRFLOW_NAMESPACE = "airflow"
#: The groups the access entries of docs/deploy-on-eks.md map the worker's and the triggerer's IAM roles to.
WORKER_GROUP, TRIGGERER_GROUP = "fsdp-airflow-worker", "fsdp-airflow-triggerer"
#: Airflow outside the cluster, as EKS authenticates an access entry's IAM role.
WORKER_ROLE = UserInfo(
    "arn:aws:iam::111122223333:role/fsdp-resilience-airflow-worker", (WORKER_GROUP, "system:authenticated")
)
TRIGGERER_ROLE = UserInfo(
    "arn:aws:iam::111122223333:role/fsdp-resilience-airflow-triggerer", (TRIGGERER_GROUP, "system:authenticated")
)

Usage = dict[tuple[str, str], set[str]]


def watch(backend, handle, user: UserInfo, kube) -> None:
    """What the triggerer's triggers call: the progress watch (status_async) and the capacity wait."""
    with acting_as(kube, user):
        asyncio.run(backend.status_async(handle))
        backend.capacity()


def running_pods(kube, job_name: str, count: int) -> list[dict]:
    return wait_for(
        lambda: (
            len(pods := [p for p in kube.pods(NS, job_name) if p["status"].get("phase") == "Running"]) == count and pods
        ),
        what=f"{count} running pod(s) of {job_name}",
    )


def exercise(kube, tmp_path, replacement: str, worker: UserInfo, triggerer: UserInfo, asg: str) -> None:
    """Every backend method as the worker, on a job that fails on one node, then an evaluation; and
    the triggers' calls as the triggerer. ``asg``: the node group's Auto Scaling group (asg mode)."""
    for i, instance in enumerate(make_asg(asg, 3) if replacement == "asg" else [None] * 3):
        add_gpu_node(kube, f"{replacement}-gpu-{i}", instance)
        if replacement == "karpenter":
            kube.add_nodeclaim(f"{replacement}-claim-{i}", f"{replacement}-gpu-{i}", nodepool="gpu")
    backend = backend_for(tmp_path, replacement=replacement, max_unhealthy_share=0.5, evaluation_poll_s=0.05)
    cfg = run_config(tmp_path, run_id=f"rbac-{replacement}", nodes=2)
    with acting_as(kube, worker):
        handle = backend.submit(cfg, "0")
        pods = running_pods(kube, handle.job_name, 2)  # the Job controller's, a moment later
        backend.status(handle)
        backend.logs(handle)  # no kubelet serves them: the apiserver authorizes the read, then fails it
    watch(backend, handle, triggerer, kube)
    kube.terminate_pod(NS, pods[0]["metadata"]["name"], int(ExitCode.RESTARTS_EXHAUSTED))
    with acting_as(kube, worker):
        backend.diagnose(handle)
        backend.capacity()
        other = backend.submit(run_config(tmp_path, run_id=f"rbac-{replacement}-2", nodes=1), "0")
        node = running_pods(kube, other.job_name, 1)[0]["spec"]["nodeName"]
        replaced = backend.replace_nodes([node], reason="rbac session")  # evicts the running pod
        assert replaced.replaced == [node], replaced.reason
        third = backend.submit(run_config(tmp_path, run_id=f"rbac-{replacement}-3", nodes=1), "0")
        backend.cancel(third)

        commit_checkpoint(cfg.run_dir, 5, world_size=16)

        def fail_the_evaluation():
            pod = wait_for(
                lambda: [
                    p for p in kube.pods(NS) if "eval" in p["metadata"]["name"] and p["status"]["phase"] == "Running"
                ],
                what="the eval pod",
            )[0]
            kube.terminate_pod(NS, pod["metadata"]["name"], 1)

        threading.Thread(target=fail_the_evaluation, daemon=True).start()
        with pytest.raises(Exception, match="evaluation job"):
            backend.run_evaluation(cfg, timeout_s=120)  # a failed evaluation reads its pod's log


def used_by(kube, user: UserInfo) -> Usage:
    used: Usage = {}
    for r in kube.requests:
        if r.user != user.username:
            continue
        assert r.namespace in ("", None, NS), f"{user.username} called outside the training namespace: {r}"
        resource = f"{r.resource}/{r.subresource}" if r.subresource else r.resource
        used.setdefault((r.api_group, resource), set()).add(r.verb)
    return used


def flatten(grants) -> Usage:
    out: Usage = {k: set(v) for k, v in grants.cluster.items()}
    for key, verbs in grants.namespaced.get(NS, {}).items():
        out.setdefault(key, set()).update(verbs)
    return out


def assert_exactly(used: Usage, allowed: Usage, who: str) -> None:
    missing = {k: v - allowed.get(k, set()) for k, v in used.items() if v - allowed.get(k, set())}
    unused = {k: v - used.get(k, set()) for k, v in allowed.items() if v - used.get(k, set())}
    assert not missing, f"the {who} calls what deploy/ does not grant it: {missing}"
    assert not unused, f"deploy/ grants the {who} what it never calls: {unused}"


def refused(kube, user: UserInfo) -> list:
    return [r for r in kube.requests if r.user == user.username and r.code == 403]


@pytest.mark.parametrize(
    "replacement, overlay, worker, triggerer",
    [
        ("asg", "example", WORKER, TRIGGERER),
        ("karpenter", "example-karpenter", WORKER, TRIGGERER),
        ("asg", "example", WORKER_ROLE, TRIGGERER_ROLE),
    ],
    ids=["asg-service-accounts", "karpenter-service-accounts", "asg-access-entry-groups"],
)
def test_the_kits_rbac_grants_each_identity_exactly_what_it_calls(
    kube, tmp_path, monkeypatch, aws, replacement, overlay, worker, triggerer
):
    """Whether Airflow runs in the cluster (its ServiceAccounts' tokens) or outside it (its IAM
    roles, which the access entries map to the kit's groups), each identity calls exactly what the
    kit grants it, and the real authorizer refuses none of it."""
    start_strict_cluster(kube, tmp_path, monkeypatch, overlay)
    asg = f"rbac-{replacement}-{worker.username.rsplit('/', 1)[-1].rsplit(':', 1)[-1]}"
    exercise(kube, tmp_path, replacement, worker, triggerer, asg)
    objects = render_kit(overlay)
    worker_used, triggerer_used = used_by(kube, worker), used_by(kube, triggerer)
    assert not refused(kube, worker) and not refused(kube, triggerer)
    assert_exactly(worker_used, flatten(render.rbac_grants(objects, AIRFLOW_NAMESPACE, "airflow-worker")), "worker")
    assert_exactly(
        triggerer_used, flatten(render.rbac_grants(objects, AIRFLOW_NAMESPACE, "airflow-triggerer")), "triggerer"
    )
    # The triggers read a Job, its pods and the pool's nodes, and write nothing.
    assert triggerer_used == {("batch", "jobs"): {"get"}, ("", "pods"): {"list"}, ("", "nodes"): {"list"}}
    # Outside the cluster the groups get the same rights as the service accounts.
    assert render.group_grants(objects, WORKER_GROUP) == render.rbac_grants(
        objects, AIRFLOW_NAMESPACE, "airflow-worker"
    )
    assert render.group_grants(objects, TRIGGERER_GROUP) == render.rbac_grants(
        objects, AIRFLOW_NAMESPACE, "airflow-triggerer"
    )
    if replacement == "asg":
        # The group replaced the instance it terminated.
        wait_for(lambda: len(asg_instances(asg)) == 3, what="the ASG back at 3 instances")


def test_airflow_outside_the_cluster_works_through_the_access_entry_groups(kube, tmp_path, monkeypatch):
    """The IAM roles' access entries map them to the kit's groups: the worker's role submits and
    reads, the triggerer's role watches, and a write as the triggerer is refused with 403 by the
    RBAC authorizer, naming the role."""
    start_strict_cluster(kube, tmp_path, monkeypatch)
    for i in range(2):
        add_gpu_node(kube, f"gpu-{i}")
    backend = backend_for(tmp_path)
    cfg = run_config(tmp_path, run_id="7b-outside", nodes=2)
    with acting_as(kube, WORKER_ROLE):
        handle = backend.submit(cfg, "0")
        assert backend.status(handle).state in ("pending", "running")
    watch(backend, handle, TRIGGERER_ROLE, kube)
    with acting_as(kube, TRIGGERER_ROLE), pytest.raises(BackendError, match="forbidden") as denied:
        backend.cancel(handle)
    assert f"identity {TRIGGERER_ROLE.username} lacks the grant 'patch' on jobs" in str(denied.value)
    (patch,) = [r for r in kube.requests if r.user == TRIGGERER_ROLE.username and r.verb == "patch"]
    assert (patch.api_group, patch.resource, patch.code) == ("batch", "jobs", 403)
    assert not refused(kube, WORKER_ROLE)
    assert kube.job(NS, handle.job_name)["spec"].get("suspend") is not True  # the refused cancel changed nothing
