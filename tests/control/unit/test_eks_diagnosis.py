"""The EKS backend's diagnosis (eks/diagnosis.py): a job that is not failed, or failed for a
reason no node replacement helps, blames nobody; without node evidence from the cluster, the
nodes whose pods reported the failure are blamed, else every node of the job. No cluster: the
Job, its pods and the nodes are the API's JSON, the client a stand-in (blame from the run's
events: test_failure_classes.py; end to end: test_eks_backend.py)."""

from __future__ import annotations

from fsdp_resilience.control.backends.base import JobHandle, JobStatus, NodeStatus
from fsdp_resilience.control.backends.eks.diagnosis import blame_without_node_evidence, diagnose_job

HANDLE = JobHandle("eks", "run", "0", "r-run-0", {"run_dir": "/not/mounted/here"})


class StandInKube:
    def __init__(self, pods=(), nodes=None):
        self.pods, self.nodes = list(pods), dict(nodes or {})

    def list_pods(self, selector):
        return self.pods

    def get_node(self, name):
        return self.nodes.get(name)


def failed(failure: str, *nodes: NodeStatus) -> JobStatus:
    return JobStatus("failed", failure, message="it failed", nodes=list(nodes))


def test_a_running_job_has_nothing_to_diagnose():
    job = {"metadata": {"name": "r-run-0"}, "spec": {"completions": 1}, "status": {"active": 1}}
    diagnosis = diagnose_job(StandInKube(), HANDLE, job, provisions_on_demand=False)
    assert diagnosis.bad_node_ids == [] and not diagnosis.replaceable
    assert "nothing to diagnose" in diagnosis.evidence[0]


def test_without_events_the_reporting_nodes_are_blamed_else_every_node():
    status = failed(
        "restarts_exhausted",
        NodeStatus(0, "node-a", "failed", "restarts_exhausted", 75),
        NodeStatus(1, "node-b", "succeeded"),
    )
    d = blame_without_node_evidence(HANDLE, {}, status, ["node-a", "node-b"], ["status: it failed"])
    assert d.bad_node_ids == ["node-a"] and d.replaceable
    assert "not mounted here (no events to read)" in d.evidence[-1] and d.evidence[0] == "status: it failed"
    nobody = failed("restarts_exhausted", NodeStatus(0, "node-a", "failed", "unknown"))
    d = blame_without_node_evidence(HANDLE, {}, nobody, ["node-a", "node-b"], [])
    assert d.bad_node_ids == ["node-a", "node-b"] and d.replaceable
    assert "every node of the job is suspect" in d.evidence[-1]
    d = blame_without_node_evidence(HANDLE, {}, failed("no_progress"), [], [])
    assert d.bad_node_ids == [] and not d.replaceable
