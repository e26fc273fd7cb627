"""The Kubernetes objects of the EKS backend, as plain JSON-safe dicts.

One launch of a run is ONE Indexed Job (a pod per node; completion index = node rank), created
suspended, plus ONE headless Service named like the Job, which gives pod 0 the stable DNS name
that every node rendezvouses at, and ONE NetworkPolicy that admits traffic to the launch's pods
only from the same launch's pods (the rendezvous store is unauthenticated). Evaluation is a
one-pod Job. The dicts are what ``BatchV1Api.create_namespaced_job(namespace, body=...)``,
``CoreV1Api.create_namespaced_service`` and ``NetworkingV1Api.create_namespaced_network_policy``
accept.

Every pod runs as the images' non-root user (uid/gid 1000), with seccomp RuntimeDefault, no
privilege escalation and every capability dropped, except IPC_LOCK on EFA pods (libfabric pins
the memory it registers with the NIC; the EKS runtime's default memlock limit is too small).
Training pods are QoS Guaranteed by default (cpu and memory requests = limits), sized for
p5.48xlarge. The pods' settings (``PodTemplateSettings``) and their validation are in
pod_settings.py, the image allowlist in images.py, the names and labels in constants.py.

Pure functions: no Kubernetes client, no clock, no randomness. The same inputs give the same
objects, so a retried Airflow task submits byte-for-byte what the first try did.

Torch-free and client-free: the control plane imports this module.
"""

from __future__ import annotations

import copy
import hashlib
import posixpath
import re
from typing import Any

from fsdp_resilience.control.backends.base import job_name_for
from fsdp_resilience.control.backends.eks.constants import (
    ANNOTATION_AIRFLOW_RUN,
    ANNOTATION_LAUNCH,
    COMPONENT_EVALUATION,
    COMPONENT_TRAINING,
    CONFIG_ENV,
    CONTAINER,
    DEVICE_RDMA_ENV,
    EFA_CAPABILITIES,
    EFA_ENV,
    EFA_RESOURCE,
    EVAL_LAUNCH_ID,
    FSX_VOLUME,
    GPU_RESOURCE,
    HUGEPAGES_RESOURCE,
    LABEL_AIRFLOW_RUN,
    LABEL_COMPONENT,
    LABEL_JOB,
    LABEL_LAUNCH,
    LABEL_RUN,
    LABEL_VALUE_FORMAT,
    LABEL_VALUE_MAX,
    LAUNCH_ID_ENV,
    MANAGED_BY,
    NCCL_ENV,
    NODE_ID_ENV,
    RDZV_HOST_ENV,
    RDZV_PORT_NAME,
    SHM_VOLUME,
    TRAINING_COMMAND,
)
from fsdp_resilience.control.backends.eks.failure_policy import (
    evaluation_pod_failure_policy,
    training_backoff_limit,
    training_pod_failure_policy,
)
from fsdp_resilience.control.backends.eks.pod_settings import PodTemplateSettings
from fsdp_resilience.training.contract import RunConfig, checkpoint_step

