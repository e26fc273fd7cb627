"""What EksBackend.submit checks before it creates a launch's Job (eks/launch_checks.py): no other
active launch of the run, enough healthy nodes, and the ServiceAccount and FSx claim the pods name.
No cluster: the Kubernetes client is a stand-in that answers from dicts (the real calls are
test_eks_backend.py's)."""

from __future__ import annotations

import pytest

from fsdp_resilience.control.backends.base import BackendError, Capacity, InsufficientCapacityError, JobConflictError
from fsdp_resilience.control.backends.eks.constants import COMPONENT_TRAINING, LABEL_COMPONENT, LABEL_RUN
from fsdp_resilience.control.backends.eks.launch_checks import check_capacity, check_no_other_launch, check_references
from fsdp_resilience.control.backends.eks.pod_settings import PodTemplateSettings
from fsdp_resilience.training.contract import RunConfig


class StandInKube:
    def __init__(self, jobs=(), service_accounts=(), claims=()):
        self.jobs, self.service_accounts, self.claims = list(jobs), set(service_accounts), set(claims)
        self.selectors: list[str] = []

    def list_jobs(self, selector):
        self.selectors.append(selector)
        return self.jobs

    def get_service_account(self, name):
        return {"metadata": {"name": name}} if name in self.service_accounts else None

    def get_claim(self, name):
        return {"metadata": {"name": name}} if name in self.claims else None


def job(name: str, *conditions: str) -> dict:
    return {
        "metadata": {"name": name},
        "status": {"conditions": [{"type": c, "status": "True"} for c in conditions]},
    }


def test_another_active_launch_of_the_run_is_refused_a_finished_one_or_the_same_job_is_not():
    kube = StandInKube(jobs=[job("r-run-0", "Failed"), job("r-run-1")])
    check_no_other_launch(kube, "run", "r-run-1")  # itself: a retried submit
    assert kube.selectors == [f"{LABEL_RUN}=run,{LABEL_COMPONENT}={COMPONENT_TRAINING}"]
    with pytest.raises(JobConflictError, match="run run already has job r-run-1 active; two launches"):
        check_no_other_launch(kube, "run", "r-run-2")
    check_no_other_launch(StandInKube(jobs=[job("r-run-0", "Complete")]), "run", "r-run-2")


def test_too_few_healthy_nodes_is_insufficient_capacity_and_says_what_to_do():
    cfg = RunConfig(run_id="run", run_dir="/fsx/runs/run", dataset_dir="/fsx/data", nodes=3)
    check_capacity(Capacity(total=4, healthy=3), cfg, {"pool": "gpu"})
    with pytest.raises(InsufficientCapacityError, match=r"needs 3 healthy node\(s\) in the pool .*2 of 4 are .*n-1"):
        check_capacity(Capacity(total=4, healthy=2, quarantined=["n-1"]), cfg, {"pool": "gpu"})


def test_capacity_counts_the_hot_spares_too():
    """Each spare is a pod on its own node: 3 nodes + 2 spares need 5 healthy nodes, not 3."""
    cfg = RunConfig(run_id="run", run_dir="/fsx/runs/run", dataset_dir="/fsx/data", nodes=3, spare_nodes=2)
    check_capacity(Capacity(total=5, healthy=5), cfg, {"pool": "gpu"})
    with pytest.raises(InsufficientCapacityError) as e:
        check_capacity(Capacity(total=5, healthy=4, quarantined=["n-4"]), cfg, {"pool": "gpu"})
    message = str(e.value)
    assert "needs 5 healthy node(s)" in message and "(nodes 3 + spare_nodes 2)" in message
    assert "4 of 5 are" in message and "fewer spare_nodes" in message


def test_missing_service_account_and_claim_are_named_with_the_fix():
    settings = PodTemplateSettings(image="registry.example/fsdp:1")
    both = StandInKube(service_accounts=[settings.service_account], claims=[settings.fsx_claim])
    check_references(both, settings, "ns")
    with pytest.raises(BackendError) as e:
        check_references(StandInKube(), settings, "ns")
    message = str(e.value)
    assert f"ServiceAccount {settings.service_account}" in message
    assert f"PersistentVolumeClaim {settings.fsx_claim}" in message
    assert "in namespace ns" in message and "kubectl apply -k" in message
    with pytest.raises(BackendError, match="PersistentVolumeClaim") as e:
        check_references(StandInKube(service_accounts=[settings.service_account]), settings, "ns")
    assert "ServiceAccount" not in str(e.value)
