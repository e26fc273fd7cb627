"""Where the training pods land and what they carry, on the real control plane (kube-apiserver,
kube-scheduler, the Job controller, kwok nodes shaped like p5.48xlarge, the deploy kit applied):

- one launch's pods share one availability zone (EFA works only within a subnet), by a required
  pod affinity to each other: the first pod starts the group wherever it fits, and the others follow
  it even when another zone has more free nodes; ``zone`` pins them to a given zone;
- the pods carry Karpenter's do-not-disrupt annotation;
- a launch whose /dev/shm cannot hold the model's checkpoint staging, or cannot fit the pod's
  memory, is refused before any object is created.
"""

from __future__ import annotations

import pytest

from fsdp_resilience.control.backends import BackendError

from control.fakes.eks_cluster import NS, REGION, add_gpu_node, backend_for, run_config
from control.kube.cluster import ApiError, wait_for
from control.support.eks_waits import launch_objects, running_pods

ZONE = "topology.kubernetes.io/zone"
ZONE_A, ZONE_B = f"{REGION}a", f"{REGION}b"
#: A taint the pods do not tolerate: the node exists, counts as capacity, and takes no pod yet.
HOLD = {"key": "example.com/maintenance", "value": "true", "effect": "NoSchedule"}


def zone_node(cluster, name: str, zone: str, *, held: bool = False) -> None:
    """A p5-shaped node of the GPU pool in ``zone`` (``held``: tainted with HOLD)."""
    add_gpu_node(cluster, name)
    if zone != ZONE_A:  # add_gpu_node's zone
        cluster.patch(f"/api/v1/nodes/{name}", {"metadata": {"labels": {ZONE: zone}}}, "merge")
    if held:
        hold(cluster, name, True)


def hold(cluster, name: str, held: bool) -> None:
    """Put HOLD on the node or take it off: a read-modify-write with resourceVersion, again on a
    conflict (the node lifecycle controller writes taints too)."""

    def attempt():
        node = cluster.node(name)
        taints = [t for t in node["spec"].get("taints") or [] if t["key"] != HOLD["key"]] + ([HOLD] if held else [])
        body = {"metadata": {"resourceVersion": node["metadata"]["resourceVersion"]}, "spec": {"taints": taints}}
        try:
            return cluster.patch(f"/api/v1/nodes/{name}", body, "merge")
        except ApiError as e:
            if e.status == 409:
                return None
            raise

    wait_for(attempt, what=f"HOLD {'on' if held else 'off'} node {name}")


def zones_of(cluster, pods: list[dict]) -> set[str]:
    return {cluster.node(p["spec"]["nodeName"])["metadata"]["labels"][ZONE] for p in pods}


def scheduling_message(cluster, job_name: str) -> str:
    """The scheduler's latest reason for the Job's unscheduled pod ('' while none is waiting)."""
    for pod in cluster.pods(NS, job_name):
        if not pod["spec"].get("nodeName"):
            for c in pod["status"].get("conditions") or []:
                if c["type"] == "PodScheduled" and c["status"] == "False":
                    return c.get("message", "")
    return ""


def test_the_launchs_pods_follow_the_first_pods_zone_even_where_another_has_more_free_nodes(cluster, tmp_path):
    """Zone a has one free node, zone b four (held at first, so the first pod can only go to a).
    The first pod schedules with no pod of its launch anywhere yet (the self-affinity rule); once b
    is free, the second pod still refuses it ("didn't match pod affinity rules") and waits for a
    node in a, where it lands as soon as one joins. Each pod carries do-not-disrupt."""
    zone_node(cluster, "gpu-a-0", ZONE_A)
    for i in range(4):
        zone_node(cluster, f"gpu-b-{i}", ZONE_B, held=True)
    handle = backend_for(tmp_path).submit(run_config(tmp_path, run_id="zone", nodes=2), "0")

    (first,) = running_pods(cluster, handle.job_name, 1)
    assert first["spec"]["nodeName"] == "gpu-a-0"
    for i in range(4):
        hold(cluster, f"gpu-b-{i}", False)
    message = wait_for(
        lambda: (
            "4 node(s) didn't match pod affinity rules" in (m := scheduling_message(cluster, handle.job_name)) and m
        ),
        what="the scheduler refusing zone b's four free nodes to the second pod",
    )
    assert "1 Insufficient nvidia.com/gpu" in message, message  # gpu-a-0 holds the first pod

    zone_node(cluster, "gpu-a-1", ZONE_A)
    pods = running_pods(cluster, handle.job_name, 2)
    assert sorted(p["spec"]["nodeName"] for p in pods) == ["gpu-a-0", "gpu-a-1"]
    assert zones_of(cluster, pods) == {ZONE_A}
    assert all(p["metadata"]["annotations"]["karpenter.sh/do-not-disrupt"] == "true" for p in pods)


def test_a_pinned_zone_places_every_pod_there(cluster, tmp_path):
    """Two free nodes in each zone: an unpinned launch takes one zone whole; a launch pinned to the
    other zone (PodTemplateSettings.zone) lands there."""
    for zone in (ZONE_A, ZONE_B):
        for i in range(2):
            zone_node(cluster, f"gpu-{zone[-1]}-{i}", zone)
    free = backend_for(tmp_path).submit(run_config(tmp_path, run_id="unpinned", nodes=2), "0")
    (taken,) = zones_of(cluster, running_pods(cluster, free.job_name, 2))
    other = ZONE_B if taken == ZONE_A else ZONE_A
    pinned = backend_for(tmp_path, pod={"zone": other}).submit(run_config(tmp_path, run_id="pinned", nodes=2), "0")
    pods = running_pods(cluster, pinned.job_name, 2)
    assert zones_of(cluster, pods) == {other}
    assert pods[0]["spec"]["nodeSelector"][ZONE] == other


@pytest.mark.parametrize(
    "pod, says",
    [
        (
            {"shm_size": "64Gi"},
            r"shm_size='64Gi' cannot hold what model 8b on 2 node\(s\) x 8 rank\(s\) keeps in /dev/shm",
        ),
        ({"memory": "100Gi"}, r"/dev/shm of 119Gi is more than their memory='100Gi'"),
        ({"memory": "2000Gi"}, r"memory='2000Gi' is more than a p5.48xlarge node can give a pod"),
    ],
    ids=["shm-too-small", "shm-over-memory", "memory-over-node"],
)
def test_a_launch_whose_memory_cannot_fit_is_refused_before_any_object(cluster, tmp_path, pod, says):
    """8b under HSDP stages about 87 GiB a node in /dev/shm: the old 64Gi default, a pod memory
    below the computed /dev/shm, or more memory than a p5 gives, is refused by the launch check,
    and nothing reaches the apiserver."""
    add_gpu_node(cluster, "gpu-0")
    add_gpu_node(cluster, "gpu-1")
    cluster.clear_requests()
    with pytest.raises(BackendError, match=says):
        backend_for(tmp_path, pod=pod).submit(run_config(tmp_path, run_id="big", model="8b"), "0")
    assert not [r for r in cluster.requests if r.verb == "create" and r.namespace == NS]
    assert launch_objects(cluster, tmp_path) == {"jobs": [], "services": [], "networkpolicies": []}