_LABEL_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")
_LABEL_EDGE = re.compile(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$")
_HASH_LEN = 8


def label_value(text: str) -> str:
    """``text`` as a valid label value: unchanged if it already is one, else cleaned and cut to fit,
    with a short hash of the exact text appended (so two ids that clean up alike stay distinct).

    ``manual__2026-11-30T07:35:43.123456+00:00`` -> ``manual__2026-11-30T07-35-43.123456-00-00-<hash>``.
    """
    if not isinstance(text, str):
        raise TypeError(f"label_value needs a string, got {type(text).__name__}")
    if text and len(text) <= LABEL_VALUE_MAX and LABEL_VALUE_FORMAT.match(text):
        return text
    digest = hashlib.sha256(text.encode()).hexdigest()[:_HASH_LEN]
    readable = _LABEL_UNSAFE.sub("-", text)[: LABEL_VALUE_MAX - _HASH_LEN - 1]
    readable = _LABEL_EDGE.sub("", readable)
    return f"{readable}-{digest}" if readable else digest


def rendezvous_host(job_name: str, namespace: str) -> str:
    """The DNS name of the pod with completion index 0: an Indexed Job's pod is named
    ``<job>-<index>`` and, with ``subdomain=<job>``, resolvable through the headless Service."""
    return f"{job_name}-0.{job_name}.{namespace}.svc"


# --------------------------------------------------------------------------------------------
# Shared pieces
# --------------------------------------------------------------------------------------------


def _check_under_mount(cfg: RunConfig, settings: PodTemplateSettings) -> None:
    mount = settings.fsx_mount_path
    for name in ("run_dir", "dataset_dir"):
        path = getattr(cfg, name)
        normal = posixpath.normpath(path)
        if not path.startswith("/") or not normal.startswith(mount.rstrip("/") + "/"):
            raise ValueError(
                f"RunConfig.{name}={path!r} is not under the FSx mount {mount!r}: the run would write "
                f"outside the shared file system, where other nodes (and later launches) cannot see it; "
                f"set {name} to a path under {mount}/ (e.g. {mount}/runs/{cfg.run_id}), or set "
                f"PodTemplateSettings.fsx_mount_path to where the FSx volume holds it"
            )


def _labels(cfg: RunConfig, component: str, launch_id: str | None, airflow_run_id: str | None) -> dict[str, str]:
    labels = {**MANAGED_BY, LABEL_COMPONENT: component, LABEL_RUN: cfg.run_id}
    if launch_id is not None:
        labels[LABEL_LAUNCH] = label_value(launch_id)
    if airflow_run_id is not None:
        labels[LABEL_AIRFLOW_RUN] = label_value(airflow_run_id)
    return labels


def _annotations(launch_id: str | None, airflow_run_id: str | None) -> dict[str, str]:
    annotations = {}
    if launch_id is not None:
        annotations[ANNOTATION_LAUNCH] = launch_id
    if airflow_run_id is not None:
        annotations[ANNOTATION_AIRFLOW_RUN] = airflow_run_id
    return annotations


def _metadata(name: str, namespace: str, labels: dict[str, str], annotations: dict[str, str]) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": labels}
    if annotations:
        meta["annotations"] = annotations
    return meta


def _check_ids(launch_id: Any, airflow_run_id: Any) -> None:
    if not isinstance(launch_id, str) or not launch_id.strip() or len(launch_id) > 200:
        raise ValueError(f"launch_id={launch_id!r} must be a non-empty string of at most 200 characters")
    if airflow_run_id is not None and (not isinstance(airflow_run_id, str) or not airflow_run_id):
        raise ValueError(f"airflow_run_id={airflow_run_id!r} must be the DAG run's id, or None")


def _env(pairs: dict[str, str], node_id_from_downward_api: bool) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = []
    if node_id_from_downward_api:
        # The Kubernetes node name: diagnosis maps faults to nodes by it, replace_nodes cordons it.
        env.append({"name": NODE_ID_ENV, "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}})
    env += [{"name": k, "value": v} for k, v in pairs.items()]
    return env


def _resources(
    gpus: int, efa: int, settings: PodTemplateSettings, *, hugepages: bool, cpu: str | None, memory: str | None
) -> dict[str, Any]:
    # Extended resources (GPU, EFA, huge pages) need requests equal to limits.
    requests: dict[str, str] = {}
    limits: dict[str, str] = {}
    if gpus > 0:
        requests[GPU_RESOURCE] = limits[GPU_RESOURCE] = str(gpus)
    if efa > 0:
        requests[EFA_RESOURCE] = limits[EFA_RESOURCE] = str(efa)
    if hugepages and settings.hugepages_2mi is not None:
        requests[HUGEPAGES_RESOURCE] = limits[HUGEPAGES_RESOURCE] = settings.hugepages_2mi
    if cpu is not None:
        requests["cpu"] = cpu
        if settings.guaranteed_qos:  # else no CPU limit: Burstable, never throttled below the node
            limits["cpu"] = cpu
    if memory is not None:
        requests["memory"] = limits["memory"] = memory
    resources: dict[str, Any] = {}
    if requests:
        resources["requests"] = requests
    if limits:
        resources["limits"] = limits
    return resources


def _pod_security_context(settings: PodTemplateSettings) -> dict[str, Any]:
    # The images' numeric user: runAsNonRoot is checked by the kubelet before the container starts.
    return {
        "runAsNonRoot": True,
        "runAsUser": settings.run_as_user,
        "runAsGroup": settings.run_as_group,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _container_security_context(settings: PodTemplateSettings, efa: int) -> dict[str, Any]:
    capabilities: dict[str, Any] = {"drop": ["ALL"]}
    if efa > 0 and settings.efa_ipc_lock:
        capabilities["add"] = list(EFA_CAPABILITIES)
    return {"allowPrivilegeEscalation": False, "privileged": False, "capabilities": capabilities}


def _pod_spec(
    settings: PodTemplateSettings,
    container: dict[str, Any],
    job_name: str,
    *,
    subdomain: str | None,
    anti_affinity: bool,
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        # Never: the Job controller, not the kubelet, replaces a failed pod, and podFailurePolicy
        # (which requires Never) sees every exit code.
        "restartPolicy": "Never",
        "serviceAccountName": settings.service_account,
        # The trainer never talks to the Kubernetes API: no token in the pod.
        "automountServiceAccountToken": False,
        # Service links would put every Service of the namespace into the env; nothing reads them.
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": settings.termination_grace_s,
        "securityContext": _pod_security_context(settings),
        "nodeSelector": settings.pod_node_selector(),
        "tolerations": copy.deepcopy(settings.tolerations),
        "containers": [container],
        "volumes": [
            {"name": FSX_VOLUME, "persistentVolumeClaim": {"claimName": settings.fsx_claim}},
            {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": settings.shm_size}},
        ],
    }
    if subdomain is not None:
        spec["subdomain"] = subdomain
    if anti_affinity:
        # One pod per machine: a node's ranks use all of its GPUs and EFA devices.
        spec["affinity"] = {
            "podAntiAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "labelSelector": {"matchLabels": {LABEL_JOB: job_name}},
                        "topologyKey": "kubernetes.io/hostname",
                    }
                ]
            }
        }
    if settings.priority_class is not None:
        spec["priorityClassName"] = settings.priority_class
    return spec


def _container(
    settings: PodTemplateSettings,
    command: list[str],
    env: list[dict[str, Any]],
    resources: dict[str, Any],
    ports: list[dict[str, Any]] | None,
    *,
    efa: int,
) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": settings.image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": list(command),
        "env": env,
        "securityContext": _container_security_context(settings, efa),
        "volumeMounts": [
            {"name": FSX_VOLUME, "mountPath": settings.fsx_mount_path},
            {"name": SHM_VOLUME, "mountPath": "/dev/shm"},
        ],
    }
    if resources:
        container["resources"] = resources
    if ports:
        container["ports"] = ports
    return container


# --------------------------------------------------------------------------------------------
# The objects
# --------------------------------------------------------------------------------------------


def training_job(
    cfg: RunConfig,
    launch_id: str,
    settings: PodTemplateSettings,
    *,
    airflow_run_id: str | None = None,
    suspend: bool = True,
) -> dict[str, Any]:
    """The Indexed Job of one launch: ``cfg.launch_nodes`` pods, one per machine, completion
    index = node rank (src/fsdp_resilience/training/launch/config.py reads JOB_COMPLETION_INDEX), all
    rendezvousing at pod 0.
    Indices ``cfg.nodes`` and up are hot spares: their launchers wait until the training nodes
    train, then park in the rendezvous and take a lost node's place at the next in-job restart.
    Node 0 hosts the rendezvous store, so index 0 is always a training node (never a spare).

    A pod lost with its node (DisruptionTarget: the podFailurePolicy counts it against the
    disruption budget, it does not fail the Job) is recreated by the Job controller for the same
    index once the old pod is terminal (podReplacementPolicy Failed, the default with a
    podFailurePolicy): the new pod's launcher finds its launch training and parks as a spare, so
    the pool is whole again without the backend creating a pod. A spare exits 0 when the launch
    ends well, which completes its index: the Job succeeds when every index did.

    Created suspended (``suspend``): no pod starts before the backend has created the launch's
    Service and NetworkPolicy and resumes it (``spec.suspend: false``), so no pod ever runs
    without the DNS name it rendezvouses at."""
    settings.validate()
    _check_ids(launch_id, airflow_run_id)
    _check_under_mount(cfg, settings)
    name = job_name_for(cfg.run_id, launch_id)
    labels = _labels(cfg, COMPONENT_TRAINING, launch_id, airflow_run_id)
    annotations = _annotations(launch_id, airflow_run_id)
    gpus, efa = settings.gpus(cfg), settings.efa_per_node
    if gpus > 0 and cfg.procs_per_node > gpus:
        raise ValueError(
            f"RunConfig.procs_per_node={cfg.procs_per_node} is more than the {gpus} GPU(s) each pod "
            f"gets (PodTemplateSettings.gpus_per_node={settings.gpus_per_node}): one process per GPU; "
            "lower procs_per_node, or raise gpus_per_node to the GPUs of the pool's nodes"
        )

    env = {
        # The config itself, not a path: the pod needs no file shipped before it starts.
        CONFIG_ENV: cfg.to_json(),
        LAUNCH_ID_ENV: launch_id,
        RDZV_HOST_ENV: rendezvous_host(name, settings.namespace),
        "PYTHONUNBUFFERED": "1",  # logs reach `kubectl logs` (and diagnose) as they are written
    }
    if efa > 0:
        env.update(EFA_ENV)
        if settings.device_rdma():
            env.update(DEVICE_RDMA_ENV)
    if gpus > 0:
        env.update(NCCL_ENV)
    env.update(settings.env)
    container = _container(
        settings,
        TRAINING_COMMAND,
        _env(env, node_id_from_downward_api=True),
        _resources(gpus, efa, settings, hugepages=True, cpu=settings.cpu, memory=settings.memory),
        [{"name": RDZV_PORT_NAME, "containerPort": cfg.rdzv_port, "protocol": "TCP"}],
        efa=efa,
    )
    pod_spec = _pod_spec(settings, container, name, subdomain=name, anti_affinity=True)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _metadata(name, settings.namespace, labels, annotations),
        "spec": {
            "completionMode": "Indexed",
            "completions": cfg.launch_nodes,
            "parallelism": cfg.launch_nodes,
            "suspend": bool(suspend),
            "backoffLimit": training_backoff_limit(settings),
            "activeDeadlineSeconds": settings.active_deadline_s,
            "ttlSecondsAfterFinished": settings.ttl_after_finished_s,
            "podFailurePolicy": training_pod_failure_policy(),
            "template": {
                "metadata": {"labels": {**labels, LABEL_JOB: name}, "annotations": dict(annotations)},
                "spec": pod_spec,
            },
        },
    }


