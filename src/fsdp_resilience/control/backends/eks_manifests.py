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
p5.48xlarge. Image references are checked against an allowlist of registry/repository prefixes
(``image_allowed``): whoever triggers a run cannot bring an arbitrary image to the shared FSx.

Pure functions: no Kubernetes client, no clock, no randomness. The same inputs give the same
objects, so a retried Airflow task submits byte-for-byte what the first try did.

Torch-free and client-free: the control plane imports this module.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import posixpath
import re
from dataclasses import dataclass, field
from typing import Any

from fsdp_resilience.control.backends.base import job_name_for
from fsdp_resilience.training.contract import ExitCode, RunConfig, checkpoint_step

#: The supported EKS range is OLDEST_SUPPORTED_K8S..NEWEST_SUPPORTED_K8S (1.30-1.33). The floor
#: is the deploy kit's: its ValidatingAdmissionPolicies (node writes, NodeClaim deletes, the
#: training namespace's pod rules) use admissionregistration.k8s.io/v1, GA and served from 1.30.
#: The objects built here need 1.29: the Jobs rely on podFailurePolicy (beta and on by default
#: since 1.26, GA in 1.31) and the DisruptionTarget pod condition, but up to 1.28 the schema wants
#: ``onPodConditions`` on every rule, exit-code rules included; and from 1.29 a Job with a
#: podFailurePolicy replaces a failed pod only once it has fully terminated (podReplacementPolicy),
#: so two pods never hold the same index and hostname at once.
OLDEST_SUPPORTED_K8S = "1.30"
#: The newest Kubernetes the objects and the kit are validated against (and the fake apiserver serves).
NEWEST_SUPPORTED_K8S = "1.33"

#: The one container of every pod; the Job's podFailurePolicy rules refer to it by name.
CONTAINER = "trainer"
LABEL_RUN = "fsdp-resilience/run-id"  # value: the run id (a DNS-1123 label, so a valid label value)
LABEL_LAUNCH = "fsdp-resilience/launch-id"  # value: label_value(launch id); exact id in an annotation
LABEL_JOB = "fsdp-resilience/job-name"  # on pods: the Job's name; the Service selects by it
LABEL_AIRFLOW_RUN = "fsdp-resilience/airflow-run-id"  # value: label_value(dag run id); exact in an annotation
LABEL_COMPONENT = "app.kubernetes.io/component"
MANAGED_BY = {"app.kubernetes.io/managed-by": "fsdp-resilience", "app.kubernetes.io/name": "fsdp-training"}

COMPONENT_TRAINING = "training"
COMPONENT_EVALUATION = "evaluation"
#: Annotations carry the exact ids, which label values may not hold (``:``, ``+``, > 63 chars).
ANNOTATION_LAUNCH = LABEL_LAUNCH
ANNOTATION_AIRFLOW_RUN = LABEL_AIRFLOW_RUN
#: The evaluation Job's name is ``job_name_for(run_id, "eval-<checkpoint id>")`` (``EVAL_LAUNCH_ID``
#: alone when no checkpoint is named).
EVAL_LAUNCH_ID = "eval"

#: The name of the container port (and Service port) the rendezvous store listens on.
RDZV_PORT_NAME = "rdzv"
SHM_VOLUME = "dshm"
FSX_VOLUME = "fsx"
GPU_RESOURCE = "nvidia.com/gpu"
EFA_RESOURCE = "vpc.amazonaws.com/efa"
HUGEPAGES_RESOURCE = "hugepages-2Mi"

TRAINING_COMMAND = ["python", "-m", "fsdp_resilience.training.launch"]
#: The env the data plane reads (src/fsdp_resilience/training/launch.py, src/fsdp_resilience/training/contract/).
#: settings.env may not override these: they are what makes a pod a node of this launch.
CONFIG_ENV = "TRAINING_RUN_CONFIG"
LAUNCH_ID_ENV = "TRAINING_LAUNCH_ID"
NODE_ID_ENV = "TRAINING_NODE_ID"
RDZV_HOST_ENV = "TRAINING_RDZV_HOST"
RESERVED_ENV = frozenset({CONFIG_ENV, LAUNCH_ID_ENV, NODE_ID_ENV, RDZV_HOST_ENV})

