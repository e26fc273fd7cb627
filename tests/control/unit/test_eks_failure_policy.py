"""The EKS Jobs' podFailurePolicy and backoffLimit (eks/failure_policy.py), rule by rule. How the Job
controller applies the training policy to every exit code of the contract is
test_eks_manifests.py's (on the Job as built)."""

from __future__ import annotations

from fsdp_resilience.control.backends.eks.constants import CONTAINER
from fsdp_resilience.control.backends.eks.failure_policy import (
    ALREADY_RUNNING_EXIT_CODES,
    GAVE_UP_EXIT_CODES,
    USER_ERROR_EXIT_CODES,
    evaluation_pod_failure_policy,
    training_backoff_limit,
    training_pod_failure_policy,
)
from fsdp_resilience.control.backends.eks.pod_settings import PodTemplateSettings
from fsdp_resilience.training.contract import ExitCode

COUNT_DISRUPTION = {"action": "Count", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}


def test_the_training_policy_counts_disruptions_first_then_fails_the_job_on_the_final_codes():
    disruption, ignore, *fail_rules = training_pod_failure_policy()["rules"]
    assert disruption == COUNT_DISRUPTION  # first match wins: a disrupted pod never fails the Job at once
    # A pod that started after its launch ended did nothing: not counted against backoffLimit.
    assert ignore == {
        "action": "Ignore",
        "onExitCodes": {"containerName": CONTAINER, "operator": "In", "values": [int(ExitCode.LAUNCH_ENDED)]},
    }
    assert [r["onExitCodes"]["values"] for r in fail_rules] == [
        sorted(int(c) for c in codes)
        for codes in (USER_ERROR_EXIT_CODES, ALREADY_RUNNING_EXIT_CODES, GAVE_UP_EXIT_CODES)
    ]
    for rule in fail_rules:
        assert rule["action"] == "FailJob"
        assert rule["onExitCodes"]["containerName"] == CONTAINER and rule["onExitCodes"]["operator"] == "In"
    assert int(ExitCode.NON_FINITE) in fail_rules[0]["onExitCodes"]["values"]


def test_the_evaluation_policy_fails_on_any_failing_exit_code_but_retries_a_disruption():
    disruption, fail = evaluation_pod_failure_policy()["rules"]
    assert disruption == COUNT_DISRUPTION
    assert fail == {
        "action": "FailJob",
        "onExitCodes": {"containerName": CONTAINER, "operator": "NotIn", "values": [0]},
    }


def test_each_call_returns_a_policy_of_its_own():
    first = training_pod_failure_policy()
    first["rules"][0]["onPodConditions"].clear()
    assert training_pod_failure_policy()["rules"][0] == COUNT_DISRUPTION
    evaluation = evaluation_pod_failure_policy()
    evaluation["rules"][0]["action"] = "Ignore"
    assert evaluation_pod_failure_policy()["rules"][0] == COUNT_DISRUPTION


def test_the_backoff_limit_holds_both_budgets():
    assert training_backoff_limit(PodTemplateSettings(image="x")) == 2 + 3
    assert training_backoff_limit(PodTemplateSettings(image="x", backoff_limit=0, max_pod_disruptions=7)) == 7