def _owner_reference(owner: Any, job_name: str) -> dict[str, Any]:
    # A dict (the API's JSON) or the client's V1Job model: both have metadata.name and .uid.
    meta = owner.get("metadata") if isinstance(owner, dict) else getattr(owner, "metadata", None)
    if isinstance(meta, dict):
        name, uid = meta.get("name"), meta.get("uid")
    else:
        name, uid = getattr(meta, "name", None), getattr(meta, "uid", None)
    if not name or not uid:
        raise ValueError(
            f"owner must be the created Job as the API returned it (with metadata.name and metadata.uid), got {owner!r}"
        )
    if name != job_name:
        raise ValueError(
            f"owner is Job {name!r}, but this launch's Job is {job_name!r}: pass the Job that "
            "create_namespaced_job returned for the same run and launch"
        )
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "name": name,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": False,
    }


def _launch_object_metadata(
    cfg: RunConfig,
    launch_id: str,
    settings: PodTemplateSettings,
    owner: dict[str, Any] | None,
    airflow_run_id: str | None,
) -> tuple[str, dict[str, Any]]:
    """The name (the Job's) and metadata of an object that belongs to one launch's Job; with
    ``owner`` (the created Job), owned by it, so it goes when the Job goes."""
    settings.validate()
    _check_ids(launch_id, airflow_run_id)
    name = job_name_for(cfg.run_id, launch_id)
    metadata = _metadata(
        name,
        settings.namespace,
        _labels(cfg, COMPONENT_TRAINING, launch_id, airflow_run_id),
        _annotations(launch_id, airflow_run_id),
    )
    if owner is not None:
        metadata["ownerReferences"] = [_owner_reference(owner, name)]
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
    name, metadata = _launch_object_metadata(cfg, launch_id, settings, owner, airflow_run_id)
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
    name, metadata = _launch_object_metadata(cfg, launch_id, settings, owner, airflow_run_id)
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


