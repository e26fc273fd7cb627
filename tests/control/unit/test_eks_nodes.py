"""The EKS backend's node logic (eks/nodes.py): which nodes are healthy capacity, what the quarantine
taint and annotation record, which nodes a failed job blames, and how a node is replaced under
each replacement mode. No cluster: nodes are the API's JSON, and the Kubernetes and Auto Scaling
clients are stand-ins that record what they were asked (the real calls are test_eks_client.py's
and the integration tests')."""

from __future__ import annotations

import pytest

from fsdp_resilience.control.backends.base import LOST, BackendError, JobStatus, NodeStatus
from fsdp_resilience.control.backends.eks.constants import (
    EFA_RESOURCE,
    GPU_RESOURCE,
    MANAGED_ASG_TAG,
    QUARANTINE_ANNOTATION,
    QUARANTINE_TAINT,
)
from fsdp_resilience.control.backends.eks.nodes import (
    devices_needed,
    instance_id_of,
    lost_pod_signals,
    node_health,
    node_healthy,
    node_problems,
    out_of_service,
    pool_capacity,
    quarantine_record,
    quarantine_report,
    quarantined_by_us,
    replace_instance,
    replace_pool_nodes,
)
from fsdp_resilience.control.backends.eks.pod_settings import PodTemplateSettings
from fsdp_resilience.control.backends.eks.status import timestamp

DEVICES = {GPU_RESOURCE: 8, EFA_RESOURCE: 32}


def make_node(
    name: str,
    *,
    ready: str = "True",
    conditions: dict | None = None,
    gpus: str = "8",
    efa: str = "32",
    unschedulable: bool = False,
    taints: list | None = None,
    annotations: dict | None = None,
    instance: str | None = "i-0123456789abcdef0",
) -> dict:
    conds = [{"type": "Ready", "status": ready, "reason": "KubeletReady"}]
    conds += [
        {"type": t, "status": s, "reason": f"{t}Reason", "message": f"{t} says so"}
        for t, s in (conditions or {}).items()
    ]
    spec: dict = {"providerID": f"aws:///us-west-2a/{instance}" if instance else "", "taints": list(taints or [])}
    if unschedulable:
        spec["unschedulable"] = True
    return {
        "metadata": {"name": name, "annotations": dict(annotations or {})},
        "spec": spec,
        "status": {"conditions": conds, "allocatable": {GPU_RESOURCE: gpus, EFA_RESOURCE: efa}},
    }


QUARANTINED = dict(
    unschedulable=True,
    taints=[{"key": QUARANTINE_TAINT, "value": "restarts", "effect": "NoSchedule"}],
    annotations={QUARANTINE_ANNOTATION: "2026-12-01T06:00:00Z restarts exhausted on node 1"},
)


class StubKube:
    """What the node logic calls on a KubeClient, recorded."""

    def __init__(self, nodes: dict[str, dict | None] | None = None, claims: list[dict] | None = None):
        self.nodes = nodes or {}
        self.claims = claims or []
        self.calls: list[tuple] = []

    def get_node(self, name):
        return self.nodes.get(name)

    def get_nodes(self, names):
        return {name: self.nodes.get(name) for name in names}

    def quarantine_node(self, node, reason):
        self.calls.append(("quarantine", node["metadata"]["name"], reason))

    def evict_pods_on(self, name, selector):
        self.calls.append(("evict", name, selector))
        return [f"{name}-pod"]

    def list_nodeclaims(self):
        return self.claims

    def delete_nodeclaim(self, name):
        self.calls.append(("delete_nodeclaim", name))


class StubAutoscaling:
    def __init__(self, group: str | None = "gpu-asg", tags: dict | None = None):
        self.group = group
        self.tags = {MANAGED_ASG_TAG: "true"} if tags is None else tags
        self.terminated: list[tuple] = []

    def describe_auto_scaling_instances(self, InstanceIds):  # noqa: N803 - boto3's names
        return {"AutoScalingInstances": [{"AutoScalingGroupName": self.group}] if self.group else []}

    def describe_auto_scaling_groups(self, AutoScalingGroupNames):  # noqa: N803
        return {"AutoScalingGroups": [{"Tags": [{"Key": k, "Value": v} for k, v in self.tags.items()]}]}

    def terminate_instance_in_auto_scaling_group(self, InstanceId, ShouldDecrementDesiredCapacity):  # noqa: N803
        self.terminated.append((InstanceId, ShouldDecrementDesiredCapacity))


# --------------------------------------------------------------------------------------------
# What a node says
# --------------------------------------------------------------------------------------------


