"""The node replacement rules (backends/replacement.py): the share rule and whether a job can still train."""

from __future__ import annotations

from fsdp_resilience.control.backends import DEFAULT_MAX_UNHEALTHY_SHARE
from fsdp_resilience.control.backends.base import LOST, NodeStatus
from fsdp_resilience.control.backends.replacement import job_can_train, plan_replacement, replacement_limit


def test_the_share_rule():
    assert [replacement_limit(n, 0.2) for n in (1, 4, 5, 10, 64)] == [1, 1, 1, 2, 12]  # at least one
    pool = [f"n{i}" for i in range(10)]
    assert plan_replacement(["n1", "n2"], pool, [], 0.2)[:2] == (["n1", "n2"], [])
    replaced, refused, reason = plan_replacement(["n1", "n2", "n3"], pool, [], 0.2)
    assert replaced == [] and refused == ["n1", "n2", "n3"] and "max_unhealthy_share=0.2 allows 2" in reason
    replaced, refused, reason = plan_replacement(["n1", "zz", "n1", "n0"], pool, ["n0"], 0.2)
    assert replaced == ["n1"] and refused == ["zz"] and "already out of service: ['n0']" in reason


def test_the_default_share_is_eks_auto_repairs():
    assert DEFAULT_MAX_UNHEALTHY_SHARE == 0.2
    assert replacement_limit(5, DEFAULT_MAX_UNHEALTHY_SHARE) == 1


def test_a_lost_node_with_a_spare_behind_it_can_still_train():
    nodes = [NodeStatus(i, f"n{i}", s) for i, s in enumerate(["running", LOST, "running"])]
    assert job_can_train(2, nodes)  # two training, one lost: the spare took its place
    assert not job_can_train(3, nodes)
    failed = [NodeStatus(0, "n0", "failed"), NodeStatus(1, "n1", "pending"), NodeStatus(2, "n2", "succeeded")]
    assert job_can_train(2, failed) and not job_can_train(3, failed)
