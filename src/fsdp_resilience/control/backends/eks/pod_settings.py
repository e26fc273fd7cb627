"""The EKS pods' own settings (``PodTemplateSettings``: image, placement, devices, limits, the user
they run as, the disruptions a launch survives) and their validation: every builder in
manifests.py validates first, so a wrong field fails with its name and what to set instead.

Torch-free and client-free.
"""

from __future__ import annotations

import copy
import dataclasses
import posixpath
import re
from dataclasses import dataclass, field
from typing import Any

from fsdp_resilience.control.backends.eks.constants import (
    DEVICE_RDMA_FAMILIES,
    INSTANCE_TYPE_LABEL,
    LABEL_VALUE_FORMAT,
    RESERVED_ENV,
)
from fsdp_resilience.control.backends.eks.images import image_repository
from fsdp_resilience.training.contract import RunConfig

_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
#: A Kubernetes resource quantity ("64Gi", "500m", "1.5", "1e3").
_QUANTITY = re.compile(r"^[+]?(\d+(\.\d*)?|\.\d+)(([KMGTPE]i)|[numkMGTPE]|[eE][+-]?\d+)?$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")
_INSTANCE_TYPE = re.compile(r"^[a-z][a-z0-9-]*\.[a-z0-9-]+$")

_TOLERATION_FIELDS = {"key", "operator", "value", "effect", "tolerationSeconds"}
_TOLERATION_OPERATORS = ("Exists", "Equal")
_TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
_PULL_POLICIES = ("Always", "IfNotPresent", "Never")


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
            raise bad(
                "guaranteed_qos",
                f"needs cpu and memory set (cpu={self.cpu!r}, memory={self.memory!r}): "
                "QoS Guaranteed means requests = limits for both; set them or "
                "guaranteed_qos=false",
            )
        if self.hugepages_2mi is not None and self.memory is None:
            raise bad(
                "hugepages_2mi",
                "needs memory set too: Kubernetes rejects a pod that requests huge pages "
                "without a memory (or CPU) request; set memory, e.g. '1000Gi'",
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