#: libfabric over EFA, as the AWS EFA-on-EKS guides set it up (only when the pods get EFA devices).
EFA_ENV = {
    # Use the EFA provider, never a silent fallback to TCP sockets (which still "works", slowly).
    "FI_PROVIDER": "efa",
    # The launcher, workers and data loaders fork; without this a child can corrupt the parent's
    # RDMA-registered memory.
    "FI_EFA_FORK_SAFE": "1",
}
#: GPUDirect RDMA: the NIC reads and writes GPU memory without a host copy. Only on the instance
#: families whose EFA devices support it (DEVICE_RDMA_FAMILIES): elsewhere (g5, g6e...) libfabric
#: refuses to start with it set. An instance type not listed gets no setting, and libfabric decides.
DEVICE_RDMA_ENV = {"FI_EFA_USE_DEVICE_RDMA": "1"}
#: EC2 instance families (the part of the type before the '.') with EFA device RDMA to the GPUs.
DEVICE_RDMA_FAMILIES = frozenset({"p4d", "p4de", "p5", "p5e", "p5en", "p6-b200", "p6-b300", "p6e-gb200"})
#: Node label with the EC2 instance type (set by the kubelet on EKS; Karpenter selects by it too).
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"
#: Only what EFA needs: libfabric registers (pins) memory with the NIC, beyond the default memlock.
EFA_CAPABILITIES = ("IPC_LOCK",)
#: NCCL behaviour the restart layers rely on (only when the pods get GPUs).
NCCL_ENV = {
    # NCCL's bootstrap traffic goes over the pod's network interface, never loopback or a bridge.
    "NCCL_SOCKET_IFNAME": "^lo,docker",
    # NCCL errors (a dead EFA link, a peer gone) reach the pod log that diagnose() reads,
    # without INFO's volume.
    "NCCL_DEBUG": "WARN",
    # A NCCL error or timeout aborts the communicator and fails the rank instead of hanging it,
    # so NVRx's restart layers see the fault (ft_launcher also defaults it to 1).
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
}

