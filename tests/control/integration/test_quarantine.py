"""Quarantined nodes have a way back: listed and returned to service with a recorded reason, by the
CLI (python -m fsdp_resilience.control.quarantine) and the node_maintenance DAG, or automatically after a
cool-down; on the local backend (slots.json) and on EKS (a real Kubernetes control plane with the
deploy kit applied, so the real RBAC authorizer and the kit's node admission policy judge every
write; tests/control/kube)."""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
import time

import pytest

from fsdp_resilience.control import settings
from fsdp_resilience.control.backends import BackendError, get_backend
from fsdp_resilience.control.backends.eks import QUARANTINE_ANNOTATION, QUARANTINE_TAINT, RETURN_ANNOTATION
from fsdp_resilience.control.backends.eks.client import KubeClient
from fsdp_resilience.control.quarantine import format_return

from control.fakes.eks_cluster import NS, TRIGGERER, WORKER, acting_as, add_gpu_node, backend_for
from control.kube.cluster import taint_keys, wait_for
from control.support import REPO


@pytest.fixture()
def local(tmp_path, monkeypatch):
    """The local backend as the DAGs and the CLI build it, on a fresh runs root."""
    monkeypatch.setenv("FSDP_RUNS_ROOT", str(tmp_path / "runs"))
    monkeypatch.delenv("FSDP_DEFAULT_BACKEND", raising=False)
    monkeypatch.delenv("FSDP_QUARANTINE_COOLDOWN_S", raising=False)
    return get_backend(**settings.backend_config("local"))


def slots_record(backend) -> dict:
    return json.loads((backend.state_dir / "slots.json").read_text())["slots"]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fsdp_resilience.control.quarantine", *args], capture_output=True, text=True, timeout=120
    )


# --------------------------------------------------------------------------------------------
# Local backend
# --------------------------------------------------------------------------------------------


def test_the_cli_lists_a_quarantined_slot_and_returns_it_with_the_reason_recorded(local):
    assert local.replace_nodes(["slot-2"], reason="rung 1: restarts_exhausted").replaced == ["slot-2"]

    listed = cli("list")
    assert listed.returncode == 0, listed.stderr
    header, row = listed.stdout.strip().splitlines()
    assert header.split()[:2] == ["NODE", "SINCE"] and "REASON" in header
    assert row.startswith("slot-2 ") and row.endswith("rung 1: restarts_exhausted")

    back = cli("return", "slot-2", "slot-1", "--reason", "fan replaced, burn-in passed")
    assert back.returncode == 0, back.stderr
    assert back.stdout.splitlines() == ["returned to service: slot-2", "slot-1: not quarantined, left as it is"]
    record = slots_record(local)["slot-2"]
    assert record["state"] == "healthy" and record["reason"] == "returned to service: fan replaced, burn-in passed"
    assert record["returned_by"] and record["quarantine_reason"] == "rung 1: restarts_exhausted"
    assert record["quarantined_since"] <= record["since"] <= time.time()
    assert local.capacity().healthy == 4 and local.quarantined_nodes() == []
    assert cli("--backend", "local", "list").stdout.strip() == "no quarantined nodes"


def test_a_return_without_a_reason_or_of_an_unknown_node_is_refused_and_changes_nothing(local):
    local.replace_nodes(["slot-0"], reason="lost")
    missing = cli("return", "slot-0")
    assert missing.returncode == 2 and "--reason" in missing.stderr
    empty = cli("return", "slot-0", "--reason", "  ")
    assert empty.returncode == 2 and "--reason is empty" in empty.stderr
    with pytest.raises(BackendError, match="needs a reason"):
        local.return_nodes(["slot-0"], reason="")
    unknown = cli("return", "slot-9", "slot-0", "--reason", "typo")
    assert unknown.returncode == 1
    assert "unknown local node(s) ['slot-9']" in unknown.stderr and "slot-3" in unknown.stderr
    assert [q["node_id"] for q in local.quarantined_nodes()] == ["slot-0"]  # still out: nothing changed


def test_nodes_quarantined_longer_than_the_cool_down_return_by_themselves(local):
    local.replace_nodes(["slot-1"], reason="no progress")
    (quarantined,) = local.quarantined_nodes()
    since = quarantined["since"]
    assert local.return_expired(3600, now=since + 60) == []
    assert local.return_expired(3600, now=since + 3601) == ["slot-1"]
    record = slots_record(local)["slot-1"]
    assert record["reason"] == "returned to service: automatic return after cool-down of 3600s"
    assert "FSDP_QUARANTINE_COOLDOWN_S" in record["returned_by"]
    with pytest.raises(BackendError, match="positive number of seconds"):
        local.return_expired(0)
    off = cli("return-expired")
    assert off.returncode == 2 and "automatic return is off" in off.stderr


