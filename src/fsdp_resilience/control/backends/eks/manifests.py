"""The Kubernetes objects of the EKS backend, as plain JSON-safe dicts.

One launch of a run is ONE Indexed Job (a pod per node; completion index = node rank), created
suspended, plus ONE headless Service named like the Job, which gives pod 0 the stable DNS name
that every node rendezvouses at, and ONE NetworkPolicy that admits traffic to the launch's pods
only from the same launch's pods (the rendezvous store is unauthenticated). Evaluation is a
one-pod Job. The dicts are what ``BatchV1Api.create_namespaced_job(namespace, body=...)``,
``CoreV1Api.create_namespaced_service`` and ``NetworkingV1Api.create_namespaced_network_policy``
accept.

Every pod runs as the images' non-root user (uid/gid 1000), with seccomp RuntimeDefault, no
privilege escalation and every capability dropped: they pass Pod Security ``restricted``. (EFA's
memlock limit is the node's, set in containerd's base runtime spec: a capability added to a
non-root container would not be effective anyway.) Training pods are QoS Guaranteed by default
(cpu and memory requests = limits), sized for p5.48xlarge, with a /dev/shm sized from the model
(``PodTemplateSettings.shm_size_for``); one launch's pods share one zone (EFA stays within a
subnet) and carry Karpenter's do-not-disrupt annotation. The pods' settings
(``PodTemplateSettings``) and their validation are in pod_settings.py, the image allowlist in
images.py, the names and labels in constants.py, the objects' labels, annotations and owner
reference in object_metadata.py, and the rendezvous Service and NetworkPolicy in networking.py.

Pure functions: no Kubernetes client, no clock, no randomness. The same inputs give the same
objects, so a retried Airflow task submits byte-for-byte what the first try did.

Torch-free and client-free: the control plane imports this module.
"""

from __future__ import annotations

import copy
import posixpath
from typing import Any

from fsdp_resilience.control.backends.base import job_name_for
from fsdp_resilience.control.backends.eks.constants import (
    COMPONENT_EVALUATION,
    COMPONENT_TRAINING,
    CONFIG_ENV,
    CONTAINER,
    DEVICE_RDMA_ENV,
    DO_NOT_DISRUPT_ANNOTATION,
    EFA_ENV,
    EFA_RESOURCE,
    EVAL_LAUNCH_ID,
    EVAL_SHM_SIZE,
    FSX_VOLUME,
    GPU_RESOURCE,
    JOB_UID_LABEL,
    LABEL_JOB,
    LAUNCH_ID_ENV,
    LAUNCH_UID_ENV,
    NCCL_ENV,
    NODE_ID_ENV,
    POD_UID_ENV,
    RDZV_HOST_ENV,
    RDZV_PORT_NAME,
    SHM_VOLUME,
    TRAINING_COMMAND,
    ZONE_LABEL,
)
from fsdp_resilience.control.backends.eks.failure_policy import (
    evaluation_pod_failure_policy,
    training_backoff_limit,
    training_pod_failure_policy,
)
from fsdp_resilience.control.backends.eks.networking import rendezvous_host
from fsdp_resilience.control.backends.eks.object_metadata import (
    check_ids,
    object_annotations,
    object_labels,
    object_metadata,
)
from fsdp_resilience.control.backends.eks.pod_settings import PodTemplateSettings
from fsdp_resilience.training.contract import RunConfig, checkpoint_step

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