_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_LABEL_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")
_LABEL_EDGE = re.compile(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$")
#: A Kubernetes resource quantity ("64Gi", "500m", "1.5", "1e3").
_QUANTITY = re.compile(r"^[+]?(\d+(\.\d*)?|\.\d+)(([KMGTPE]i)|[numkMGTPE]|[eE][+-]?\d+)?$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")
_INSTANCE_TYPE = re.compile(r"^[a-z][a-z0-9-]*\.[a-z0-9-]+$")
LABEL_VALUE_MAX = 63
_HASH_LEN = 8

_TOLERATION_FIELDS = {"key", "operator", "value", "effect", "tolerationSeconds"}
_TOLERATION_OPERATORS = ("Exists", "Equal")
_TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
_PULL_POLICIES = ("Always", "IfNotPresent", "Never")


def label_value(text: str) -> str:
    """``text`` as a valid label value: unchanged if it already is one, else cleaned and cut to fit,
    with a short hash of the exact text appended (so two ids that clean up alike stay distinct).

    ``manual__2026-11-30T07:35:43.123456+00:00`` -> ``manual__2026-11-30T07-35-43.123456-00-00-<hash>``.
    """
    if not isinstance(text, str):
        raise TypeError(f"label_value needs a string, got {type(text).__name__}")
    if text and len(text) <= LABEL_VALUE_MAX and _LABEL_VALUE.match(text):
        return text
    digest = hashlib.sha256(text.encode()).hexdigest()[:_HASH_LEN]
    readable = _LABEL_UNSAFE.sub("-", text)[: LABEL_VALUE_MAX - _HASH_LEN - 1]
    readable = _LABEL_EDGE.sub("", readable)
    return f"{readable}-{digest}" if readable else digest


def rendezvous_host(job_name: str, namespace: str) -> str:
    """The DNS name of the pod with completion index 0: an Indexed Job's pod is named
    ``<job>-<index>`` and, with ``subdomain=<job>``, resolvable through the headless Service."""
    return f"{job_name}-0.{job_name}.{namespace}.svc"


def _is_quantity(value: Any) -> bool:
    return isinstance(value, str) and bool(_QUANTITY.match(value))


def _is_label_key(key: Any) -> bool:
    if not isinstance(key, str) or not key:
        return False
    prefix, slash, name = key.rpartition("/")
    if slash and (not prefix or len(prefix) > 253 or not _DNS1123_SUBDOMAIN.match(prefix)):
        return False
    return len(name) <= 63 and bool(_LABEL_NAME.match(name))


def _is_nonneg_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass(frozen=True)
class PodTemplateSettings:
    """Everything about the pods that is not the run config: image, placement, devices, limits,
    the user they run as, and how many disruptions a launch survives. The defaults fit a pool of
    p5.48xlarge nodes (8 GPUs, 32 EFA interfaces, device RDMA); set instance_type, gpus_per_node,
    efa_per_node, cpu, memory (and eval_cpu, eval_memory) together for another instance type.

    Not validated when constructed (a backend that only watches jobs may hold settings without an
    image); every builder calls ``validate`` first. JSON-safe through ``to_dict``/``from_dict``.
    """

    image: str
    namespace: str = "fsdp-training"
    service_account: str = "fsdp-training"
    #: The PVC bound to the FSx for Lustre static PV (ReadWriteMany): run dirs and datasets.
    fsx_claim: str = "fsx-training"
    #: Where the FSx volume is mounted; RunConfig.run_dir and dataset_dir must lie under it.
    fsx_mount_path: str = "/fsx"
    node_selector: dict[str, str] = field(default_factory=lambda: {"fsdp-resilience/pool": "gpu"})
    tolerations: list[dict[str, Any]] = field(default_factory=lambda: [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}])
    #: The EC2 instance type of the GPU pool. It decides FI_EFA_USE_DEVICE_RDMA (only on types with
    #: device RDMA, DEVICE_RDMA_FAMILIES) and is added to the pods' nodeSelector
    #: (node.kubernetes.io/instance-type), so the pods land only where that decision, and the
    #: cpu/memory/GPU/EFA sizes below, hold. None: a mixed pool; no selector and no RDMA setting.
    instance_type: str | None = "p5.48xlarge"
    #: GPUs per pod: the pool's GPUs per node (p5.48xlarge has 8), so a node whose device plugin has
    #: not registered them (allocatable 0) neither takes a pod nor counts as healthy capacity. None:
    #: cfg.procs_per_node; 0: no GPU request (CPU clusters). procs_per_node may not exceed it.
    gpus_per_node: int | None = 8
    #: EFA interfaces per pod (p5.48xlarge has 32); 0: no EFA devices and no EFA env.
    efa_per_node: int = 32
    #: Add CAP_IPC_LOCK to EFA pods (efa_per_node > 0): libfabric registers (pins) memory with the
    #: NIC and needs an unlimited memlock or this capability; the EKS AL2023 runtime spec raises only
    #: RLIMIT_NOFILE. False: only for AMIs/runtimes that raise RLIMIT_MEMLOCK themselves; the pods
    #: then pass Pod Security "restricted" (IPC_LOCK needs the kit's pod policy, see deploy/).
    efa_ipc_lock: bool = True
    #: e.g. "5120Mi" where the AMI's EFA driver needs 2 MiB huge pages; needs ``memory`` set.
    hugepages_2mi: str | None = None
    #: Size of the memory-backed /dev/shm (NCCL and data loader workers share memory through it;
    #: a container's default 64 MiB is far too small). It counts against ``memory``.
    shm_size: str = "64Gi"
    #: The training pod's cpu and memory requests. Sized for p5.48xlarge (allocatable about 192 vCPU
    #: and 2 TiB), leaving room for the daemonsets (EFA and GPU device plugins, CNI, node agents).
    cpu: str | None = "180"
    memory: str | None = "1800Gi"
    #: QoS Guaranteed: the cpu limit equals the request too (memory and devices always do), so the
    #: kubelet evicts these pods last under node pressure and a static CPU manager pins whole cores.
    #: False: no cpu limit (Burstable). Needs cpu and memory set.
    guaranteed_qos: bool = True
    #: The evaluation pod (one GPU, no EFA): about one GPU's share of a p5.48xlarge; requests = limits.
    eval_cpu: str | None = "22"
    eval_memory: str | None = "225Gi"
    #: The images' user and group (numeric, so runAsNonRoot can be checked without the image).
    run_as_user: int = 1000
    run_as_group: int = 1000
    #: Disrupted pods (evicted, preempted, lost with their node) a Job replaces. Kubernetes has one
    #: failure budget per Job, so the Job's backoffLimit is backoff_limit + max_pod_disruptions
    #: (training_backoff_limit); beyond it the Job fails (BackoffLimitExceeded) and the backend
    #: reports restarts_exhausted when disruptions used it up, so the ladder relaunches. Without a
    #: bound (podFailurePolicy Ignore) the Job controller would recreate evicted pods for ever.
    max_pod_disruptions: int = 3
    #: Failed pods with an exit code outside the run contract (exit 1, an OOM kill) a Job replaces.
    backoff_limit: int = 2
    active_deadline_s: int = 7 * 86400
    #: Finished Jobs (and their pods and logs) are kept this long, long enough to diagnose.
    ttl_after_finished_s: int = 3 * 86400
    #: Time between SIGTERM and SIGKILL: the launcher flushes an async checkpoint in it.
    termination_grace_s: int = 120
    priority_class: str | None = None
    image_pull_policy: str = "IfNotPresent"
    #: Extra env for the trainer (e.g. NCCL tuning); overrides the defaults above, not the
    #: TRAINING_* variables of the run contract.
    env: dict[str, str] = field(default_factory=dict)

    def validate(self) -> None:
        """Raise ValueError naming the wrong field and what to set instead."""

        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"PodTemplateSettings.{name}={getattr(self, name)!r} {why}")

        try:
            image_repository(self.image)
        except ValueError:
            raise bad("image", "must be a container image reference such as "
                               "'123456789012.dkr.ecr.us-west-2.amazonaws.com/fsdp-training:1.0' (a digest, "
                               "'@sha256:...', pins it)") from None
        if not isinstance(self.namespace, str) or len(self.namespace) > 63 or not _DNS1123_LABEL.match(self.namespace):
            raise bad("namespace", "must be a Kubernetes namespace name (lowercase letters, digits and '-', "
                                   "at most 63 characters)")
        for name in ("service_account", "fsx_claim"):
            value = getattr(self, name)
            if not isinstance(value, str) or len(value) > 253 or not _DNS1123_SUBDOMAIN.match(value):
                raise bad(name, "must be a Kubernetes object name (lowercase letters, digits, '-' and '.')")
        mount = self.fsx_mount_path
        if (not isinstance(mount, str) or not mount.startswith("/") or posixpath.normpath(mount) != mount
                or mount == "/"):
            raise bad("fsx_mount_path", "must be a normalised absolute path below '/', such as '/fsx'")
        if mount == "/dev/shm" or mount.startswith("/dev/shm/") or "/dev/shm".startswith(mount + "/"):
            raise bad("fsx_mount_path", "overlaps /dev/shm, where the shared-memory volume is mounted; "
                                        "use a path such as '/fsx'")
        if not isinstance(self.node_selector, dict) or not all(
                _is_label_key(k) and isinstance(v, str) and len(v) <= 63 and _LABEL_VALUE.match(v)
                for k, v in self.node_selector.items()):
            raise bad("node_selector", "must map label keys to label values, e.g. {'fsdp-resilience/pool': 'gpu'}")
        self._validate_tolerations()
        if self.gpus_per_node is not None and not (_is_nonneg_int(self.gpus_per_node) and self.gpus_per_node <= 64):
            raise bad("gpus_per_node", "must be between 0 and 64, or None for one GPU per process (procs_per_node)")
        if not _is_nonneg_int(self.efa_per_node) or self.efa_per_node > 64:
            raise bad("efa_per_node", "must be between 0 (no EFA) and 64 (p5.48xlarge has 32)")
        if self.instance_type is not None and (not isinstance(self.instance_type, str)
                                               or not _INSTANCE_TYPE.match(self.instance_type)):
            raise bad("instance_type", "must be an EC2 instance type such as 'p5.48xlarge', or None for a mixed pool")
        for name in ("efa_ipc_lock", "guaranteed_qos"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be true or false")
        for name in ("run_as_user", "run_as_group"):
            if not _is_nonneg_int(getattr(self, name)) or getattr(self, name) == 0:
                raise bad(name, "must be the images' non-root numeric id (1000 in images/), not 0")
        if not _is_nonneg_int(self.max_pod_disruptions) or self.max_pod_disruptions > 100:
            raise bad("max_pod_disruptions", "must be between 0 and 100 (disrupted pods a launch survives)")
        for name in ("hugepages_2mi", "cpu", "memory", "eval_cpu", "eval_memory"):
            value = getattr(self, name)
            if value is not None and not _is_quantity(value):
                raise bad(name, "must be a Kubernetes quantity such as '5120Mi', '96' or '500m', or None")
        if not _is_quantity(self.shm_size):
            raise bad("shm_size", "must be a Kubernetes quantity such as '64Gi'")
        if self.guaranteed_qos and (self.cpu is None or self.memory is None):
            raise bad("guaranteed_qos", f"needs cpu and memory set (cpu={self.cpu!r}, memory={self.memory!r}): "
                                        "QoS Guaranteed means requests = limits for both; set them or "
                                        "guaranteed_qos=false")
        if self.hugepages_2mi is not None and self.memory is None:
            raise bad("hugepages_2mi", "needs memory set too: Kubernetes rejects a pod that requests huge pages "
                                       "without a memory (or CPU) request; set memory, e.g. '1000Gi'")
        if not _is_nonneg_int(self.backoff_limit) or self.backoff_limit > 100:
            raise bad("backoff_limit", "must be between 0 and 100 (pod failures a Job absorbs before it fails)")
        for name in ("active_deadline_s", "ttl_after_finished_s", "termination_grace_s"):
            if not _is_nonneg_int(getattr(self, name)):
                raise bad(name, "must be a whole number of seconds, 0 or more")
        if self.active_deadline_s == 0:
            raise bad("active_deadline_s", "must be more than 0 seconds (the most a Job may run)")
        if self.priority_class is not None and (not isinstance(self.priority_class, str)
                                                or not _DNS1123_SUBDOMAIN.match(self.priority_class)):
            raise bad("priority_class", "must be the name of a PriorityClass, or None")
        if self.image_pull_policy not in _PULL_POLICIES:
            raise bad("image_pull_policy", f"must be one of {', '.join(_PULL_POLICIES)}")
        if not isinstance(self.env, dict):
            raise bad("env", "must map variable names to string values")
        for name, value in self.env.items():
            if not isinstance(name, str) or not _ENV_NAME.match(name):
                raise bad("env", f"has an invalid variable name {name!r}; use letters, digits and '_'")
            if not isinstance(value, str):
                raise bad("env", f"sets {name} to {value!r}; values must be strings (quote numbers)")
            if name in RESERVED_ENV:
                raise bad("env", f"sets {name}, which the backend sets from the run config and launch; remove it")

    def _validate_tolerations(self) -> None:
        where = f"PodTemplateSettings.tolerations={self.tolerations!r}"
        if not isinstance(self.tolerations, list):
            raise ValueError(f"{where} must be a list of tolerations (dicts)")
        for t in self.tolerations:
            if not isinstance(t, dict) or not t:
                raise ValueError(f"{where}: {t!r} is not a toleration; use e.g. "
                                 "{'key': 'nvidia.com/gpu', 'operator': 'Exists', 'effect': 'NoSchedule'}")
            unknown = sorted(set(t) - _TOLERATION_FIELDS)
            if unknown:
                raise ValueError(f"{where}: unknown toleration field(s) {unknown}; "
                                 f"use {sorted(_TOLERATION_FIELDS)}")
            if t.get("operator", "Equal") not in _TOLERATION_OPERATORS:
                raise ValueError(f"{where}: operator must be one of {_TOLERATION_OPERATORS}")
            if t.get("operator") == "Exists" and t.get("value"):
                raise ValueError(f"{where}: a toleration with operator Exists takes no value; remove it "
                                 "or use operator Equal")
            if t.get("key") in (None, "") and t.get("operator") != "Exists":
                raise ValueError(f"{where}: a toleration without a key must use operator Exists")
            if t.get("effect") not in (None, *_TAINT_EFFECTS):
                raise ValueError(f"{where}: effect must be one of {_TAINT_EFFECTS}")
            if t.get("key") is not None and not _is_label_key(t["key"]):
                raise ValueError(f"{where}: key {t['key']!r} is not a valid taint key")
            if "tolerationSeconds" in t and not _is_nonneg_int(t["tolerationSeconds"]):
                raise ValueError(f"{where}: tolerationSeconds must be a whole number of seconds")

    def gpus(self, cfg: RunConfig) -> int:
        """GPUs each training pod requests."""
        return cfg.procs_per_node if self.gpus_per_node is None else self.gpus_per_node

    def pod_node_selector(self) -> dict[str, str]:
        """The pods' nodeSelector: ``node_selector`` plus the instance type, when set."""
        selector = dict(self.node_selector)
        if self.instance_type is not None:
            selector.setdefault(INSTANCE_TYPE_LABEL, self.instance_type)
        return selector

    def device_rdma(self) -> bool:
        """Whether the pool's EFA devices do GPUDirect RDMA (FI_EFA_USE_DEVICE_RDMA=1)."""
        return self.instance_type is not None and self.instance_type.split(".")[0] in DEVICE_RDMA_FAMILIES

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(dataclasses.asdict(self))

    @classmethod
    def from_dict(cls, data: dict[str, Any], validate: bool = True) -> "PodTemplateSettings":
        """Settings from a dict (unknown keys refused), validated unless ``validate=False`` (a
        backend built before it knows its image; every builder validates)."""
        if not isinstance(data, dict):
            raise TypeError(f"PodTemplateSettings.from_dict needs a dict, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown pod template setting(s) {unknown}; known settings: {sorted(known)}")
        settings = cls(**copy.deepcopy(data))
        if validate:
            settings.validate()
        return settings


# --------------------------------------------------------------------------------------------
# Images: references and the allowlist
# --------------------------------------------------------------------------------------------

# The reference grammar of the distribution project (what containerd and the registries parse):
# [domain[:port]/]path-component(/path-component)*[:tag][@algorithm:hex].
_DOMAIN_COMPONENT = r"(?:[A-Za-z0-9]|[A-Za-z0-9][A-Za-z0-9-]*[A-Za-z0-9])"
_DOMAIN = rf"{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*(?::[0-9]+)?"
_PATH_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_NAME = rf"(?:{_DOMAIN}/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*"
_IMAGE_NAME = re.compile(_NAME)  # always fullmatch: "$" would let a newline through
_TAG = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}"
_DIGEST = r"[a-z0-9]+(?:[+._-][a-z0-9]+)*:[0-9a-fA-F]{32,}"
_IMAGE_REFERENCE = re.compile(rf"(?P<name>{_NAME})(?::(?P<tag>{_TAG}))?(?:@(?P<digest>{_DIGEST}))?")
_NAME_MAX = 255


