"""Waiting for what the real control plane does by itself, for the EKS backend's tests: the Job
controller creates pods, the scheduler binds them and kwok starts them, and a Job's status follows
its pods a moment later. Each helper polls the apiserver until the state it names is there."""

from __future__ import annotations

import time

from fsdp_resilience.training.contract import RunConfig

from control.fakes.eks_cluster import NS, run_config, wait_for

INDEX_LABEL = "batch.kubernetes.io/job-completion-index"


def index_of(pod: dict) -> int:
    return int(pod["metadata"]["labels"][INDEX_LABEL])


def live(pod: dict) -> bool:
    return pod["status"].get("phase") in ("Pending", "Running") and not pod["metadata"].get("deletionTimestamp")


def running_pods(cluster, job_name: str, count: int, timeout: float = 90) -> list[dict]:
    """The Job's pods once ``count`` of them run (created by the Job controller, bound by the
    scheduler, started by kwok), by index."""
    return wait_for(
        lambda: (
            len(pods := [p for p in cluster.pods(NS, job_name) if live(p) and p["status"]["phase"] == "Running"])
            == count
            and sorted(pods, key=index_of)
        ),
        timeout=timeout,
        what=f"{count} running pod(s) of job {job_name}",
    )


def status_when(backend, handle, state: str, timeout: float = 90):
    """The launch's status once it reads ``state`` (the Job controller updates a Job's status a
    moment after its pods changed); on a timeout, the last status read says where it stood."""
    seen = []

    def reached():
        seen[:] = [backend.status(handle)]
        return seen[0].state == state and seen[0]

    try:
        return wait_for(reached, timeout=timeout, what=f"job {handle.job_name} {state}")
    except AssertionError as e:
        raise AssertionError(f"{e}; it stayed {seen[0].state}: {seen[0].message}") from None


def job_failed(cluster, job_name: str, timeout: float = 90) -> dict:
    """The Job once the Job controller wrote its Failed condition (the backend may read the launch
    failed from its pods before)."""
    return wait_for(
        lambda: (
            (j := cluster.job(NS, job_name))
            and any(c["type"] == "Failed" and c["status"] == "True" for c in j["status"].get("conditions") or [])
            and j
        ),
        timeout=timeout,
        what=f"job {job_name} Failed",
    )


def next_second() -> None:
    """Until the clock's second changed: objects made after this are later in whole seconds (the
    apiserver's timestamps)."""
    now = int(time.time())
    wait_for(lambda: int(time.time()) > now, timeout=5, what="the next second", interval=0.05)


def api_client(cluster, tmp_path):
    """A plain client as the admin, to look and to play another actor (a first try that died)."""
    from kubernetes import config

    return config.new_client_from_config(str(cluster.kubeconfig(tmp_path / "admin-kubeconfig")))


def launch_objects(cluster, tmp_path) -> dict[str, list[str]]:
    """The names of the Jobs, Services and NetworkPolicies the backend made in the training
    namespace (not the kit's default-deny-ingress policy)."""
    from kubernetes import client

    api = api_client(cluster, tmp_path)
    return {
        "jobs": [j.metadata.name for j in client.BatchV1Api(api).list_namespaced_job(NS).items],
        "services": [s.metadata.name for s in client.CoreV1Api(api).list_namespaced_service(NS).items],
        "networkpolicies": [
            p.metadata.name
            for p in client.NetworkingV1Api(api).list_namespaced_network_policy(NS).items
            if p.metadata.name != "default-deny-ingress"
        ],
    }


def spare_run(tmp_path, run_id="spare", **kw) -> RunConfig:
    return run_config(tmp_path, run_id=run_id, nodes=2, spare_nodes=1, restart_mode="layered", **kw)


def pods_by_index(cluster, job_name: str) -> dict[int, dict]:
    """The Job's live pods (not ended, not being deleted) by completion index."""
    return {index_of(p): p for p in cluster.pods(NS, job_name) if live(p)}


def running_by_index(cluster, job_name: str, indexes=(0, 1, 2), timeout: float = 120) -> dict[int, dict]:
    """The Job's pods by index once every index in ``indexes`` has a running one."""
    return wait_for(
        lambda: (
            (pods := {i: p for i, p in pods_by_index(cluster, job_name).items() if p["status"]["phase"] == "Running"})
            and set(indexes) <= set(pods)
            and pods
        ),
        timeout=timeout,
        what=f"running pods for indexes {list(indexes)} of job {job_name}",
    )


def failed_count(cluster, job_name: str, count: int) -> dict:
    """The Job once its status counts ``count`` failed pods."""
    return wait_for(
        lambda: (j := cluster.job(NS, job_name))["status"].get("failed", 0) == count and j,
        what=f"job {job_name} to count {count} failed pod(s)",
    )


def true_conditions(job: dict) -> set[str]:
    return {c["type"] for c in (job.get("status") or {}).get("conditions") or [] if c["status"] == "True"}
