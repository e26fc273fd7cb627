"""The EKS backend's node logic: which nodes of the GPU pool are healthy capacity, how a node is
taken out of service (cordoned and tainted QUARANTINE_TAINT, our pods evicted) and replaced (its
instance terminated in its Auto Scaling group, its Karpenter NodeClaim deleted, or left to a
human), and what the quarantine annotation on a node records. Pure functions over the API's JSON,
plus the replacement steps, which take a ``KubeClient``.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Callable

from fsdp_resilience.control.backends.base import LOST, BackendError, Capacity, JobStatus, Replacement
from fsdp_resilience.control.backends.eks.constants import (
    EFA_RESOURCE,
    GPU_RESOURCE,
    MANAGED_ASG_TAG,
    MANAGED_BY,
    QUARANTINE_ANNOTATION,
    QUARANTINE_TAINT,
)
from fsdp_resilience.control.backends.eks.pod_settings import PodTemplateSettings
from fsdp_resilience.control.backends.eks.status import conditions_of, node_from_pod, pod_index, timestamp
from fsdp_resilience.control.backends.replacement import plan_replacement

if TYPE_CHECKING:
    from fsdp_resilience.control.backends.eks.client import KubeClient

#: How a node whose restarts ran out is taken out of service, and by whom it is replaced.
REPLACEMENT_MODES = ("asg", "karpenter", "cordon")
#: The EKS node monitoring agent's conditions: False means the node is unhealthy for that reason.
HEALTH_CONDITIONS = (
    "AcceleratedHardwareReady",
    "NetworkingReady",
    "StorageReady",
    "KernelReady",
    "ContainerRuntimeReady",
)
_INSTANCE_ID = re.compile(r"(i-[0-9a-f]{8,17})$")


def node_problems(node: dict[str, Any]) -> list[str]:
    """Why a node cannot take a training pod now (empty: healthy)."""
    problems = []
    conds = conditions_of(node)
    ready = conds.get("Ready") or {}
    if ready.get("status") != "True":
        problems.append(f"Ready={ready.get('status', 'missing')} ({ready.get('reason', '')})")
    for kind in HEALTH_CONDITIONS:
        c = conds.get(kind)
        if c and c.get("status") == "False":
            problems.append(f"{kind}=False ({c.get('reason', '')}: {c.get('message', '')})".rstrip(": ()") + ")")
    return problems


def out_of_service(node: dict[str, Any]) -> bool:
    spec = node.get("spec") or {}
    return bool(spec.get("unschedulable")) or any(t.get("key") == QUARANTINE_TAINT for t in spec.get("taints") or [])


def quarantined_by_us(node: dict[str, Any]) -> bool:
    """Whether this project quarantined the node (its taint or its reason annotation): only such a
    node may be returned to service; a node someone cordoned by hand stays theirs."""
    annotations = (node.get("metadata") or {}).get("annotations") or {}
    return QUARANTINE_ANNOTATION in annotations or any(
        t.get("key") == QUARANTINE_TAINT for t in (node.get("spec") or {}).get("taints") or []
    )


def quarantine_record(node: dict[str, Any]) -> tuple[float | None, str]:
    """(since, reason) from the quarantine annotation ("<RFC 3339 time> <reason>"); since is None
    when the annotation is missing or has no time (the taint alone carries no time)."""
    note = ((node.get("metadata") or {}).get("annotations") or {}).get(QUARANTINE_ANNOTATION) or ""
    stamp, _, reason = note.partition(" ")
    if re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", stamp):
        return timestamp(stamp), reason
    taint = next((t for t in (node.get("spec") or {}).get("taints") or [] if t.get("key") == QUARANTINE_TAINT), {})
    return None, note or taint.get("value", "")


def instance_id_of(node: dict[str, Any]) -> str | None:
    """The EC2 instance behind a node: ``spec.providerID`` is ``aws:///<zone>/<instance id>``."""
    match = _INSTANCE_ID.search((node.get("spec") or {}).get("providerID") or "")
    return match.group(1) if match else None


# --------------------------------------------------------------------------------------------
# The pool's capacity
# --------------------------------------------------------------------------------------------


def devices_needed(settings: PodTemplateSettings) -> dict[str, int]:
    """The devices each training pod requests (its real request): a node whose device plugin
    has not registered them yet (allocatable 0) cannot take one, so it is not healthy capacity.
    gpus_per_node=None (one per process: unknown until a run) needs at least one GPU."""
    gpus = settings.gpus_per_node
    return {GPU_RESOURCE: 1 if gpus is None else int(gpus), EFA_RESOURCE: int(settings.efa_per_node or 0)}


def node_healthy(node: dict[str, Any], devices: dict[str, int]) -> bool:
    """Whether ``node`` can take a training pod that needs ``devices`` (``devices_needed``) now."""
    if out_of_service(node) or node_problems(node):
        return False
    allocatable = (node.get("status") or {}).get("allocatable") or {}
    for resource, need in devices.items():
        try:
            have = int(str(allocatable.get(resource, "0")) or 0)
        except ValueError:
            have = 0
        if have < need:
            return False
    return True


def pool_capacity(pool: list[dict[str, Any]], devices: dict[str, int], *, provisions_on_demand: bool) -> Capacity:
    healthy = sorted(n["metadata"]["name"] for n in pool if node_healthy(n, devices))
    quarantined = sorted(n["metadata"]["name"] for n in pool if out_of_service(n))
    return Capacity(
        total=len(pool),
        healthy=len(healthy),
        quarantined=quarantined,
        healthy_node_ids=healthy,
        provisions_on_demand=provisions_on_demand,
    )


