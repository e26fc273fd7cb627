"""The EKS backend's evaluation run (eks/evaluation.py): the evaluation Job is created once, waited
for until it completes, fails (with its log's tail) or times out, and its result is read from the
run dir. No cluster: the Kubernetes client is a stand-in whose Job moves through given states (the
real run: test_eks_backend.py)."""

from __future__ import annotations

import json

import pytest

from fsdp_resilience.control.backends.base import BackendError
from fsdp_resilience.control.backends.eks.evaluation import read_evaluation_result, wait_for_evaluation_job

JOB = {"metadata": {"name": "r-run-eval-step-20"}}


class StandInKube:
    """A Job that shows ``conditions[i]`` on the i-th read after its creation."""

    def __init__(self, conditions: list[str | None], exists: bool = False):
        self.conditions, self.exists, self.reads, self.created = conditions, exists, 0, []

    def get_job(self, name):
        if not self.exists:
            return None
        cond = self.conditions[min(self.reads, len(self.conditions) - 1)]
        self.reads += 1
        return {
            "metadata": {"name": name},
            "status": {"conditions": [{"type": cond, "status": "True"}] if cond else []},
        }

    def create_job(self, job):
        self.created.append(job["metadata"]["name"])
        self.exists = True

    def list_pods(self, selector):
        return [{"metadata": {"name": "r-run-eval-step-20-abc"}}]

    def pod_log(self, name, tail):
        return f"log of {name} ({tail} lines)"


def test_the_job_is_created_once_and_waited_for_until_it_completes():
    kube = StandInKube([None, None, "Complete"])
    wait_for_evaluation_job(kube, JOB, timeout_s=30, poll_s=0, namespace="ns")
    assert kube.created == ["r-run-eval-step-20"] and kube.reads == 3
    again = StandInKube(["SuccessCriteriaMet"], exists=True)  # a retried task: the same Job
    wait_for_evaluation_job(again, JOB, timeout_s=30, poll_s=0, namespace="ns")
    assert again.created == []


def test_a_failed_job_says_how_its_log_ends_and_a_slow_one_times_out():
    with pytest.raises(BackendError, match=r"evaluation job r-run-eval-step-20 failed; its log ends:\nlog of .*50"):
        wait_for_evaluation_job(StandInKube(["Failed"]), JOB, timeout_s=30, poll_s=0, namespace="ns")
    with pytest.raises(BackendError, match=r"did not finish within -1s; see `kubectl -n ns describe job r-run-eval"):
        wait_for_evaluation_job(StandInKube([None]), JOB, timeout_s=-1, poll_s=0, namespace="ns")


def test_the_result_is_read_from_the_run_dir(tmp_path):
    (tmp_path / "eval.json").write_text(json.dumps({"val_loss": 2.5}))
    assert read_evaluation_result(str(tmp_path), "j") == {"val_loss": 2.5}
    with pytest.raises(BackendError, match="evaluation job j succeeded but .* is unreadable here .*is FSx"):
        read_evaluation_result(str(tmp_path / "elsewhere"), "j")