def test_node_problems_are_not_ready_and_the_monitoring_agents_false_conditions():
    assert node_problems(make_node("a")) == []
    assert node_problems(make_node("a", ready="Unknown"))[0].startswith("Ready=Unknown")
    (problem,) = node_problems(make_node("a", conditions={"AcceleratedHardwareReady": "False", "DiskPressure": "True"}))
    assert problem.startswith("AcceleratedHardwareReady=False") and "says so" in problem
    assert node_problems({"metadata": {"name": "bare"}}) == ["Ready=missing ()"]


def test_out_of_service_and_quarantined_by_us():
    assert not out_of_service(make_node("a")) and not quarantined_by_us(make_node("a"))
    cordoned_by_hand = make_node("a", unschedulable=True)
    assert out_of_service(cordoned_by_hand) and not quarantined_by_us(cordoned_by_hand)
    assert out_of_service(make_node("a", **QUARANTINED)) and quarantined_by_us(make_node("a", **QUARANTINED))
    annotated_only = make_node("a", annotations=QUARANTINED["annotations"])
    assert quarantined_by_us(annotated_only) and not out_of_service(annotated_only)


def test_quarantine_record_reads_the_time_and_reason_or_falls_back_to_the_taint():
    since, reason = quarantine_record(make_node("a", **QUARANTINED))
    assert since == timestamp("2026-12-01T06:00:00Z") and reason == "restarts exhausted on node 1"
    assert quarantine_record(make_node("a", taints=QUARANTINED["taints"])) == (None, "restarts")
    assert quarantine_record(make_node("a", annotations={QUARANTINE_ANNOTATION: "by hand"})) == (None, "by hand")


def test_instance_id_of_reads_the_provider_id():
    assert instance_id_of(make_node("a")) == "i-0123456789abcdef0"
    assert instance_id_of(make_node("a", instance=None)) is None
    assert instance_id_of({"spec": {"providerID": "kind://docker/kind/node"}}) is None


# --------------------------------------------------------------------------------------------
# Capacity
# --------------------------------------------------------------------------------------------


def test_devices_needed_are_the_pods_requests():
    assert devices_needed(PodTemplateSettings(image="x")) == DEVICES
    assert devices_needed(PodTemplateSettings(image="x", gpus_per_node=None, efa_per_node=0)) == {
        GPU_RESOURCE: 1,
        EFA_RESOURCE: 0,
    }


def test_a_node_is_healthy_capacity_only_in_service_ready_and_with_its_devices_registered():
    assert node_healthy(make_node("a"), DEVICES)
    assert not node_healthy(make_node("a", gpus="0"), DEVICES)  # the device plugin has not registered them
    assert not node_healthy(make_node("a", efa="oops"), DEVICES)
    assert not node_healthy(make_node("a", ready="False"), DEVICES)
    assert not node_healthy(make_node("a", **QUARANTINED), DEVICES)


def test_pool_capacity_counts_healthy_and_out_of_service_nodes():
    pool = [make_node("c"), make_node("a"), make_node("b", **QUARANTINED), make_node("d", ready="False")]
    capacity = pool_capacity(pool, DEVICES, provisions_on_demand=True)
    assert (capacity.total, capacity.healthy, capacity.healthy_node_ids) == (4, 2, ["a", "c"])
    assert capacity.quarantined == ["b"] and capacity.provisions_on_demand


def test_quarantine_report_lists_our_quarantines_oldest_first():
    older = make_node("z", **{**QUARANTINED, "annotations": {QUARANTINE_ANNOTATION: "2026-11-30T00:00:00Z old"}})
    no_time = make_node("b", taints=QUARANTINED["taints"], instance=None)
    report = quarantine_report(
        [make_node("a", **QUARANTINED), make_node("free"), no_time, older, make_node("hand", unschedulable=True)]
    )
    assert [q["node_id"] for q in report] == ["z", "a", "b"]
    assert report[1] == {
        "node_id": "a",
        "reason": "restarts exhausted on node 1",
        "since": timestamp("2026-12-01T06:00:00Z"),
        "ready": True,
        "instance_id": "i-0123456789abcdef0",
    }
    assert report[2]["since"] is None and report[2]["instance_id"] is None


# --------------------------------------------------------------------------------------------
# Blame
# --------------------------------------------------------------------------------------------