def image_repository(image: str) -> str:
    """The repository of an image reference: the reference without its ``:tag`` and ``@digest``
    (``123.dkr.ecr.us-west-2.amazonaws.com/fsdp-training:1.0`` -> ``...amazonaws.com/fsdp-training``).
    Raises ValueError for what is not a valid reference."""
    match = _IMAGE_REFERENCE.fullmatch(image) if isinstance(image, str) else None
    if not match or len(match.group("name")) > _NAME_MAX:
        raise ValueError(f"{image!r} is not a container image reference such as "
                         "'123456789012.dkr.ecr.us-west-2.amazonaws.com/fsdp-training:1.0' (registry/repository, "
                         "then :tag and/or @sha256:<digest>)")
    return match.group("name")


def check_image_prefix(prefix: str) -> str:
    """An allowlist entry, normalised (no trailing '/'): a registry (``123.dkr.ecr...amazonaws.com``)
    or a repository in it (``.../fsdp-training``), never with a tag or digest."""
    text = prefix.strip().rstrip("/") if isinstance(prefix, str) else ""
    if not text or not _IMAGE_NAME.fullmatch(text):
        raise ValueError(f"image allowlist entry {prefix!r} is not a registry or repository such as "
                         "'123456789012.dkr.ecr.us-west-2.amazonaws.com/fsdp-training' (no :tag, no @digest)")
    return text


