"""The EKS backend's rendezvous networking for one launch, as plain JSON-safe dicts: the headless
Service named like the launch's Job, which gives pod 0 the stable DNS name every node rendezvouses
at (``rendezvous_host``), and the NetworkPolicy that admits traffic to the launch's pods only from
the same launch's pods (the rendezvous store is unauthenticated). Both are owned by the created
Job. Pure functions, like manifests.py.
"""

from __future__ import annotations

import copy
from typing import Any

from fsdp_resilience.control.backends.base import job_name_for
from fsdp_resilience.control.backends.eks.constants import COMPONENT_TRAINING, LABEL_JOB, RDZV_PORT_NAME
from fsdp_resilience.control.backends.eks.object_metadata import (
    check_ids,
    object_annotations,
    object_labels,
    object_metadata,
    owner_reference,
)
from fsdp_resilience.control.backends.eks.pod_settings import PodTemplateSettings
from fsdp_resilience.training.contract import RunConfig


def rendezvous_host(job_name: str, namespace: str) -> str:
    """The DNS name of the pod with completion index 0: an Indexed Job's pod is named
    ``<job>-<index>`` and, with ``subdomain=<job>``, resolvable through the headless Service."""
    return f"{job_name}-0.{job_name}.{namespace}.svc"


def launch_object_metadata(
    cfg: RunConfig,
    launch_id: str,
    settings: PodTemplateSettings,
    owner: dict[str, Any] | None,
    airflow_run_id: str | None,
) -> tuple[str, dict[str, Any]]:
    """The name (the Job's) and metadata of an object that belongs to one launch's Job; with
    ``owner`` (the created Job), owned by it, so it goes when the Job goes."""
    settings.validate()
    check_ids(launch_id, airflow_run_id)
    name = job_name_for(cfg.run_id, launch_id)
    metadata = object_metadata(
        name,
        settings.namespace,
        object_labels(cfg, COMPONENT_TRAINING, launch_id, airflow_run_id),
        object_annotations(launch_id, airflow_run_id),
    )
    if owner is not None:
        metadata["ownerReferences"] = [owner_reference(owner, name)]
    return name, metadata


def rendezvous_service(
    cfg: RunConfig,
    launch_id: str,
    settings: PodTemplateSettings,
    *,
    owner: dict[str, Any] | None = None,
    airflow_run_id: str | None = None,
) -> dict[str, Any]:
    """The headless Service named like the launch's Job: it gives pod ``<job>-0`` the DNS name
    ``rendezvous_host(job, namespace)``. With ``owner`` (the created Job), deleting the Job
    (or its TTL expiring) deletes the Service too."""
    name, metadata = launch_object_metadata(cfg, launch_id, settings, owner, airflow_run_id)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata,
        "spec": {
            "clusterIP": "None",
            # The rendezvous happens before any pod is Ready: publish the addresses at once.
            "publishNotReadyAddresses": True,
            "selector": {LABEL_JOB: name},
            "ports": [{"name": RDZV_PORT_NAME, "port": cfg.rdzv_port, "targetPort": cfg.rdzv_port, "protocol": "TCP"}],
        },
    }


def rendezvous_network_policy(
    cfg: RunConfig,
    launch_id: str,
    settings: PodTemplateSettings,
    *,
    owner: dict[str, Any] | None = None,
    airflow_run_id: str | None = None,
) -> dict[str, Any]:
    """The NetworkPolicy named like the launch's Job: traffic into the launch's pods only from the
    same launch's pods, on every port (the rendezvous store, which has no authentication; the
    c10d store; NCCL's TCP bootstrap and socket fallback). Other pods of the namespace, and other
    launches of the same run, are refused (the kit also denies all other ingress to the training
    namespace). EFA traffic is OS-bypass and never meets the CNI's policy. Egress is not limited
    (FSx, the registry, S3). With ``owner`` (the created Job), it goes with the Job."""
    name, metadata = launch_object_metadata(cfg, launch_id, settings, owner, airflow_run_id)
    launch_pods = {"matchLabels": {LABEL_JOB: name}}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata,
        "spec": {
            "podSelector": copy.deepcopy(launch_pods),
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [{"podSelector": copy.deepcopy(launch_pods)}]}],
        },
    }