def quarantine_report(pool: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The pool's nodes this project quarantined, oldest quarantine first (see
    EksBackend.quarantined_nodes)."""
    out = []
    for node in pool:
        if not quarantined_by_us(node):
            continue
        since, reason = quarantine_record(node)
        out.append(
            {
                "node_id": node["metadata"]["name"],
                "reason": reason,
                "since": since,
                "ready": not node_problems(node),
                "instance_id": instance_id_of(node),
            }
        )
    return sorted(out, key=lambda q: (q["since"] is None, q["since"] or 0, q["node_id"]))


def node_health(kube: KubeClient, job_nodes: list[str]) -> dict[str, list[str]]:
    """node -> what it says against itself (kubelet's Ready, the EKS node monitoring agent's
    conditions; gone), for the nodes a job ran on; healthy nodes are left out."""
    out: dict[str, list[str]] = {}
    read = kube.get_nodes(job_nodes)  # one paged list for a big job, not a GET per node
    for name in job_nodes:
        node = read[name]
        problems = ["the node is gone"] if node is None else node_problems(node)
        if problems:
            out[name] = problems
    return out


def lost_pod_signals(status: JobStatus, pods: list[dict[str, Any]]) -> dict[str, list[str]]:
    """node -> its lost pods, over every pod the job had, replaced ones included: a node that lost
    a pod is suspect."""
    out: dict[str, list[str]] = {}
    every_pod = status.nodes + [node_from_pod(pod_index(p), p, None) for p in pods if pod_index(p) is not None]
    for n in every_pod:
        if n.state == LOST and n.node_id:
            signal = f"node {n.index}'s pod lost: {n.message}"
            if signal not in out.setdefault(n.node_id, []):
                out[n.node_id].append(signal)
    return out


# --------------------------------------------------------------------------------------------
# Taking nodes out of service and replacing them
# --------------------------------------------------------------------------------------------


def replace_pool_nodes(
    kube: KubeClient,
    pool: list[dict[str, Any]],
    node_ids: list[str],
    reason: str,
    *,
    replacement: str,
    max_unhealthy_share: float,
    autoscaling: Callable[[], Any],
) -> Replacement:
    """EksBackend.replace_nodes on the pool's nodes as read (``pool``): cordon and taint each node,
    evict our pods left on it, then have the platform replace it (``replace_instance``), at most
    ``max_unhealthy_share`` of the pool at once."""
    by_name = {n["metadata"]["name"]: n for n in pool}
    out = [name for name, n in by_name.items() if out_of_service(n)]
    replace, refused, note = plan_replacement(list(node_ids), sorted(by_name), out, max_unhealthy_share)
    done, notes = [], [note] if note else []
    for name in replace:
        node = by_name[name]
        kube.quarantine_node(node, reason)
        evicted = kube.evict_pods_on(name, ",".join(f"{k}={v}" for k, v in MANAGED_BY.items()))
        try:
            how = replace_instance(kube, node, replacement, autoscaling)
        except BackendError as e:
            refused.append(name)
            notes.append(f"{name}: cordoned and tainted, but not replaced: {e}")
            continue
        done.append(name)
        notes.append(f"{name}: cordoned, tainted {QUARANTINE_TAINT}, evicted {evicted}; {how}")
    return Replacement(done, refused, "; ".join(notes) or "nothing to replace")


def replace_instance(kube: KubeClient, node: dict[str, Any], replacement: str, autoscaling: Callable[[], Any]) -> str:
    """Have the platform replace ``node`` (already out of service) as ``replacement`` says: delete
    its Karpenter NodeClaim, or terminate its instance in its Auto Scaling group (``autoscaling()``:
    the boto3 client; the group must carry MANAGED_ASG_TAG), or nothing (cordon). Says what it did."""
    name = node["metadata"]["name"]
    if replacement == "cordon":
        return "left for a human to replace (replacement=cordon)"
    if replacement == "karpenter":
        claims = [c for c in kube.list_nodeclaims() if (c.get("status") or {}).get("nodeName") == name]
        if not claims:
            raise BackendError(f"no Karpenter NodeClaim has status.nodeName={name}; is the node Karpenter's?")
        for claim in claims:
            kube.delete_nodeclaim(claim["metadata"]["name"])
        return f"deleted NodeClaim(s) {[c['metadata']['name'] for c in claims]}: Karpenter drains and replaces it"
    instance = instance_id_of(node)
    if not instance:
        raise BackendError(
            f"node {name} has no EC2 instance in spec.providerID ({(node.get('spec') or {}).get('providerID')!r})"
        )
    asg = autoscaling()
    found = asg.describe_auto_scaling_instances(InstanceIds=[instance])["AutoScalingInstances"]
    if not found:
        raise BackendError(
            f"instance {instance} of node {name} is in no Auto Scaling group; replace it by hand "
            "or use replacement=karpenter/cordon"
        )
    group = found[0]["AutoScalingGroupName"]
    tags = asg.describe_auto_scaling_groups(AutoScalingGroupNames=[group])["AutoScalingGroups"][0].get("Tags", [])
    if not any(t["Key"] == MANAGED_ASG_TAG and t["Value"] == "true" for t in tags):
        raise BackendError(
            f"Auto Scaling group {group} lacks the tag {MANAGED_ASG_TAG}=true, so this project "
            "may not terminate its instances; tag it (see deploy/) or replace the node by hand"
        )
    asg.terminate_instance_in_auto_scaling_group(InstanceId=instance, ShouldDecrementDesiredCapacity=False)
    return f"terminated {instance} in Auto Scaling group {group} (desired capacity kept: a new node replaces it)"