def image_allowed(image: str, prefixes: list[str] | tuple[str, ...]) -> bool:
    """Whether ``image`` is in a repository under one of ``prefixes``, compared by whole path
    components: ``.../fsdp-training`` allows ``.../fsdp-training:1.0``, ``.../fsdp-training@sha256:...``
    and ``.../fsdp-training/sub:1``, never ``.../fsdp-training-evil:1``. An image that is not a valid
    reference is never allowed. Comparison is textual: ``ubuntu`` is not ``docker.io/library/ubuntu``."""
    try:
        components = image_repository(image).split("/")
    except ValueError:
        return False
    for prefix in prefixes:
        wanted = check_image_prefix(prefix).split("/")
        if components[:len(wanted)] == wanted:
            return True
    return False


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
                f"PodTemplateSettings.fsx_mount_path to where the FSx volume holds it")


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


def _resources(gpus: int, efa: int, settings: PodTemplateSettings, *, hugepages: bool, cpu: str | None,
               memory: str | None) -> dict[str, Any]:
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
    return {"runAsNonRoot": True, "runAsUser": settings.run_as_user, "runAsGroup": settings.run_as_group,
            "seccompProfile": {"type": "RuntimeDefault"}}


def _container_security_context(settings: PodTemplateSettings, efa: int) -> dict[str, Any]:
    capabilities: dict[str, Any] = {"drop": ["ALL"]}
    if efa > 0 and settings.efa_ipc_lock:
        capabilities["add"] = list(EFA_CAPABILITIES)
    return {"allowPrivilegeEscalation": False, "privileged": False, "capabilities": capabilities}


