"""The deploy kit's RBAC and the EKS backend agree: every API call the backend makes is granted to
the Airflow service accounts, and nothing is granted that the backend never calls.

The backend's calls are not listed by hand: a session that uses every backend method (in both
replacement modes that talk to Kubernetes) runs against the fake apiserver, which records each
request as an RBAC (apiGroup, resource, verb); the grants come from the rendered kit
(deploy/render.py, kubectl's kustomize).
"""

from __future__ import annotations

import sys
import threading

import pytest

from conftest import REPO
from eks_cluster import NS, add_gpu_node, asg_instances, commit_checkpoint, make_asg, wait_for
from test_eks_backend import backend_for, run_config
from training.contract import ExitCode

sys.path.insert(0, str(REPO / "deploy"))
render = pytest.importorskip("render")

AIRFLOW_NAMESPACE, WORKER = "airflow", "airflow-worker"


def exercise(cluster, tmp_path, replacement: str) -> None:
    """Every backend method, on a job that fails on one node, then an evaluation."""
    for i, instance in enumerate(make_asg(f"rbac-{replacement}", 3) if replacement == "asg" else [None] * 3):
        add_gpu_node(cluster, f"{replacement}-gpu-{i}", instance)
        if replacement == "karpenter":
            cluster.add_nodeclaim(f"{replacement}-claim-{i}", f"{replacement}-gpu-{i}")
    backend = backend_for(tmp_path, replacement=replacement, max_unhealthy_share=0.5, evaluation_poll_s=0.05)
    cfg = run_config(tmp_path, run_id=f"rbac-{replacement}", nodes=2)
    handle = backend.submit(cfg, "0")
    backend.status(handle)
    backend.logs(handle)
    pods = cluster.pods(NS, handle.job_name)
    cluster.terminate_pod(NS, pods[0]["metadata"]["name"], int(ExitCode.RESTARTS_EXHAUSTED))
    backend.diagnose(handle)
    backend.capacity()
    other = backend.submit(run_config(tmp_path, run_id=f"rbac-{replacement}-2", nodes=1), "0")
    node = cluster.pods(NS, other.job_name)[0]["spec"]["nodeName"]
    replaced = backend.replace_nodes([node], reason="rbac session")  # evicts the running pod
    assert replaced.replaced == [node], replaced.reason
    third = backend.submit(run_config(tmp_path, run_id=f"rbac-{replacement}-3", nodes=1), "0")
    backend.cancel(third)

    commit_checkpoint(cfg.run_dir, 5, world_size=16)

    def fail_the_evaluation():
        pod = wait_for(lambda: [p for p in cluster.pods(NS) if "eval" in p["metadata"]["name"]
                                and p["status"]["phase"] == "Running"], what="the eval pod")[0]
        cluster.terminate_pod(NS, pod["metadata"]["name"], 1)

    threading.Thread(target=fail_the_evaluation, daemon=True).start()
    with pytest.raises(Exception, match="evaluation job"):
        backend.run_evaluation(cfg, timeout_s=30)  # a failed evaluation reads its pod's log


def used_by_backend(cluster) -> dict[tuple[str, str], set[str]]:
    used: dict[tuple[str, str], set[str]] = {}
    for r in cluster.requests:
        assert r.namespace in ("", None, NS), f"the backend called outside its namespace: {r}"
        resource = f"{r.resource}/{r.subresource}" if r.subresource else r.resource
        used.setdefault((r.api_group, resource), set()).add(r.verb)
    return used


def granted(overlay: str) -> dict[tuple[str, str], set[str]]:
    objects = render.render(REPO / "deploy" / "overlays" / overlay)
    grants = render.rbac_grants(objects, AIRFLOW_NAMESPACE, WORKER)
    out: dict[tuple[str, str], set[str]] = {k: set(v) for k, v in grants.cluster.items()}
    for key, verbs in grants.namespaced.get(NS, {}).items():
        out.setdefault(key, set()).update(verbs)
    return out


@pytest.mark.parametrize("replacement, overlay", [("asg", "example"), ("karpenter", "example-karpenter")])
def test_the_kits_rbac_grants_exactly_what_the_backend_calls(cluster, tmp_path, aws, replacement, overlay):
    exercise(cluster, tmp_path, replacement)
    used, allowed = used_by_backend(cluster), granted(overlay)
    missing = {k: v - allowed.get(k, set()) for k, v in used.items() if v - allowed.get(k, set())}
    unused = {k: v - used.get(k, set()) for k, v in allowed.items() if v - used.get(k, set())}
    assert not missing, f"the backend calls what deploy/ does not grant: {missing}"
    assert not unused, f"deploy/ grants what the backend never calls: {unused}"
    if replacement == "asg":
        assert len(asg_instances(f"rbac-{replacement}")) == 3  # the group replaced the instance it terminated