def evaluation_job(
    cfg: RunConfig,
    settings: PodTemplateSettings,
    *,
    checkpoint_id: str | None = None,
    airflow_run_id: str | None = None,
) -> dict[str, Any]:
    """The one-pod Job that evaluates checkpoint ``checkpoint_id`` of the run (None: the newest
    committed one that verifies) with ``python -m fsdp_resilience.training.evaluate``, which writes
    ``<run_dir>/eval.json``."""
    settings.validate()
    _check_ids(EVAL_LAUNCH_ID, airflow_run_id)
    _check_under_mount(cfg, settings)
    if checkpoint_id is not None and checkpoint_step(checkpoint_id) is None:
        raise ValueError(f"checkpoint_id={checkpoint_id!r} is not a checkpoint folder name such as 'step_00000100'")
    # One Job per checkpoint: a retried task finds the same Job, a later checkpoint gets its own.
    name = job_name_for(cfg.run_id, EVAL_LAUNCH_ID if checkpoint_id is None else f"{EVAL_LAUNCH_ID}-{checkpoint_id}")
    # No launch label: the evaluation belongs to the run, not to one launch of it.
    labels = _labels(cfg, COMPONENT_EVALUATION, None, airflow_run_id)
    annotations = _annotations(None, airflow_run_id)
    gpus = 1 if settings.gpus(cfg) > 0 else 0
    env = {"PYTHONUNBUFFERED": "1", **settings.env}
    command = ["python", "-m", "fsdp_resilience.training.evaluate", "--config", f"{cfg.run_dir}/run.json"]
    if checkpoint_id is not None:
        command += ["--checkpoint", checkpoint_id]
    # No EFA (one process, no collectives), and so none of the huge pages EFA needs.
    container = _container(
        settings,
        command,
        _env(env, node_id_from_downward_api=True),
        _resources(gpus, 0, settings, hugepages=False, cpu=settings.eval_cpu, memory=settings.eval_memory),
        None,
        efa=0,
    )
    template_meta: dict[str, Any] = {"labels": {**labels, LABEL_JOB: name}}
    if annotations:
        template_meta["annotations"] = dict(annotations)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _metadata(name, settings.namespace, labels, annotations),
        "spec": {
            "completions": 1,
            "parallelism": 1,
            # An evaluation that fails fails the same way again; only a disruption is retried.
            "backoffLimit": settings.max_pod_disruptions,
            "activeDeadlineSeconds": settings.active_deadline_s,
            "ttlSecondsAfterFinished": settings.ttl_after_finished_s,
            "podFailurePolicy": evaluation_pod_failure_policy(),
            "template": {
                "metadata": template_meta,
                "spec": _pod_spec(settings, container, name, subdomain=None, anti_affinity=False),
            },
        },
    }
