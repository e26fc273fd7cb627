"""The EKS Jobs' ``podFailurePolicy`` and ``backoffLimit``: how the run contract's exit codes and a
pod's disruption become the Job controller's actions (fail the Job at once, or count the failure
and replace the pod). Pure functions: manifests.py puts them in the Jobs it builds.
"""

from __future__ import annotations

import copy
from typing import Any

from fsdp_resilience.control.backends.eks.constants import CONTAINER
from fsdp_resilience.control.backends.eks.pod_settings import PodTemplateSettings
from fsdp_resilience.training.contract import ExitCode

#: A pod that is preempted, evicted or deleted with its node gets the DisruptionTarget condition.
#: It says nothing about the run, so whatever its exit code (a launcher killed mid-way may exit
#: with a final code) it never fails the Job at once; but it counts against backoffLimit, which
#: holds PodTemplateSettings.max_pod_disruptions on top of backoff_limit: with "Ignore", the Job
#: controller would replace evicted pods for ever (Kubernetes has no separate budget for them).
#: "Count" still has the Job recreate the pod for the same index (only "FailJob" stops it), so a
#: node lost behind a hot spare costs one disruption of the budget and its pod comes back as the
#: new spare; past the budget the Job fails and the ladder takes over.
_COUNT_DISRUPTION = {"action": "Count", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
#: Exit codes after which another pod of the same Job cannot help: a bug or a bad config, training
#: state that turns NaN/inf again after its rollbacks, a full or read-only run dir fail the same
#: way anywhere (and none of them is the node's fault).
USER_ERROR_EXIT_CODES = (ExitCode.CONFIG_ERROR, ExitCode.USER_ERROR, ExitCode.NON_FINITE, ExitCode.STORAGE_ERROR)
#: Another launcher of the run holds the node's launch lock: the run is being trained elsewhere. A
#: new pod would be refused the same way (or, worse, get the lock when the other one ends and train
#: a run nobody asked it to), so nothing retries it blindly.
ALREADY_RUNNING_EXIT_CODES = (ExitCode.ALREADY_RUNNING,)
#: The launcher started after its launch had ended (a pod the Job recreated for an index, e.g. a
#: spare, once the training nodes were done): it did nothing. "Ignore": not counted against
#: backoffLimit, so a launch that ended well is never failed by the pods that come after it (the
#: Job's successPolicy, or the backend's own rule, ends the Job). Exit code 0 may not be listed.
LAUNCH_ENDED_EXIT_CODES = (ExitCode.LAUNCH_ENDED,)
#: Exit codes after which the data plane already used its own restarts: relaunching (perhaps on
#: replaced nodes) is the control plane's decision, not the Job controller's.
GAVE_UP_EXIT_CODES = (ExitCode.RESTARTS_EXHAUSTED, ExitCode.NO_PROGRESS)


def _exit_code_rule(codes: tuple[ExitCode, ...], action: str = "FailJob") -> dict[str, Any]:
    return {
        "action": action,
        "onExitCodes": {"containerName": CONTAINER, "operator": "In", "values": sorted(int(c) for c in codes)},
    }


def training_pod_failure_policy() -> dict[str, Any]:
    """The training Job's podFailurePolicy. Rules apply in order, first match wins: a disrupted
    pod counts against backoffLimit whatever its exit code (it was killed from outside); a pod
    that started after its launch ended (``launch_ended``) is ignored: not counted against
    backoffLimit; a pod that exits with one of the contract's final codes fails the whole Job at
    once; any other failure (exit 1: unknown, an OOM kill) is retried by the Job controller within
    backoffLimit."""
    return {
        "rules": [
            copy.deepcopy(_COUNT_DISRUPTION),
            _exit_code_rule(LAUNCH_ENDED_EXIT_CODES, "Ignore"),
            _exit_code_rule(USER_ERROR_EXIT_CODES),
            _exit_code_rule(ALREADY_RUNNING_EXIT_CODES),
            _exit_code_rule(GAVE_UP_EXIT_CODES),
        ]
    }


def training_backoff_limit(settings: PodTemplateSettings) -> int:
    """The training Job's backoffLimit: failed pods it replaces before it fails. One Kubernetes
    budget for two kinds: ``backoff_limit`` failures with an exit code outside the contract, and
    ``max_pod_disruptions`` pods evicted, preempted or lost with their node."""
    return settings.backoff_limit + settings.max_pod_disruptions


def evaluation_pod_failure_policy() -> dict[str, Any]:
    """The evaluation Job's: a disruption is retried (within max_pod_disruptions); an evaluation
    that fails fails the same way again, so any failing exit code fails the Job at once."""
    return {
        "rules": [
            copy.deepcopy(_COUNT_DISRUPTION),
            {"action": "FailJob", "onExitCodes": {"containerName": CONTAINER, "operator": "NotIn", "values": [0]}},
        ]
    }
