"""A launch's PodDisruptionBudget (eks/disruption.py) on the real control plane: the Eviction API and
the disruption controller run for real. Another identity's eviction of a training pod (what
``kubectl drain``, a managed node group upgrade or Karpenter's drift/consolidation sends) is
refused with 429 while the launch runs; the backend's own replace_nodes still evicts our pod off a
quarantined node (lowering the budget by one around its eviction and putting it back) and the
replacement proceeds (its NodeClaim deleted); the budget goes with its Job."""

from __future__ import annotations

from fsdp_resilience.control.backends.eks.disruption import INTENDED_ANNOTATION

from control.fakes.eks_cluster import NS, add_gpu_node, backend_for, run_config, start_strict_cluster, wait_for
from control.support.eks_waits import api_client, running_pods

PDBS = f"/apis/policy/v1/namespaces/{NS}/poddisruptionbudgets"


def admin_eviction(tmp_path, kube, pod_name: str) -> Exception | None:
    """An eviction as the cluster's administrator, as ``kubectl drain`` sends it (no retry of a
    429): the ApiException it met, or None if the pod was evicted."""
    from kubernetes import client

    body = client.V1Eviction(metadata=client.V1ObjectMeta(name=pod_name, namespace=NS))
    try:
        client.CoreV1Api(api_client(kube, tmp_path)).create_namespaced_pod_eviction(pod_name, NS, body)
    except client.ApiException as e:
        return e
    return None


def test_others_cannot_evict_a_running_launch_the_backends_replacement_can_and_the_budget_goes_with_its_job(
    kube, tmp_path, monkeypatch
):
    start_strict_cluster(kube, tmp_path, monkeypatch, "example-karpenter")
    for i in range(3):
        add_gpu_node(kube, f"gpu-{i}")
        kube.add_nodeclaim(f"claim-{i}", f"gpu-{i}", nodepool="gpu")
    backend = backend_for(tmp_path, replacement="karpenter")
    handle = backend.submit(run_config(tmp_path, run_id="pdb", nodes=2), "0")
    pods = running_pods(kube, handle.job_name, 2)
    job = kube.job(NS, handle.job_name)

    pdb = wait_for(
        lambda: (
            (b := kube.get(f"{PDBS}/{handle.job_name}"))
            and (b.get("status") or {}).get("currentHealthy") == 2
            and b["status"].get("observedGeneration") == b["metadata"]["generation"]
            and b
        ),
        what="the launch's budget seen by the disruption controller",
    )
    assert pdb["spec"]["minAvailable"] == 2 and pdb["status"]["disruptionsAllowed"] == 0
    assert pdb["spec"]["selector"] == {"matchLabels": {"fsdp-resilience/job-name": handle.job_name}}
    assert pdb["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["uid"]

    # Someone else's drain: refused while the launch runs, and the pod keeps running.
    victim, other = pods[1], pods[0]
    error = admin_eviction(tmp_path, kube, victim["metadata"]["name"])
    assert error is not None and error.status == 429, error
    assert f"The disruption budget {handle.job_name} needs 2 healthy pods" in str(error.body)
    assert kube.pod(NS, victim["metadata"]["name"])["status"]["phase"] == "Running"

    # The backend's own replacement passes: the pod leaves through the Eviction API.
    node = victim["spec"]["nodeName"]
    kube.clear_requests()
    replaced = backend.replace_nodes([node], reason="GPU fell off the bus")
    assert replaced.replaced == [node], replaced.reason
    assert f"evicted ['{victim['metadata']['name']}']" in replaced.reason and "deleted NodeClaim" in replaced.reason
    gone = wait_for(
        lambda: (
            all(
                p["metadata"]["name"] != victim["metadata"]["name"] or p["metadata"].get("deletionTimestamp")
                for p in kube.pods(NS, handle.job_name)
            )
            or None
        ),  # fmt: skip
        what="the evicted pod gone or terminating",
    )
    assert gone
    pdb = kube.get(f"{PDBS}/{handle.job_name}")
    assert pdb["spec"]["minAvailable"] == 2 == int(pdb["metadata"]["annotations"][INTENDED_ANNOTATION])
    worker = [r for r in kube.requests if r.user.startswith("system:serviceaccount:airflow")]
    used = {(r.resource, r.subresource, r.verb) for r in worker}
    assert {("pods", "eviction", "create"), ("poddisruptionbudgets", "", "patch")} <= used
    assert not [r for r in worker if r.resource == "pods" and r.verb == "delete"]  # no pods/delete needed

    # The other pod is still protected once the budget is back.
    wait_for(
        lambda: (
            (b := kube.get(f"{PDBS}/{handle.job_name}"))["status"].get("observedGeneration")
            == b["metadata"]["generation"]
        ),
        what="the restored budget processed",
    )
    error = admin_eviction(tmp_path, kube, other["metadata"]["name"])
    assert error is not None and error.status == 429, error

    # The budget goes with its Job (owner reference; the garbage collector).
    kube.api(
        "DELETE", f"/apis/batch/v1/namespaces/{NS}/jobs/{handle.job_name}", query={"propagationPolicy": "Background"}
    )
    wait_for(lambda: not kube.exists(f"{PDBS}/{handle.job_name}"), what="the budget gone with its Job")