def _field(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _env(pairs: dict[str, str], node_id_from_downward_api: bool, *, launch: bool = False) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = []
    if node_id_from_downward_api:
        # The Kubernetes node name: diagnosis maps faults to nodes by it, replace_nodes cordons it.
        env.append(_field(NODE_ID_ENV, "spec.nodeName"))
    if launch:
        # The pod's UID: a pod the Job recreates for an index keeps the lost pod's host name, so
        # the launch lock tells its predecessor by this. The Job's UID (the label the Job
        # controller sets on its pods): the launch's incarnation, whose final records say whether
        # it ended (a run triggered again under its name reuses the launch id, never the UID).
        env.append(_field(POD_UID_ENV, "metadata.uid"))
        env.append(_field(LAUNCH_UID_ENV, f"metadata.labels['{JOB_UID_LABEL}']"))
    env += [{"name": k, "value": v} for k, v in pairs.items()]
    return env


def success_policy(cfg: RunConfig) -> dict[str, Any] | None:
    """The training Job's successPolicy (batch/v1, GA in Kubernetes 1.33), with spares: the Job
    succeeds once ``cfg.nodes`` of its indexes succeeded, and the Job controller then ends the
    pods left (SuccessCriteriaMet, then Complete). Without it a Job of ``nodes + spares``
    completions never completes while a spare's index has not succeeded.

    Any ``nodes`` indexes, not "0-<nodes-1>": after a spare took a lost node's place, the nodes
    that train are not the first indexes (the lost index's new pod parks as the spare). A
    launcher exits 0 only once the final step is committed (or, a spare, once a node's ``final``
    said so), so ``nodes`` successes are the run's success. Without spares: None, the Job
    completes when every index did. Where the apiserver drops the field (before 1.31, or 1.30's
    alpha gate off), the backend's own rule ends the Job (completion.py)."""
    if not cfg.spare_nodes:
        return None
    return {"rules": [{"succeededCount": cfg.nodes}]}


def _resources(
    gpus: int, efa: int, settings: PodTemplateSettings, *, cpu: str | None, memory: str | None
) -> dict[str, Any]:
    # Extended resources (GPU, EFA) need requests equal to limits.
    requests: dict[str, str] = {}
    limits: dict[str, str] = {}
    if gpus > 0:
        requests[GPU_RESOURCE] = limits[GPU_RESOURCE] = str(gpus)
    if efa > 0:
        requests[EFA_RESOURCE] = limits[EFA_RESOURCE] = str(efa)
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


def _container_security_context() -> dict[str, Any]:
    # Pod Security "restricted": nothing added. EFA needs no capability here: its memlock limit is
    # the node's (containerd's base runtime spec), and CAP_IPC_LOCK added for a non-root user
    # would not be in its effective set anyway (no ambient capabilities, no privilege escalation).
    return {"allowPrivilegeEscalation": False, "privileged": False, "capabilities": {"drop": ["ALL"]}}


def _pod_spec(
    settings: PodTemplateSettings,
    container: dict[str, Any],
    job_name: str,
    *,
    subdomain: str | None,
    anti_affinity: bool,
    shm_size: str,
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
            {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": shm_size}},
        ],
    }
    if subdomain is not None:
        spec["subdomain"] = subdomain
    if anti_affinity:
        this_launch = {"matchLabels": {LABEL_JOB: job_name}}
        spec["affinity"] = {
            # One pod per machine: a node's ranks use all of its GPUs and EFA devices.
            "podAntiAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": [
                    {"labelSelector": this_launch, "topologyKey": "kubernetes.io/hostname"}
                ]
            },
            # All in one zone: EFA works only within a subnet (and so a zone), and FI_PROVIDER=efa
            # has no TCP fallback. The first pod, with no pod of its launch anywhere yet, may go to
            # any zone (the scheduler lets a pod that matches its own term start the group); the
            # others follow it. A pod recreated for an index follows the pods still running.
            "podAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": [
                    {"labelSelector": copy.deepcopy(this_launch), "topologyKey": ZONE_LABEL}
                ]
            },
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
) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": settings.image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": list(command),
        "env": env,
        "securityContext": _container_security_context(),
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
    the pool is whole again without the backend creating a pod. With spares the Job succeeds when
    ``cfg.nodes`` indexes did (``success_policy``); a pod the Job recreates after the launch ended
    exits ``launch_ended`` at once, which the podFailurePolicy ignores.

    Created suspended (``suspend``): no pod starts before the backend has created the launch's
    Service and NetworkPolicy and resumes it (``spec.suspend: false``), so no pod ever runs
    without the DNS name it rendezvouses at."""
    settings.validate()
    check_ids(launch_id, airflow_run_id)
    _check_under_mount(cfg, settings)
    settings.check_memory_fits(cfg)
    name = job_name_for(cfg.run_id, launch_id)
    labels = object_labels(cfg, COMPONENT_TRAINING, launch_id, airflow_run_id)
    annotations = object_annotations(launch_id, airflow_run_id)
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
        _env(env, node_id_from_downward_api=True, launch=True),
        _resources(gpus, efa, settings, cpu=settings.cpu, memory=settings.memory),
        [{"name": RDZV_PORT_NAME, "containerPort": cfg.rdzv_port, "protocol": "TCP"}],
    )
    pod_spec = _pod_spec(
        settings, container, name, subdomain=name, anti_affinity=True, shm_size=settings.shm_size_for(cfg)
    )
    spec: dict[str, Any] = {
        "completionMode": "Indexed",
        "completions": cfg.launch_nodes,
        "parallelism": cfg.launch_nodes,
        "suspend": bool(suspend),
        "backoffLimit": training_backoff_limit(settings),
        "activeDeadlineSeconds": settings.active_deadline_s,
        "ttlSecondsAfterFinished": settings.ttl_after_finished_s,
        "podFailurePolicy": training_pod_failure_policy(),
        "template": {
            "metadata": {
                "labels": {**labels, LABEL_JOB: name},
                # Karpenter must not consolidate or drift a node away under a training pod: each
                # eviction costs the launch a restart and a share of max_pod_disruptions.
                "annotations": {**annotations, DO_NOT_DISRUPT_ANNOTATION: "true"},
            },
            "spec": pod_spec,
        },
    }
    policy = success_policy(cfg)
    if policy is not None:
        spec["successPolicy"] = policy
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": object_metadata(name, settings.namespace, labels, annotations),
        "spec": spec,
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
    check_ids(EVAL_LAUNCH_ID, airflow_run_id)
    _check_under_mount(cfg, settings)
    if checkpoint_id is not None and checkpoint_step(checkpoint_id) is None:
        raise ValueError(f"checkpoint_id={checkpoint_id!r} is not a checkpoint folder name such as 'step_00000100'")
    # One Job per checkpoint: a retried task finds the same Job, a later checkpoint gets its own.
    name = job_name_for(cfg.run_id, EVAL_LAUNCH_ID if checkpoint_id is None else f"{EVAL_LAUNCH_ID}-{checkpoint_id}")
    # No launch label: the evaluation belongs to the run, not to one launch of it.
    labels = object_labels(cfg, COMPONENT_EVALUATION, None, airflow_run_id)
    annotations = object_annotations(None, airflow_run_id)
    gpus = 1 if settings.gpus(cfg) > 0 else 0
    env = {"PYTHONUNBUFFERED": "1", **settings.env}
    command = ["python", "-m", "fsdp_resilience.training.evaluate", "--config", f"{cfg.run_dir}/run.json"]
    if checkpoint_id is not None:
        command += ["--checkpoint", checkpoint_id]
    # No EFA (one process, no collectives).
    container = _container(
        settings,
        command,
        _env(env, node_id_from_downward_api=True),
        _resources(gpus, 0, settings, cpu=settings.eval_cpu, memory=settings.eval_memory),
        None,
    )
    template_meta: dict[str, Any] = {"labels": {**labels, LABEL_JOB: name}}
    if annotations:
        template_meta["annotations"] = dict(annotations)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": object_metadata(name, settings.namespace, labels, annotations),
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
                "spec": _pod_spec(
                    settings,
                    container,
                    name,
                    subdomain=None,
                    anti_affinity=False,
                    # No async checkpoint here: only an explicit shm_size changes it.
                    shm_size=settings.shm_size or EVAL_SHM_SIZE,
                ),
            },
        },
    }
