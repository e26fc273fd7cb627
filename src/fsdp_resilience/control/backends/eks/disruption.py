"""The EKS backend's disruption budget for one launch: a PodDisruptionBudget named like the launch's
Job, selecting its pods, that lets no voluntary eviction through (a managed node group upgrade,
``kubectl drain``, Karpenter drift or consolidation), so nothing but a real fault uses up the
launch's disruption budget (the Job's backoffLimit; failure_policy.py). Owned by the Job, so it
goes with it. With the pod template's ``karpenter.sh/do-not-disrupt`` annotation, Karpenter does
not even try.

The backend's own replacement of a quarantined node must still get our pods off it (replace_nodes
evicts before it terminates the instance or deletes the NodeClaim: Karpenter's drain would wait
on do-not-disrupt pods). How it passes its own budget, and why this way:

- The eviction stays an eviction (the Eviction API): the pod gets the DisruptionTarget condition,
  so the Job's podFailurePolicy counts it as a disruption and status/diagnose see the pod as
  lost with its node. A plain DELETE of the pod (``pods: delete``) would skip that condition, the
  pod would end as an ordinary failure by its SIGTERM exit code, and the grant would let the
  worker delete any pod of the namespace past any budget.
- So when the Eviction API refuses (429) and the refusal names *this launch's* budget, the backend
  lowers that budget's ``minAvailable`` to the pods healthy now less one, which lets exactly this
  one eviction through, evicts, and puts ``minAvailable`` back (``INTENDED_ANNOTATION``). The grant
  is ``poddisruptionbudgets: patch`` in the training namespace; the window is one eviction wide
  (an eviction by someone else inside it takes the slot, and the backend lowers again).
- ``unhealthyPodEvictionPolicy: AlwaysAllow``: a pod that is running but not Ready (its node went
  NotReady) may be evicted by anyone; the launch has lost it already, and a drain of a broken node
  should not hang on it. Such a pod needs no lowering at all.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from fsdp_resilience.control.backends.base import BackendError
from fsdp_resilience.control.backends.eks.constants import LABEL_JOB
from fsdp_resilience.control.backends.eks.networking import launch_object_metadata
from fsdp_resilience.control.backends.eks.pod_settings import PodTemplateSettings
from fsdp_resilience.training.contract import RunConfig

if TYPE_CHECKING:
    from fsdp_resilience.control.backends.eks.client import KubeClient

#: The budget's own minAvailable (the launch's pods), kept while the backend lowers it to pass.
INTENDED_ANNOTATION = "fsdp-resilience/min-available"
#: How long the backend keeps trying to pass its own budget for one pod before it gives up.
PASS_TIMEOUT_S = 30.0
_POLL_S = 0.1


def disruption_budget(
    cfg: RunConfig,
    launch_id: str,
    settings: PodTemplateSettings,
    *,
    owner: dict[str, Any] | None = None,
    airflow_run_id: str | None = None,
) -> dict[str, Any]:
    """The PodDisruptionBudget named like the launch's Job. ``minAvailable`` is every pod the launch
    starts (training nodes and spares): a Job has no scale subresource, so ``maxUnavailable`` and
    percentages cannot be used, and with an integer equal to the pod count no voluntary eviction
    is allowed while they are healthy."""
    name, metadata = launch_object_metadata(cfg, launch_id, settings, owner, airflow_run_id)
    metadata.setdefault("annotations", {})[INTENDED_ANNOTATION] = str(cfg.launch_nodes)
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata,
        "spec": {
            "minAvailable": cfg.launch_nodes,
            "selector": {"matchLabels": {LABEL_JOB: name}},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def _policy(kube: KubeClient):
    from kubernetes import client

    return client.PolicyV1Api(kube.api)


# poddisruptionbudgets.policy: get, create, patch
def get_budget(kube: KubeClient, name: str) -> dict[str, Any] | None:
    return kube._or_none(
        f"read pod disruption budget {name}", _policy(kube).read_namespaced_pod_disruption_budget, name, kube.namespace
    )


def ensure_budget(kube: KubeClient, body: dict[str, Any]) -> dict[str, Any]:
    """Create the launch's budget unless it exists (a retried submit)."""
    name = body["metadata"]["name"]
    return get_budget(kube, name) or kube._create(
        f"create pod disruption budget {name}",
        _policy(kube).create_namespaced_pod_disruption_budget,
        body,
        lambda n: get_budget(kube, n),
    )


