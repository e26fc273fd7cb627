"""The EKS backend's rendezvous networking (eks/networking.py): the headless Service and the
NetworkPolicy are named like the launch's Job and select only its pods. (Their strict schema
validation, ownership and the full behaviour: test_eks_manifests.py.)"""

from __future__ import annotations

from fsdp_resilience.control.backends.base import job_name_for
from fsdp_resilience.control.backends.eks.constants import LABEL_JOB
from fsdp_resilience.control.backends.eks.networking import (
    rendezvous_host,
    rendezvous_network_policy,
    rendezvous_service,
)
from fsdp_resilience.control.backends.eks.pod_settings import PodTemplateSettings
from fsdp_resilience.training.contract import RunConfig

CFG = RunConfig(run_id="run", run_dir="/fsx/runs/run", dataset_dir="/fsx/data", nodes=2)
SETTINGS = PodTemplateSettings(image="registry.example/fsdp:1")


def test_the_service_and_policy_are_named_like_the_job_and_select_its_pods():
    name = job_name_for("run", "0")
    service = rendezvous_service(CFG, "0", SETTINGS)
    policy = rendezvous_network_policy(CFG, "0", SETTINGS)
    assert service["metadata"]["name"] == policy["metadata"]["name"] == name
    assert service["spec"]["selector"] == {LABEL_JOB: name} and service["spec"]["clusterIP"] == "None"
    assert service["spec"]["ports"][0]["port"] == CFG.rdzv_port
    assert policy["spec"]["podSelector"] == {"matchLabels": {LABEL_JOB: name}}
    assert policy["spec"]["ingress"] == [{"from": [{"podSelector": {"matchLabels": {LABEL_JOB: name}}}]}]
    assert rendezvous_host(name, "ns") == f"{name}-0.{name}.ns.svc"