def _dag(monkeypatch=None, **env):
    from airflow.dag_processing.dagbag import DagBag

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    bag = DagBag(dag_folder=str(REPO / "dags" / "node_maintenance.py"))
    assert not bag.import_errors, bag.import_errors
    return bag.dags["node_maintenance"]


def test_the_maintenance_dag_has_typed_described_params_and_runs_only_with_a_cool_down(local, monkeypatch):
    dag = _dag()
    assert dag.schedule is None and dag.catchup is False
    for name, param in dag.params.items():
        assert param.description and ("type" in param.schema or "enum" in param.schema), name
    assert dag.params.get_param("nodes").schema["maxItems"] and dag.params.get_param("reason").schema["maxLength"]
    dag.params.validate()  # the form submits with its defaults (nothing empty is required)
    assert _dag(monkeypatch, FSDP_QUARANTINE_COOLDOWN_S="86400").schedule == datetime.timedelta(minutes=10)


def test_the_maintenance_dag_lists_returns_named_nodes_with_a_reason_and_expired_ones(local, monkeypatch):
    def states(dr):
        return {ti.task_id: str(ti.state) for ti in dr.get_task_instances()}

    local.replace_nodes(["slot-3"], reason="rung 1: lost")
    # A fresh DAG per run: dag.test() leaves a run's conf in its tasks' params (seen with Airflow 3.3.2).
    dr = _dag().test(run_conf={"nodes": ["slot-3"], "reason": "reseated the riser card"})
    assert str(dr.state) == "success", states(dr)
    assert states(dr) == {
        "list_quarantined": "success",
        "return_named_nodes": "success",
        "return_expired_nodes": "skipped",
    }  # cool-down 0: off
    record = slots_record(local)["slot-3"]
    assert record["reason"] == "returned to service: reseated the riser card"
    assert record["returned_by"].startswith("Airflow node_maintenance run ")

    local.replace_nodes(["slot-0"], reason="rung 1: lost")
    refused = _dag().test(run_conf={"nodes": ["slot-0"]})  # no reason
    assert states(refused)["return_named_nodes"] == "failed"
    assert [q["node_id"] for q in local.quarantined_nodes()] == ["slot-0"]

    # With a cool-down, a run that names no node returns the slot quarantined two hours ago.
    slots = slots_record(local)
    slots["slot-0"]["since"] -= 7200
    (local.state_dir / "slots.json").write_text(json.dumps({"slots": slots}))
    monkeypatch.setenv("FSDP_QUARANTINE_COOLDOWN_S", "3600")
    auto = _dag().test()
    assert str(auto.state) == "success" and states(auto) == {
        "list_quarantined": "success",
        "return_named_nodes": "skipped",
        "return_expired_nodes": "success",
    }
    assert local.quarantined_nodes() == []
    assert slots_record(local)["slot-0"]["reason"].endswith("automatic return after cool-down of 3600s")


# --------------------------------------------------------------------------------------------
# EKS: the kit's RBAC and node admission policy enforced, calls as the worker
# --------------------------------------------------------------------------------------------