def _pod_spec(settings: PodTemplateSettings, container: dict[str, Any], job_name: str,
              *, subdomain: str | None, anti_affinity: bool) -> dict[str, Any]:
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
        spec["affinity"] = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{
            "labelSelector": {"matchLabels": {LABEL_JOB: job_name}},
            "topologyKey": "kubernetes.io/hostname",
        }]}}
    if settings.priority_class is not None:
        spec["priorityClassName"] = settings.priority_class
    return spec


def _container(settings: PodTemplateSettings, command: list[str], env: list[dict[str, Any]],
               resources: dict[str, Any], ports: list[dict[str, Any]] | None, *, efa: int) -> dict[str, Any]:
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
USER_ERROR_EXIT_CODES = (ExitCode.CONFIG_ERROR, ExitCode.USER_ERROR, ExitCode.NON_FINITE,
                         ExitCode.STORAGE_ERROR)
#: Another launcher of the run holds the node's launch lock: the run is being trained elsewhere. A
#: new pod would be refused the same way (or, worse, get the lock when the other one ends and train
#: a run nobody asked it to), so nothing retries it blindly.
ALREADY_RUNNING_EXIT_CODES = (ExitCode.ALREADY_RUNNING,)
#: Exit codes after which the data plane already used its own restarts: relaunching (perhaps on
#: replaced nodes) is the control plane's decision, not the Job controller's.
GAVE_UP_EXIT_CODES = (ExitCode.RESTARTS_EXHAUSTED, ExitCode.NO_PROGRESS)