def test_node_health_names_unhealthy_and_gone_nodes_and_lost_pods_name_their_nodes():
    kube = StubKube({"gpu-0": make_node("gpu-0"), "gpu-1": make_node("gpu-1", conditions={"KernelReady": "False"})})
    health = node_health(kube, ["gpu-0", "gpu-1", "gpu-9"])
    assert list(health) == ["gpu-1", "gpu-9"]  # gpu-0 is healthy: left out
    assert health["gpu-1"][0].startswith("KernelReady=False") and health["gpu-9"] == ["the node is gone"]
    lost = NodeStatus(2, "gpu-2", LOST, "restarts_exhausted", None, "pod x on gpu-2 lost: Evicted")
    status = JobStatus("failed", "restarts_exhausted", {}, "", [NodeStatus(0, "gpu-0", "running"), lost])
    assert lost_pod_signals(status, []) == {"gpu-2": ["node 2's pod lost: pod x on gpu-2 lost: Evicted"]}


# --------------------------------------------------------------------------------------------
# Replacement
# --------------------------------------------------------------------------------------------


def test_cordon_leaves_the_replacement_to_a_human():
    kube = StubKube()
    assert "human" in replace_instance(kube, make_node("a"), "cordon", lambda: pytest.fail("no AWS call"))


def test_karpenter_deletes_the_nodes_claims_and_refuses_a_node_without_one():
    kube = StubKube(
        claims=[
            {"metadata": {"name": "c1"}, "status": {"nodeName": "a"}},
            {"metadata": {"name": "c2"}, "status": {"nodeName": "b"}},
        ]
    )
    assert "c1" in replace_instance(kube, make_node("a"), "karpenter", lambda: None)
    assert kube.calls == [("delete_nodeclaim", "c1")]
    with pytest.raises(BackendError, match="no Karpenter NodeClaim has status.nodeName=z"):
        replace_instance(kube, make_node("z"), "karpenter", lambda: None)


def test_asg_terminates_the_instance_keeping_desired_capacity_only_in_a_tagged_group():
    asg = StubAutoscaling()
    how = replace_instance(StubKube(), make_node("a"), "asg", lambda: asg)
    assert asg.terminated == [("i-0123456789abcdef0", False)] and "gpu-asg" in how
    with pytest.raises(BackendError, match=f"lacks the tag {MANAGED_ASG_TAG}=true"):
        replace_instance(StubKube(), make_node("a"), "asg", lambda: StubAutoscaling(tags={}))
    with pytest.raises(BackendError, match="in no Auto Scaling group"):
        replace_instance(StubKube(), make_node("a"), "asg", lambda: StubAutoscaling(group=None))
    with pytest.raises(BackendError, match="no EC2 instance in spec.providerID"):
        replace_instance(StubKube(), make_node("a", instance=None), "asg", lambda: asg)


def test_replace_pool_nodes_quarantines_evicts_and_replaces_within_the_unhealthy_share():
    pool = [make_node(f"gpu-{i}", instance=f"i-0000000000000000{i}") for i in range(10)]
    kube, asg = StubKube(), StubAutoscaling()
    result = replace_pool_nodes(
        kube,
        pool,
        ["gpu-1", "gpu-2", "gpu-x"],
        "restarts exhausted",
        replacement="asg",
        max_unhealthy_share=0.2,
        autoscaling=lambda: asg,
    )
    assert result.replaced == ["gpu-1", "gpu-2"] and result.refused == ["gpu-x"]
    assert [c[:2] for c in kube.calls] == [
        ("quarantine", "gpu-1"),
        ("evict", "gpu-1"),
        ("quarantine", "gpu-2"),
        ("evict", "gpu-2"),
    ]
    assert len(asg.terminated) == 2 and f"tainted {QUARANTINE_TAINT}" in result.reason
    too_many = replace_pool_nodes(
        StubKube(),
        pool,
        ["gpu-1", "gpu-2", "gpu-3"],
        "why",
        replacement="asg",
        max_unhealthy_share=0.2,
        autoscaling=lambda: pytest.fail("nothing replaced"),
    )
    assert too_many.replaced == [] and "max_unhealthy_share" in too_many.reason


def test_a_node_that_cannot_be_replaced_stays_quarantined_and_is_refused():
    kube = StubKube()
    result = replace_pool_nodes(
        kube,
        [make_node(f"gpu-{i}") for i in range(4)],
        ["gpu-0"],
        "why",
        replacement="asg",
        max_unhealthy_share=1.0,
        autoscaling=lambda: StubAutoscaling(tags={}),
    )
    assert result.replaced == [] and result.refused == ["gpu-0"]
    assert ("quarantine", "gpu-0", "why") in kube.calls and "cordoned and tainted, but not replaced" in result.reason
