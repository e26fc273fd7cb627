"""The EKS backend (``get_backend("eks", ...)``): one launch = one Indexed Job (a pod per node) + one
headless Service + one NetworkPolicy on an EKS cluster's GPU node pool.

    backend.py         EksBackend, the TrainingBackend implementation
    manifests.py       the training and evaluation Jobs (pure functions)
    networking.py      the launch's rendezvous Service and NetworkPolicy (pure functions)
    object_metadata.py the objects' labels, annotations and owner reference
    failure_policy.py  the Jobs' podFailurePolicy and backoffLimit: exit codes -> the Job controller
    pod_settings.py    PodTemplateSettings: the pods' own settings and their validation
    images.py          image references and the image allowlist
    constants.py       the labels, annotations, taint, env and resource names the backend uses
    status.py          a Job's and its pods' JSON -> JobStatus / NodeStatus
    nodes.py           the node pool: healthy capacity, quarantine, replacement (ASG, Karpenter, cordon)
    spares.py          whether the spare pool is whole again after a lost node
    launch_checks.py   what submit checks first: no other launch, enough healthy nodes, the pods' objects
    diagnosis.py       which nodes a failed launch blames, and why
    evaluation.py      running the evaluation Job to its end and reading its result
    client.py          the Kubernetes API client and what its errors mean

Importing this package needs no Kubernetes client: the clients are imported on first use.
"""

from fsdp_resilience.control.backends.eks.backend import EksBackend
from fsdp_resilience.control.backends.eks.client import kube_error
from fsdp_resilience.control.backends.eks.constants import (
    CANCEL_ANNOTATION,
    MANAGED_ASG_TAG,
    NEWEST_SUPPORTED_K8S,
    OLDEST_SUPPORTED_K8S,
    QUARANTINE_ANNOTATION,
    QUARANTINE_TAINT,
    RETURN_ANNOTATION,
)
from fsdp_resilience.control.backends.eks.images import check_image_prefix, image_allowed, image_repository
from fsdp_resilience.control.backends.eks.manifests import evaluation_job, training_job
from fsdp_resilience.control.backends.eks.networking import rendezvous_network_policy, rendezvous_service
from fsdp_resilience.control.backends.eks.nodes import REPLACEMENT_MODES
from fsdp_resilience.control.backends.eks.pod_settings import PodTemplateSettings

__all__ = [
    "CANCEL_ANNOTATION",
    "MANAGED_ASG_TAG",
    "NEWEST_SUPPORTED_K8S",
    "OLDEST_SUPPORTED_K8S",
    "QUARANTINE_ANNOTATION",
    "QUARANTINE_TAINT",
    "REPLACEMENT_MODES",
    "RETURN_ANNOTATION",
    "EksBackend",
    "PodTemplateSettings",
    "check_image_prefix",
    "evaluation_job",
    "image_allowed",
    "image_repository",
    "kube_error",
    "rendezvous_network_policy",
    "rendezvous_service",
    "training_job",
]
