"""The EKS pods' own settings (``PodTemplateSettings``: image, placement, devices, limits, the user
they run as, the disruptions a launch survives) and their validation: every builder in
manifests.py validates first, so a wrong field fails with its name and what to set instead.

Torch-free and client-free.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import posixpath
import re
from dataclasses import dataclass, field
from typing import Any

from fsdp_resilience.control.backends.eks.constants import (
    DEVICE_RDMA_FAMILIES,
    INSTANCE_TYPE_LABEL,
    LABEL_VALUE_FORMAT,
    NODE_ALLOCATABLE_FRACTION,
    NODE_MEMORY_GIB,
    RESERVED_ENV,
    SHM_MARGIN,
    ZONE_LABEL,
)
from fsdp_resilience.control.backends.eks.images import image_repository
from fsdp_resilience.training.contract import GIB, RunConfig, host_memory_for_preset

_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
#: A Kubernetes resource quantity ("64Gi", "500m", "1.5", "1e3").
_QUANTITY = re.compile(r"^[+]?(\d+(\.\d*)?|\.\d+)(([KMGTPE]i)|[numkMGTPE]|[eE][+-]?\d+)?$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")
_INSTANCE_TYPE = re.compile(r"^[a-z][a-z0-9-]*\.[a-z0-9-]+$")

#: An AWS availability zone ("us-west-2a", "us-gov-west-1b") or Local Zone ("us-west-2-lax-1a").
_ZONE = re.compile(r"^[a-z]{2}(-[a-z]+)+-\d+([a-z]|-[a-z0-9]+-\d+[a-z])$")

#: Settings that no longer exist, and why: from_dict refuses them with this, so an old FSDP_EKS_POD
#: fails with what to do rather than as an unknown key.
REMOVED_SETTINGS = {
    "efa_ipc_lock": (
        "adding CAP_IPC_LOCK does nothing for the pods' non-root user (no ambient capabilities, no "
        "privilege escalation). EFA's memlock limit is now set on the node, in containerd's base "
        "runtime spec (the kit's example EC2NodeClass user data, docs/run-on-eks.md 'memlock'); "
        "remove the key"
    ),
    "hugepages_2mi": (
        "the EKS AL2023 GPU AMI reserves no 2 MiB huge pages and Karpenter does not model them, so a "
        "pod requesting them never schedules; EFA works without them. Remove the key"
    ),
}

_TOLERATION_FIELDS = {"key", "operator", "value", "effect", "tolerationSeconds"}
_TOLERATION_OPERATORS = ("Exists", "Equal")
_TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
_PULL_POLICIES = ("Always", "IfNotPresent", "Never")


def _is_quantity(value: Any) -> bool:
    return isinstance(value, str) and bool(_QUANTITY.match(value))


_SUFFIX_FACTORS = {
    **{s: 1024**i for i, s in enumerate(("", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))},
    **{s: 1000**i for i, s in enumerate(("k", "M", "G", "T", "P", "E"), start=1)},
    "n": 1e-9,
    "u": 1e-6,
    "m": 1e-3,
}


def quantity_bytes(value: str) -> float:
    """A Kubernetes quantity ("1800Gi", "64G", "1e9", "500m") as a number (bytes for memory)."""
    if not _is_quantity(value):
        raise ValueError(f"{value!r} is not a Kubernetes quantity such as '64Gi'")
    match = re.match(r"^[+]?(\d+(?:\.\d*)?|\.\d+)(.*)$", value)
    number, suffix = float(match.group(1)), match.group(2)
    if suffix[:1] in ("e", "E"):
        return number * 10 ** int(suffix[1:])
    return number * _SUFFIX_FACTORS[suffix]


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.0f}"


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
    tolerations: list[dict[str, Any]] = field(
        default_factory=lambda: [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    )
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
    #: Size of the memory-backed /dev/shm of the training pods. The async checkpoint stages each
    #: save there (the node's share of the weights and both AdamW moments: under HSDP a whole
    #: replica, about 87 GiB for 8b), and NCCL and libfabric use it too. None (the default): sized
    #: from the run's model preset, nodes and ranks a node (``shm_size_for``). A quantity such as
    #: "160Gi" overrides it, if it holds at least the estimate. It counts against ``memory``.
    shm_size: str | None = None
    #: Pin every pod to this availability zone (e.g. "us-west-2a"; a nodeSelector on
    #: topology.kubernetes.io/zone), where the pool's EFA subnet is. None: the pods of one launch
    #: still share one zone (a required pod affinity), whichever zone the first pod lands in.
    zone: str | None = None
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
            raise bad(
                "image",
                "must be a container image reference such as "
                "'123456789012.dkr.ecr.us-west-2.amazonaws.com/fsdp-training:1.0' (a digest, "
                "'@sha256:...', pins it)",
            ) from None
        if not isinstance(self.namespace, str) or len(self.namespace) > 63 or not _DNS1123_LABEL.match(self.namespace):
            raise bad(
                "namespace",
                "must be a Kubernetes namespace name (lowercase letters, digits and '-', at most 63 characters)",
            )
        for name in ("service_account", "fsx_claim"):
            value = getattr(self, name)
            if not isinstance(value, str) or len(value) > 253 or not _DNS1123_SUBDOMAIN.match(value):
                raise bad(name, "must be a Kubernetes object name (lowercase letters, digits, '-' and '.')")
        mount = self.fsx_mount_path
        if (
            not isinstance(mount, str)
            or not mount.startswith("/")
            or posixpath.normpath(mount) != mount
            or mount == "/"
        ):
            raise bad("fsx_mount_path", "must be a normalised absolute path below '/', such as '/fsx'")
        if mount == "/dev/shm" or mount.startswith("/dev/shm/") or "/dev/shm".startswith(mount + "/"):
            raise bad(
                "fsx_mount_path",
                "overlaps /dev/shm, where the shared-memory volume is mounted; use a path such as '/fsx'",
            )
        if not isinstance(self.node_selector, dict) or not all(
            _is_label_key(k) and isinstance(v, str) and len(v) <= 63 and LABEL_VALUE_FORMAT.match(v)
            for k, v in self.node_selector.items()
        ):
            raise bad("node_selector", "must map label keys to label values, e.g. {'fsdp-resilience/pool': 'gpu'}")
        self._validate_tolerations()
        if self.gpus_per_node is not None and not (_is_nonneg_int(self.gpus_per_node) and self.gpus_per_node <= 64):
            raise bad("gpus_per_node", "must be between 0 and 64, or None for one GPU per process (procs_per_node)")
        if not _is_nonneg_int(self.efa_per_node) or self.efa_per_node > 64:
            raise bad("efa_per_node", "must be between 0 (no EFA) and 64 (p5.48xlarge has 32)")
        if self.instance_type is not None and (
            not isinstance(self.instance_type, str) or not _INSTANCE_TYPE.match(self.instance_type)
        ):
            raise bad("instance_type", "must be an EC2 instance type such as 'p5.48xlarge', or None for a mixed pool")
        if not isinstance(self.guaranteed_qos, bool):
            raise bad("guaranteed_qos", "must be true or false")
        for name in ("run_as_user", "run_as_group"):
            if not _is_nonneg_int(getattr(self, name)) or getattr(self, name) == 0:
                raise bad(name, "must be the images' non-root numeric id (1000 in images/), not 0")
        if not _is_nonneg_int(self.max_pod_disruptions) or self.max_pod_disruptions > 100:
            raise bad("max_pod_disruptions", "must be between 0 and 100 (disrupted pods a launch survives)")
        for name in ("cpu", "memory", "eval_cpu", "eval_memory"):
            value = getattr(self, name)
            if value is not None and not _is_quantity(value):
                raise bad(name, "must be a Kubernetes quantity such as '1800Gi', '96' or '500m', or None")
        if self.shm_size is not None and (not _is_quantity(self.shm_size) or quantity_bytes(self.shm_size) <= 0):
            raise bad("shm_size", "must be a Kubernetes quantity such as '160Gi', or None to size it from the model")
        if self.zone is not None and not (isinstance(self.zone, str) and _ZONE.match(self.zone)):
            raise bad("zone", "must be an availability zone name such as 'us-west-2a', or None")
        pinned = self.node_selector.get(ZONE_LABEL)
        if self.zone is not None and pinned is not None and pinned != self.zone:
            raise bad(
                "zone",
                f"contradicts node_selector[{ZONE_LABEL!r}]={pinned!r}; set the zone in one of them only",
            )
        if self.guaranteed_qos and (self.cpu is None or self.memory is None):
            raise bad(
                "guaranteed_qos",
                f"needs cpu and memory set (cpu={self.cpu!r}, memory={self.memory!r}): "
                "QoS Guaranteed means requests = limits for both; set them or "
                "guaranteed_qos=false",
            )
        node = self.node_memory_bytes()
        for name in ("memory", "eval_memory"):
            value = getattr(self, name)
            if node is not None and value is not None and quantity_bytes(value) > node:
                raise bad(
                    name,
                    f"is more than a {self.instance_type} node can give a pod (about {node / GIB:.0f} GiB "
                    f"of its {NODE_MEMORY_GIB[self.instance_type]} GiB, after the kernel, the kubelet's "
                    f"reserve and the daemonsets): the pod would never schedule; set {name} to at most "
                    f"{math.floor(node / GIB)}Gi",
                )
        if not _is_nonneg_int(self.backoff_limit) or self.backoff_limit > 100:
            raise bad("backoff_limit", "must be between 0 and 100 (pod failures a Job absorbs before it fails)")
        for name in ("active_deadline_s", "ttl_after_finished_s", "termination_grace_s"):
            if not _is_nonneg_int(getattr(self, name)):
                raise bad(name, "must be a whole number of seconds, 0 or more")
        if self.active_deadline_s == 0:
            raise bad("active_deadline_s", "must be more than 0 seconds (the most a Job may run)")
        if self.priority_class is not None and (
            not isinstance(self.priority_class, str) or not _DNS1123_SUBDOMAIN.match(self.priority_class)
        ):
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
                raise ValueError(
                    f"{where}: {t!r} is not a toleration; use e.g. "
                    "{'key': 'nvidia.com/gpu', 'operator': 'Exists', 'effect': 'NoSchedule'}"
                )
            unknown = sorted(set(t) - _TOLERATION_FIELDS)
            if unknown:
                raise ValueError(f"{where}: unknown toleration field(s) {unknown}; use {sorted(_TOLERATION_FIELDS)}")
            if t.get("operator", "Equal") not in _TOLERATION_OPERATORS:
                raise ValueError(f"{where}: operator must be one of {_TOLERATION_OPERATORS}")
            if t.get("operator") == "Exists" and t.get("value"):
                raise ValueError(
                    f"{where}: a toleration with operator Exists takes no value; remove it or use operator Equal"
                )
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
        """The pods' nodeSelector: ``node_selector`` plus the instance type and zone, when set."""
        selector = dict(self.node_selector)
        if self.instance_type is not None:
            selector.setdefault(INSTANCE_TYPE_LABEL, self.instance_type)
        if self.zone is not None:
            selector[ZONE_LABEL] = self.zone
        return selector

    def node_memory_bytes(self) -> float | None:
        """What one node of ``instance_type`` can give a pod (``NODE_MEMORY_GIB`` times
        ``NODE_ALLOCATABLE_FRACTION``), or None for an instance type not in the table."""
        nominal = NODE_MEMORY_GIB.get(self.instance_type or "")
        return None if nominal is None else nominal * NODE_ALLOCATABLE_FRACTION * GIB

    def shm_size_for(self, cfg: RunConfig) -> str:
        """The training pods' /dev/shm size: ``shm_size`` when set, else the run's estimate
        (``host_memory_per_node``: the node's checkpoint snapshot + 1 GiB a rank) times
        ``SHM_MARGIN``, in whole GiB. A memory-backed emptyDir's size is a cap, not a reservation:
        what is not used stays free for the processes."""
        if self.shm_size is not None:
            return self.shm_size
        need = host_memory_for_preset(cfg.model, cfg.nodes, cfg.procs_per_node)["shm"]
        return f"{math.ceil(need * SHM_MARGIN / GIB)}Gi"

    def check_memory_fits(self, cfg: RunConfig) -> None:
        """Raise ValueError, saying what to set, when a training pod of ``cfg`` cannot hold what it
        needs: a /dev/shm smaller than the checkpoint staging plus NCCL's share, or larger than the
        pod's memory (it counts against it), or (without a memory limit) than a node of
        ``instance_type`` can give. (Memory beyond what the node can give is ``validate``'s.) The
        processes' own memory (``host_memory_per_node``'s ``processes``) is a round allowance, so
        it only shapes the advice, never a refusal."""
        need = host_memory_for_preset(cfg.model, cfg.nodes, cfg.procs_per_node)
        shm_size = self.shm_size_for(cfg)
        shm = quantity_bytes(shm_size)
        where = f"model {cfg.model} on {cfg.nodes} node(s) x {cfg.procs_per_node} rank(s)"
        if self.shm_size is not None and shm < need["shm"]:
            computed = dataclasses.replace(self, shm_size=None).shm_size_for(cfg)
            raise ValueError(
                f"PodTemplateSettings.shm_size={self.shm_size!r} cannot hold what {where} keeps in "
                f"/dev/shm: about {_gib(need['shm'])} GiB ({_gib(need['checkpoint_staging'])} GiB of "
                "checkpoint snapshot, the node's share of the weights and both AdamW moments, + "
                f"{_gib(need['runtime_shm'])} GiB for NCCL and libfabric), so the first checkpoint "
                f"would fail with ENOSPC; set shm_size to at least {math.ceil(need['shm'] / GIB)}Gi, "
                f"or leave it unset to size it from the model ({computed})"
            )
        if self.memory is not None:
            memory = quantity_bytes(self.memory)
            if shm > memory:
                raise ValueError(
                    f"PodTemplateSettings.shm_size: the training pods' /dev/shm of {shm_size} is more "
                    f"than their memory={self.memory!r}; a memory-backed /dev/shm counts against the "
                    "pod's memory limit, so the pod would be OOM-killed before it is full. Raise memory "
                    f"to at least {math.ceil(max(need['total'], shm) / GIB)}Gi, or set a smaller shm_size"
                )
        node = self.node_memory_bytes()
        if node is not None and self.memory is None and shm > node:
            raise ValueError(
                f"PodTemplateSettings.shm_size: a /dev/shm of {shm_size} is more than a "
                f"{self.instance_type} node can give a pod (about {node / GIB:.0f} GiB); run on more "
                "nodes with fewer ranks each, or on an instance type with more memory"
            )

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
        removed = sorted(set(data) & set(REMOVED_SETTINGS))
        if removed:
            raise ValueError(
                "; ".join(f"pod template setting {n!r} was removed: {REMOVED_SETTINGS[n]}" for n in removed)
            )
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown pod template setting(s) {unknown}; known settings: {sorted(known)}")
        settings = cls(**copy.deepcopy(data))
        if validate:
            settings.validate()
        return settings
