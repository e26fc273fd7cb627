"""What the EKS backend asks of the apiserver as the cluster and the launch grow, counted from the
real apiserver's audit log: a poll of the deferred watch costs the same requests at any size (the
Job and one list of its pods, paged past listing.WATCH_PAGE_SIZE), and diagnose reads a big launch's
nodes in one list, not a GET each. The sizes at which users run (256 to 1,024 nodes) are in
`make bench` (bench/control_plane/eks_scale.py), not here."""

from __future__ import annotations

import asyncio
from collections import Counter

from fsdp_resilience.control.backends.eks import listing
from fsdp_resilience.training.contract import ExitCode

from control.fakes.eks_cluster import NS, TRIGGERER, WORKER, acting_as, add_gpu_node, backend_for, run_config
from control.support.eks_waits import running_pods, status_when


def requests_by(cluster, user) -> Counter:
    return Counter(f"{r.verb} {r.resource}" for r in cluster.requests if r.user == user.username)


def poll(cluster, backend, handle):
    """One poll of the watch as the triggerer makes it (its token), and the requests it made."""
    cluster.clear_requests()
    with acting_as(cluster, TRIGGERER):
        status = asyncio.run(backend.status_async(handle))
    return status, requests_by(cluster, TRIGGERER)


def test_a_watch_poll_costs_the_same_requests_for_2_or_18_pods_and_pages_its_list(cluster, tmp_path, monkeypatch):
    for i in range(4):
        add_gpu_node(cluster, f"gpu-{i:02d}")
    backend = backend_for(tmp_path)
    small = backend.submit(run_config(tmp_path, run_id="small", nodes=2), "0")
    running_pods(cluster, small.job_name, 2)
    poll(cluster, backend, small)  # the server's version, read once and kept
    status, few = poll(cluster, backend, small)
    assert status.state == "running" and few == Counter({"get jobs": 1, "list pods": 1}), few

    for i in range(4, 22):
        add_gpu_node(cluster, f"gpu-{i:02d}")
    big = backend.submit(run_config(tmp_path, run_id="big", nodes=16, spare_nodes=2), "0")
    running_pods(cluster, big.job_name, 18)
    status, many = poll(cluster, backend, big)
    assert many == few, many
    assert status.state == "running" and len([n for n in status.nodes if n.state == "running"]) == 18

    # Past a page, the same list in pages (limit/continue): every pod still read.
    monkeypatch.setattr(listing, "WATCH_PAGE_SIZE", 5)
    status, paged = poll(cluster, backend, big)
    assert paged == Counter({"get jobs": 1, "list pods": 4}), paged
    assert len([n for n in status.nodes if n.state == "running"]) == 18


def test_diagnose_reads_a_big_launchs_nodes_in_one_list_not_a_get_each(cluster, tmp_path):
    for i in range(12):
        add_gpu_node(cluster, f"gpu-{i:02d}")
    backend = backend_for(tmp_path)
    handle = backend.submit(run_config(tmp_path, nodes=10), "0")
    pod = running_pods(cluster, handle.job_name, 10)[3]
    node = pod["spec"]["nodeName"]
    cluster.set_node_condition(node, "AcceleratedHardwareReady", "False", "NvidiaXID79", "GPU has fallen off the bus")
    cluster.terminate_pod(NS, pod["metadata"]["name"], int(ExitCode.RESTARTS_EXHAUSTED))
    status_when(backend, handle, "failed")
    cluster.clear_requests()
    diagnosis = backend.diagnose(handle)
    assert diagnosis.bad_node_ids == [node], diagnosis.evidence
    asked = requests_by(cluster, WORKER)
    assert asked["get nodes"] == 0 and asked["list nodes"] == 1, asked
