"""What EksBackend.submit checks on the cluster before it creates a launch's Job: no other launch
of the run is active, the node pool has enough healthy nodes, and the objects the pods name
(ServiceAccount, FSx claim) exist. Each refusal says what to do, before any pod could start.
"""

from __future__ import annotations

from typing import Any

from fsdp_resilience.control.backends.base import BackendError, Capacity, InsufficientCapacityError, JobConflictError
from fsdp_resilience.control.backends.eks.client import KubeClient
from fsdp_resilience.control.backends.eks.constants import COMPONENT_TRAINING, LABEL_COMPONENT, LABEL_RUN
from fsdp_resilience.control.backends.eks.pod_settings import PodTemplateSettings
from fsdp_resilience.control.backends.eks.status import job_finished
from fsdp_resilience.training.contract import RunConfig


def check_no_other_launch(kube: KubeClient, run_id: str, job_name: str) -> None:
    for other in kube.list_jobs(f"{LABEL_RUN}={run_id},{LABEL_COMPONENT}={COMPONENT_TRAINING}"):
        if other["metadata"]["name"] != job_name and not job_finished(other):
            raise JobConflictError(
                f"run {run_id} already has job {other['metadata']['name']} active; two launches would share one "
                "run dir. Wait for it to end, or cancel it, before submitting another launch"
            )


def check_capacity(capacity: Capacity, cfg: RunConfig, pool_selector: dict[str, Any]) -> None:
    """Refuse a launch the pool has too few healthy nodes for (InsufficientCapacityError): one per
    pod the launch starts, its training nodes and its hot spares (``cfg.launch_nodes``); a spare
    without a node would stay Pending and the launch would wait for it."""
    if capacity.healthy < cfg.launch_nodes:
        raise InsufficientCapacityError(
            f"run {cfg.run_id} needs {cfg.launch_nodes} healthy node(s) in the pool {pool_selector} "
            f"(nodes {cfg.nodes} + spare_nodes {cfg.spare_nodes}); {capacity.healthy} of "
            f"{capacity.total} are (out of service: {capacity.quarantined}). Wait for replacements "
            "to join, scale the node group up, or ask for fewer spare_nodes"
        )


def check_references(kube: KubeClient, settings: PodTemplateSettings, namespace: str) -> None:
    """The objects the pods name must exist, or the Job controller retries pod creation forever
    (a missing ServiceAccount: FailedCreate events) or the pods stay Pending (a missing claim),
    and the launch only fails at its stall timeout. Checked before the Job is created, so the
    error comes at once and says what to apply. (A ``priority_class`` is the user's own
    setting and not checked: that would need a cluster-wide grant.)"""
    s = settings
    missing = []
    if kube.get_service_account(s.service_account) is None:
        missing.append(f"ServiceAccount {s.service_account}")
    if kube.get_claim(s.fsx_claim) is None:
        missing.append(f"PersistentVolumeClaim {s.fsx_claim} (the FSx for Lustre volume)")
    if missing:
        raise BackendError(
            f"the training pods need {', '.join(missing)} in namespace {namespace}, which "
            "the cluster lacks: apply the deploy kit (kubectl apply -k deploy/overlays/<yours>, "
            "docs/deploy-on-eks.md), or set FSDP_EKS_POD's service_account / fsx_claim / "
            "priority_class to objects that exist"
        )