def _exit_code_rule(codes: tuple[ExitCode, ...]) -> dict[str, Any]:
    return {"action": "FailJob", "onExitCodes": {
        "containerName": CONTAINER, "operator": "In", "values": sorted(int(c) for c in codes)}}


def training_pod_failure_policy() -> dict[str, Any]:
    """The training Job's podFailurePolicy. Rules apply in order, first match wins: a disrupted
    pod counts against backoffLimit whatever its exit code (it was killed from outside); a pod
    that exits with one of the contract's final codes fails the whole Job at once; any other
    failure (exit 1: unknown, an OOM kill) is retried by the Job controller within backoffLimit."""
    return {"rules": [copy.deepcopy(_COUNT_DISRUPTION), _exit_code_rule(USER_ERROR_EXIT_CODES),
                      _exit_code_rule(ALREADY_RUNNING_EXIT_CODES), _exit_code_rule(GAVE_UP_EXIT_CODES)]}


def training_backoff_limit(settings: PodTemplateSettings) -> int:
    """The training Job's backoffLimit: failed pods it replaces before it fails. One Kubernetes
    budget for two kinds: ``backoff_limit`` failures with an exit code outside the contract, and
    ``max_pod_disruptions`` pods evicted, preempted or lost with their node."""
    return settings.backoff_limit + settings.max_pod_disruptions