def test_an_eks_node_returns_uncordoned_and_untainted_keeping_other_taints_with_the_return_recorded(
    cluster, tmp_path, monkeypatch, capsys
):
    from fsdp_resilience.control import quarantine

    for i in range(5):
        add_gpu_node(cluster, f"gpu-{i}")
    # Nodes that joined a while ago: the not-ready taint every new node gets is off again.
    cluster.wait_nodes_ready()
    backend = backend_for(tmp_path, replacement="cordon")
    assert backend.replace_nodes(["gpu-2"], reason="rung 1: restarts_exhausted").replaced == ["gpu-2"]
    (listed,) = backend.quarantined_nodes()
    assert (listed["node_id"], listed["reason"], listed["ready"]) == ("gpu-2", "rung 1: restarts_exhausted", True)
    assert abs(listed["since"] - time.time()) < 120

    # The CLI, as an operator runs it against EKS (the same connection settings as the DAGs').
    monkeypatch.setenv("FSDP_KUBERNETES_CONN_ID", "kubernetes_fake")
    monkeypatch.setenv("FSDP_EKS_NAMESPACE", NS)
    monkeypatch.setenv("FSDP_EKS_POOL_SELECTOR", json.dumps(backend.pool_selector))
    assert quarantine.main(["--backend", "eks", "list"]) == 0
    assert "gpu-2" in capsys.readouterr().out

    # A second writer (Karpenter marking the node for disruption) taints the node between the
    # backend's read and its patch: the apiserver answers 409, the backend reads again, and that
    # taint stays. (Not the node lifecycle controller's unreachable taint: it takes that off a
    # node that is Ready again, as gpu-2 is.)
    disrupted = {"key": "karpenter.sh/disrupted", "effect": "NoSchedule"}
    read_node = KubeClient.get_node
    reads = []

    def get_node_then_taint(self, name):
        node = read_node(self, name)
        if name == "gpu-2" and not reads:
            reads.append(node["metadata"]["resourceVersion"])
            cluster.add_node_taint("gpu-2", disrupted)  # as the admin: a write the backend did not see
        return node

    monkeypatch.setattr(KubeClient, "get_node", get_node_then_taint)
    cluster.clear_requests()
    assert quarantine.main(["return", "gpu-2", "--backend", "eks", "--reason", "GPU reseated, dcgmi diag passed"]) == 0
    assert capsys.readouterr().out.strip() == "returned to service: gpu-2"
    node_patches = [(r.code, r.user) for r in cluster.requests if r.resource == "nodes" and r.verb == "patch"]
    # The return's conflict, then its patch on a fresh read (another 409 if the node lifecycle
    # controller wrote meanwhile), all the worker's.
    codes = [code for code, _ in node_patches]
    assert codes[0] == 409 and codes[-1] == 200 and set(codes[:-1]) == {409}, node_patches
    assert {user for _, user in node_patches} == {WORKER.username}, node_patches
    assert not cluster.node("gpu-2")["spec"].get("unschedulable")
    # The lifecycle controller's own taint for the cordon (node.kubernetes.io/unschedulable) is
    # its to take off, once it sees the node uncordoned; the backend leaves it, as kubectl does.
    node = wait_for(
        lambda: "node.kubernetes.io/unschedulable" not in taint_keys(n := cluster.node("gpu-2")) and n,
        what="the lifecycle controller's unschedulable taint off the returned node",
    )
    assert sorted(taint_keys(node)) == ["karpenter.sh/disrupted", "nvidia.com/gpu"]
    annotations = node["metadata"]["annotations"]
    assert QUARANTINE_ANNOTATION not in annotations
    record = json.loads(annotations[RETURN_ANNOTATION])
    assert record["reason"] == "GPU reseated, dcgmi diag passed" and record["by"]
    assert record["quarantine"].endswith(" rung 1: restarts_exhausted")
    assert backend.quarantined_nodes() == [] and "gpu-2" not in backend.capacity().quarantined

    # A node a person cordoned is not this project's to uncordon: the backend leaves it, and the
    # admission policy refuses the worker's uncordon of it anyway.
    add_gpu_node(cluster, "gpu-held", unschedulable=True)
    held = backend.return_nodes(["gpu-held"], reason="not ours")
    assert held.not_quarantined == ["gpu-held"] and not held.returned
    import kubernetes

    worker = kubernetes.config.new_client_from_config(
        config_file=str(cluster.kubeconfig(tmp_path / "worker", namespace=NS, user=WORKER))
    )
    with pytest.raises(kubernetes.client.ApiException) as denied:
        kubernetes.client.CoreV1Api(worker).patch_node("gpu-held", {"spec": {"unschedulable": None}})
    assert denied.value.status == 403 and "may uncordon only a node it quarantined" in str(denied.value.body)
    assert cluster.node("gpu-held")["spec"]["unschedulable"] is True


def test_an_eks_node_that_is_gone_is_reported_and_an_expired_one_returns(cluster, tmp_path):
    for i in range(5):
        add_gpu_node(cluster, f"gpu-{i}")
    backend = backend_for(tmp_path, replacement="cordon")
    backend.replace_nodes(["gpu-1"], reason="lost")
    backend.replace_nodes(["gpu-3"], reason="no progress")
    cluster.remove_node("gpu-1")  # its Auto Scaling group replaced it
    result = backend.return_nodes(["gpu-1"], reason="repaired")
    assert result.gone == ["gpu-1"] and result.returned == [] and "gone" in format_return(result)
    assert [q["node_id"] for q in backend.quarantined_nodes()] == ["gpu-3"]
    assert backend.return_expired(3600) == []
    assert backend.return_expired(3600, now=time.time() + 3700) == ["gpu-3"]
    reason = json.loads(cluster.node("gpu-3")["metadata"]["annotations"][RETURN_ANNOTATION])["reason"]
    assert reason == "automatic return after cool-down of 3600s"


def test_the_triggerer_cannot_return_an_eks_node(cluster, tmp_path):
    for i in range(5):
        add_gpu_node(cluster, f"gpu-{i}")
    backend = backend_for(tmp_path, replacement="cordon")
    backend.replace_nodes(["gpu-0"], reason="lost")
    with acting_as(cluster, TRIGGERER), pytest.raises(BackendError, match=r"forbidden .*airflow-triggerer lacks"):
        backend.return_nodes(["gpu-0"], reason="not the triggerer's call")
    node = cluster.node("gpu-0")
    assert node["spec"]["unschedulable"] is True and any(t["key"] == QUARANTINE_TAINT for t in node["spec"]["taints"])
    # The real authorizer refused the triggerer's first call (its read of the node); no patch followed.
    asked = [(r.verb, r.resource, r.code) for r in cluster.requests if r.user == TRIGGERER.username]
    assert asked == [("get", "nodes", 403)], asked
