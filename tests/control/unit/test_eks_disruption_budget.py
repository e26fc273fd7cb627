"""The launch's PodDisruptionBudget as built (eks/disruption.py), and how a refusal of the Eviction
API is read. What the apiserver and the disruption controller do with it is
tests/control/integration/test_eks_disruption.py's."""

from __future__ import annotations

import json

from fsdp_resilience.control.backends.base import job_name_for
from fsdp_resilience.control.backends.eks.constants import LABEL_JOB
from fsdp_resilience.control.backends.eks.disruption import INTENDED_ANNOTATION, disruption_budget, refusing_budget
from fsdp_resilience.control.backends.eks.pod_settings import PodTemplateSettings
from fsdp_resilience.training.contract import RunConfig


def test_the_budget_covers_every_pod_of_the_launch_spares_included_and_goes_with_its_job():
    cfg = RunConfig(run_id="run", run_dir="/fsx/runs/run", dataset_dir="/fsx/data", nodes=4, spare_nodes=2)
    settings = PodTemplateSettings(image="registry.example/fsdp:1")
    name = job_name_for("run", "0")
    job = {"metadata": {"name": name, "uid": "0b5d3c1e-0000-4000-8000-000000000001"}}
    pdb = disruption_budget(cfg, "0", settings, owner=job)
    assert pdb["metadata"]["name"] == name and pdb["metadata"]["namespace"] == settings.namespace
    assert pdb["spec"]["minAvailable"] == 6 == int(pdb["metadata"]["annotations"][INTENDED_ANNOTATION])
    assert pdb["spec"]["selector"] == {"matchLabels": {LABEL_JOB: name}}
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    assert pdb["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["uid"]


class Refusal(Exception):
    def __init__(self, body):
        self.status, self.body = 429, body


def status(*causes) -> str:
    return json.dumps({"kind": "Status", "code": 429, "details": {"causes": list(causes)}})


def test_a_refusal_names_the_budget_that_refused_or_none():
    needs = {
        "reason": "DisruptionBudget",
        "message": "The disruption budget r-a-0 needs 2 healthy pods and has 2 currently",
    }
    processing = {
        "reason": "DisruptionBudget",
        "message": "The disruption budget r-a-0 is still being processed by the server.",
    }
    assert refusing_budget(Refusal(status(needs))) == "r-a-0"
    assert refusing_budget(Refusal(status(processing))) == "r-a-0"
    assert refusing_budget(Refusal(status({"reason": "Other", "message": "The disruption budget x y"}))) is None
    assert refusing_budget(Refusal(status())) is None
    assert refusing_budget(Refusal("not json")) is None
    assert refusing_budget(Refusal(None)) is None