def evaluation_pod_failure_policy() -> dict[str, Any]:
    """The evaluation Job's: a disruption is retried (within max_pod_disruptions); an evaluation
    that fails fails the same way again, so any failing exit code fails the Job at once."""
    return {"rules": [copy.deepcopy(_COUNT_DISRUPTION), {"action": "FailJob", "onExitCodes": {
        "containerName": CONTAINER, "operator": "NotIn", "values": [0]}}]}


# --------------------------------------------------------------------------------------------
# The objects
# --------------------------------------------------------------------------------------------


def training_job(cfg: RunConfig, launch_id: str, settings: PodTemplateSettings, *,
                 airflow_run_id: str | None = None, suspend: bool = True) -> dict[str, Any]:
    """The Indexed Job of one launch: ``cfg.launch_nodes`` pods, one per machine, completion
    index = node rank (src/fsdp_resilience/training/launch.py reads JOB_COMPLETION_INDEX), all rendezvousing at pod 0.
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
        raise ValueError(f"RunConfig.procs_per_node={cfg.procs_per_node} is more than the {gpus} GPU(s) each pod "
                         f"gets (PodTemplateSettings.gpus_per_node={settings.gpus_per_node}): one process per GPU; "
                         "lower procs_per_node, or raise gpus_per_node to the GPUs of the pool's nodes")

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
        settings, TRAINING_COMMAND, _env(env, node_id_from_downward_api=True),
        _resources(gpus, efa, settings, hugepages=True, cpu=settings.cpu, memory=settings.memory),
        [{"name": RDZV_PORT_NAME, "containerPort": cfg.rdzv_port, "protocol": "TCP"}], efa=efa)
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
        raise ValueError("owner must be the created Job as the API returned it (with metadata.name and "
                         f"metadata.uid), got {owner!r}")
    if name != job_name:
        raise ValueError(f"owner is Job {name!r}, but this launch's Job is {job_name!r}: pass the Job that "
                         "create_namespaced_job returned for the same run and launch")
    return {"apiVersion": "batch/v1", "kind": "Job", "name": name, "uid": uid,
            "controller": True, "blockOwnerDeletion": False}


def _launch_object_metadata(cfg: RunConfig, launch_id: str, settings: PodTemplateSettings,
                            owner: dict[str, Any] | None, airflow_run_id: str | None) -> tuple[str, dict[str, Any]]:
    """The name (the Job's) and metadata of an object that belongs to one launch's Job; with
    ``owner`` (the created Job), owned by it, so it goes when the Job goes."""
    settings.validate()
    _check_ids(launch_id, airflow_run_id)
    name = job_name_for(cfg.run_id, launch_id)
    metadata = _metadata(name, settings.namespace, _labels(cfg, COMPONENT_TRAINING, launch_id, airflow_run_id),
                         _annotations(launch_id, airflow_run_id))
    if owner is not None:
        metadata["ownerReferences"] = [_owner_reference(owner, name)]
    return name, metadata


def rendezvous_service(cfg: RunConfig, launch_id: str, settings: PodTemplateSettings, *,
                       owner: dict[str, Any] | None = None, airflow_run_id: str | None = None) -> dict[str, Any]:
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
            "ports": [{"name": RDZV_PORT_NAME, "port": cfg.rdzv_port, "targetPort": cfg.rdzv_port,
                       "protocol": "TCP"}],
        },
    }


def rendezvous_network_policy(cfg: RunConfig, launch_id: str, settings: PodTemplateSettings, *,
                              owner: dict[str, Any] | None = None,
                              airflow_run_id: str | None = None) -> dict[str, Any]:
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


def evaluation_job(cfg: RunConfig, settings: PodTemplateSettings, *, checkpoint_id: str | None = None,
                   airflow_run_id: str | None = None) -> dict[str, Any]:
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
    container = _container(settings, command, _env(env, node_id_from_downward_api=True),
                           _resources(gpus, 0, settings, hugepages=False, cpu=settings.eval_cpu,
                                      memory=settings.eval_memory), None, efa=0)
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