def _set_min_available(kube: KubeClient, name: str, value: int) -> None:
    kube._call(
        f"set minAvailable={value} on pod disruption budget {name}",
        _policy(kube).patch_namespaced_pod_disruption_budget,
        name,
        kube.namespace,
        {"spec": {"minAvailable": value}},
    )


def refusing_budget(error: Any) -> str | None:
    """The name of the PodDisruptionBudget a 429 from the Eviction API names, or None. The
    apiserver says "The disruption budget <name> needs N healthy pods ..." or "... <name> is still
    being processed by the server" in a cause of type DisruptionBudget."""
    try:
        body = json.loads(getattr(error, "body", None) or "{}")
    except (TypeError, ValueError):
        return None
    for cause in ((body.get("details") or {}).get("causes")) or []:
        message = cause.get("message") or ""
        if cause.get("reason") == "DisruptionBudget" or cause.get("type") == "DisruptionBudget":
            words = message.split()
            if len(words) >= 4 and words[:3] == ["The", "disruption", "budget"]:
                return words[3]
    return None


def evict_past_own_budget(kube: KubeClient, pod_name: str, budget_name: str, evict) -> bool:
    """Evict ``pod_name`` (``evict()``: True once evicted or gone, False on another 429) although
    the launch's own budget ``budget_name`` refuses: lower its minAvailable to let this one eviction
    through, then put it back. False if it is still refused after PASS_TIMEOUT_S (or the budget is
    gone: then the refusal was not ours)."""
    budget = get_budget(kube, budget_name)
    if budget is None:
        return False
    intended = int(((budget["metadata"].get("annotations") or {}).get(INTENDED_ANNOTATION)) or 0) or int(
        budget["spec"].get("minAvailable") or 0
    )
    deadline = time.monotonic() + PASS_TIMEOUT_S
    try:
        while True:
            status = budget.get("status") or {}
            processed = status.get("observedGeneration") == budget["metadata"].get("generation")
            lowered = max(0, int(status.get("currentHealthy") or 0) - 1)
            if processed and not status.get("disruptionsAllowed") and budget["spec"].get("minAvailable") != lowered:
                _set_min_available(kube, budget_name, lowered)
            if evict():
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(_POLL_S)
            budget = get_budget(kube, budget_name)
            if budget is None:
                return evict()
    finally:
        if get_budget(kube, budget_name) is not None:
            try:
                _set_min_available(kube, budget_name, intended)
            except BackendError:
                if get_budget(kube, budget_name) is not None:  # gone with its Job meanwhile: nothing to restore
                    raise


# pods/eviction: create
def _evict(kube: KubeClient, name: str) -> bool:
    """Evict pod ``name`` through the Eviction API: True if evicted, False if it is gone; a 429 (a
    disruption budget refuses) is raised as the client's ApiException."""
    from kubernetes import client

    body = client.V1Eviction(metadata=client.V1ObjectMeta(name=name, namespace=kube.namespace))
    try:
        kube._call(
            f"evict pod {name}", kube.core.create_namespaced_pod_eviction, name, kube.namespace, body, ok=(404, 429)
        )
    except kube.ApiException as e:
        if e.status == 404:
            return False
        raise
    return True


def _evicted_or_gone(kube: KubeClient, name: str) -> bool:
    try:
        _evict(kube, name)
    except kube.ApiException:
        return False
    return True


def evict_pods_on(kube: KubeClient, node_name: str, label_selector: str) -> list[str]:
    """Evict the pods matching ``label_selector`` still running on node ``node_name`` (finished ones
    stay: their status is evidence), past each one's own launch budget (evict_past_own_budget).
    Returns the pods evicted, and those still refused, marked so."""
    evicted = []
    for pod in kube.list_pods(label_selector, f"spec.nodeName={node_name}"):
        if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        name = pod["metadata"]["name"]
        try:
            if not _evict(kube, name):
                continue  # gone already
        except kube.ApiException as e:
            own = (pod["metadata"].get("labels") or {}).get(LABEL_JOB)
            passed = (
                own is not None
                and refusing_budget(e) == own
                and evict_past_own_budget(kube, name, own, lambda name=name: _evicted_or_gone(kube, name))
            )
            if not passed:
                # Another budget (or ours, still after PASS_TIMEOUT_S) forbids it: the pod goes with
                # the node when its instance is terminated (or a human drains it, cordon).
                evicted.append(f"{name} (eviction blocked by a disruption budget)")
                continue
        evicted.append(name)
    return evicted
