"""The harness itself: the real control plane runs, kwok plays nodes and pods as the EKS tests
need, and what a test reads (tokens, audit records) is what the apiserver did."""

from __future__ import annotations

import pytest

from control.kube.cluster import ApiError, service_account_user, wait_for

NS = "harness-check"
#: Every test here runs on both Kubernetes versions (make test-control).
pytestmark = pytest.mark.every_kube_version


def _job(name: str, completions: int = 1, **spec) -> dict:
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name},
        "spec": {
            "completions": completions,
            "parallelism": completions,
            "completionMode": "Indexed",
            "backoffLimit": 0,
            "template": {
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [{"name": "main", "image": "busybox", "command": ["true"]}],
                }
            },
            **spec,
        },
    }


def test_a_job_pod_runs_until_the_test_ends_it_with_an_exit_code(kube):
    kube.ensure_namespace(NS)
    kube.add_node("node-a")
    kube.api("POST", f"/apis/batch/v1/namespaces/{NS}/jobs", _job("exit-code"))
    pod = wait_for(lambda: kube.pods(NS, "exit-code"), what="the Job's pod")[0]
    name = pod["metadata"]["name"]
    running = kube.wait_running(NS, name)
    assert running["spec"]["nodeName"] == "node-a"  # bound by the real scheduler
    assert kube.job(NS, "exit-code")["status"].get("succeeded") is None  # kwok does not end it by itself
    ended = kube.terminate_pod(NS, name, 42)
    assert ended["status"]["phase"] == "Failed"
    assert ended["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 42
    job = wait_for(
        lambda: (j := kube.job(NS, "exit-code")).get("status", {}).get("failed") and j, what="the Job to count it"
    )
    assert any(c["type"] == "Failed" and c["status"] == "True" for c in job["status"]["conditions"])


def test_a_lost_node_goes_unreachable_and_its_pods_fail_once_the_node_is_deleted(kube):
    kube.ensure_namespace(NS)
    kube.add_node("node-b")
    kube.add_node("node-c", unschedulable=True)  # a healthy zone, so the controller evicts
    toleration = {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute",
                  "tolerationSeconds": 1}  # fmt: skip
    job = _job("lost")
    job["spec"]["template"]["spec"]["tolerations"] = [toleration]
    kube.api("POST", f"/apis/batch/v1/namespaces/{NS}/jobs", job)
    pod = wait_for(lambda: kube.pods(NS, "lost"), what="the Job's pod")[0]
    kube.wait_running(NS, pod["metadata"]["name"])
    kube.lose_node("node-b")
    node = kube.node("node-b")
    ready = next(c for c in node["status"]["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "Unknown"
    assert kube.pod(NS, pod["metadata"]["name"])["metadata"].get("deletionTimestamp")
    kube.remove_node("node-b")
    failed = kube.pods(NS, "lost")
    assert [p["status"]["phase"] for p in failed if p["metadata"]["name"] == pod["metadata"]["name"]] in (
        ["Failed"],
        [],
    )


def test_a_service_account_token_is_authorized_by_rbac(kube):
    user = service_account_user("harness-sa", "nobody")
    token = kube.token_for(user)
    with pytest.raises(ApiError) as refused:
        kube.api("GET", "/api/v1/nodes", token=token)
    assert refused.value.status == 403
    assert "system:serviceaccount:harness-sa:nobody" in str(refused.value)
    forbidden = [r for r in kube.requests if r.resource == "nodes" and r.verb == "list"]
    assert forbidden and forbidden[-1].user == user.username and forbidden[-1].code == 403


def test_the_apiserver_serves_the_version_the_run_asked_for(kube, control_plane):
    import os

    version = kube.get("/version")
    assert version["gitVersion"] == control_plane.version()
    emulated = os.environ.get("KUBE_EMULATED_VERSION")
    served = f"{version.get('emulationMajor', version['major'])}.{version.get('emulationMinor', version['minor'])}"
    assert served == (emulated or control_plane.version().lstrip("v").rsplit(".", 1)[0])
    # The Job API the backend relies on is there at both versions (successPolicy is GA since 1.33).
    job = _job("probe", completions=2, successPolicy={"rules": [{"succeededCount": 1}]})
    kube.ensure_namespace(NS)
    created = kube.api("POST", f"/apis/batch/v1/namespaces/{NS}/jobs", job, query={"fieldValidation": "Strict"})
    assert created["spec"]["successPolicy"] == {"rules": [{"succeededCount": 1}]}
