"""The backend's Karpenter replacement mode (``replacement="karpenter"``) against real Karpenter:
its kwok cloud provider (tests/control/kube/karpenter.py) on the real control plane, with the
deploy kit's overlay example-karpenter (the worker may list NodeClaims and delete those of the
NodePool ``gpu``, an admission policy says so).

The kit's example NodePool ``gpu`` (deploy/overlays/example-karpenter/gpu-nodepool: its pool
label, GPU taint and disruption settings; a KWOKNodeClass for its EC2NodeClass) has
Karpenter provision p5.48xlarge nodes for the pending pods of a launch; the backend replaces a bad
node by deleting its NodeClaim as the worker; Karpenter drains and terminates that node, and the
relaunch's pod that no longer fits brings a new NodeClaim and Node, where it runs.

Karpenter batches pending pods, creates a NodeClaim, then the Node (kwok runs it), registers and
initialises it: each step takes seconds on a loaded machine, so the waits are generous."""

from __future__ import annotations

from fsdp_resilience.training.contract import ExitCode

from control.fakes.eks_cluster import (
    NS,
    WORKER,
    backend_for,
    run_config,
    start_strict_cluster,
    wait_for,
)
from control.kube.karpenter import CLAIMS, karpenter_nodes

INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
#: Karpenter: provision, launch, register, initialise; kwok: Ready; the scheduler: bind; kwok: run.
PROVISION_TIMEOUT = 240


def running_on(kube, karpenter, job_name: str, count: int) -> dict[int, str]:
    """Node of each pod index once ``count`` pods of the Job run (on a timeout, Karpenter's log says
    how far it got)."""

    def placed():
        karpenter.check_alive()
        pods = [
            p
            for p in kube.pods(NS, job_name)
            if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
        ]
        return len(pods) == count and {int(p["metadata"]["labels"][INDEX_LABEL]): p["spec"]["nodeName"] for p in pods}

    try:
        return wait_for(placed, timeout=PROVISION_TIMEOUT, what=f"{count} running pods of {job_name}", interval=1.0)
    except AssertionError as e:
        raise AssertionError(f"{e}; Karpenter's log ends:\n{karpenter.log_tail()}") from None


def test_karpenter_replaces_the_node_whose_nodeclaim_the_backend_deleted(kube, gpu_pool, karpenter, tmp_path,
                                                                         monkeypatch):  # fmt: skip
    cluster = start_strict_cluster(kube, tmp_path, monkeypatch, "example-karpenter")
    backend = backend_for(tmp_path, replacement="karpenter", max_unhealthy_share=1.0)
    cfg = run_config(tmp_path, nodes=2)
    assert backend.capacity().provisions_on_demand

    # No node yet: the launch's pods are pending, and Karpenter provisions a node for each
    # (the pods' anti-affinity puts one on a node).
    handle = backend.submit(cfg, "0")
    first = running_on(cluster, karpenter, handle.job_name, 2)
    made = karpenter_nodes(cluster)
    assert set(first.values()) <= set(made), (first, sorted(made))
    for name in first.values():
        node = made[name]
        assert node["metadata"]["labels"]["fsdp-resilience/pool"] == "gpu"
        assert node["metadata"]["labels"]["node.kubernetes.io/instance-type"] == "p5.48xlarge"
        assert node["metadata"]["annotations"]["kwok.x-k8s.io/node"] == "fake"  # kwok runs it
        assert {"key": "nvidia.com/gpu", "effect": "NoSchedule"} in node["spec"]["taints"]  # the example's
        assert node["status"]["allocatable"]["nvidia.com/gpu"] == "8"
    claim_of = {c["status"].get("nodeName"): c for c in cluster.get(CLAIMS)["items"]}
    bad, good = first[1], first[0]
    bad_claim = claim_of[bad]["metadata"]["name"]
    assert claim_of[bad]["metadata"]["labels"]["karpenter.sh/nodepool"] == "gpu"

    # Node 1's GPUs fail: its launcher exhausts its restarts, the launch fails.
    cluster.terminate_pod(NS, next(p["metadata"]["name"] for p in cluster.pods(NS, handle.job_name)
                                   if p["spec"]["nodeName"] == bad), int(ExitCode.RESTARTS_EXHAUSTED))  # fmt: skip
    wait_for(lambda: backend.status(handle).state == "failed", timeout=120, what="launch 0 failed")

    # The backend replaces it: cordon, taint, and delete its NodeClaim, as the worker (the kit's
    # admission policy allows it: the claim is the gpu NodePool's).
    cluster.clear_requests()
    replacement = backend.replace_nodes([bad], reason="uncorrectable ECC errors")
    assert replacement.replaced == [bad], replacement.reason
    deletes = [r for r in cluster.requests if (r.resource, r.verb) == ("nodeclaims", "delete")]
    assert [(r.name, r.user, r.code) for r in deletes] == [(bad_claim, WORKER.username, 200)]

    # Karpenter drains and terminates the node, then lets the claim go.
    wait_for(lambda: not cluster.exists(f"/api/v1/nodes/{bad}"), timeout=PROVISION_TIMEOUT,
             what=f"Karpenter to terminate node {bad}", interval=1.0)  # fmt: skip
    wait_for(lambda: not cluster.exists(f"{CLAIMS}/{bad_claim}"), timeout=60, what=f"NodeClaim {bad_claim} gone")

    # The relaunch: one pod fits on the good node, the other is pending until Karpenter brings a
    # new node (a new NodeClaim), where it runs.
    relaunch = backend.submit(cfg, "1")
    second = running_on(cluster, karpenter, relaunch.job_name, 2)
    assert good in second.values() and bad not in second.values(), second
    new = next(n for n in second.values() if n != good)
    assert new in karpenter_nodes(cluster) and new not in first.values()
    new_claim = next(c for c in cluster.get(CLAIMS)["items"] if c["status"].get("nodeName") == new)
    assert new_claim["metadata"]["name"] != bad_claim
    assert new_claim["metadata"]["labels"]["karpenter.sh/nodepool"] == "gpu"
    wait_for(lambda: backend.status(relaunch).state == "running", timeout=60, what="launch 1 running")
    cluster.succeed_pods(NS, relaunch.job_name)
