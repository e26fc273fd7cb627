"""Node replacement: the share rule (how many nodes may be replaced at once) and whether a job
still has enough nodes to train. One rule for every backend: the local backend quarantines slots
and the EKS backend replaces instances under the same limits.

Torch-free, like the rest of the control plane.
"""

from __future__ import annotations

import math

from fsdp_resilience.control.backends.base import LOST, NodeStatus

# --------------------------------------------------------------------------------------------
# The share rule for node replacement
# --------------------------------------------------------------------------------------------

#: Like EKS node auto repair's default: past this share of unhealthy nodes, the cause is likely
#: not the nodes (a bad image, the network, the storage), and replacing them would only churn.
DEFAULT_MAX_UNHEALTHY_SHARE = 0.2


def replacement_limit(pool_size: int, max_unhealthy_share: float) -> int:
    """How many nodes of a pool of ``pool_size`` may be replaced at once (at least 1)."""
    return max(1, math.floor(pool_size * max_unhealthy_share + 1e-9))


def plan_replacement(
    requested: list[str], pool: list[str], out_of_service: list[str], max_unhealthy_share: float
) -> tuple[list[str], list[str], str]:
    """Split ``requested`` into (to replace, refused, reason) under the share rule.

    Unknown nodes are refused; nodes already out of service are left as they are (neither
    replaced again nor refused). If the rest exceeds the limit, all of it is refused: when that
    many nodes look bad at once, replacing some of them is a guess, not a repair.
    """
    wanted: list[str] = []
    for n in requested:
        if n not in wanted:
            wanted.append(n)
    unknown = [n for n in wanted if n not in pool]
    already = [n for n in wanted if n in pool and n in out_of_service]
    candidates = [n for n in wanted if n in pool and n not in out_of_service]
    notes = []
    if unknown:
        notes.append(f"not in the pool {pool}: {unknown}")
    if already:
        notes.append(f"already out of service: {already}")
    limit = replacement_limit(len(pool), max_unhealthy_share)
    if len(candidates) > limit:
        notes.append(
            f"refused to replace {len(candidates)} of {len(pool)} nodes at once: max_unhealthy_share="
            f"{max_unhealthy_share} allows {limit}; so many bad nodes at once suggests a cause "
            "outside the nodes (image, network, storage) — investigate, then replace fewer "
            "nodes at a time or raise max_unhealthy_share"
        )
        return [], unknown + candidates, "; ".join(notes)
    return candidates, unknown, "; ".join(notes)


def job_can_train(train_nodes: int, nodes: list[NodeStatus]) -> bool:
    """Whether a job whose launch trains ``train_nodes`` nodes can still train: enough of its
    nodes (training or standing by as spares) are neither lost nor failed. One rule for every
    backend's status and failure policy: a lost node with a spare behind it is not a failed job."""
    return sum(1 for n in nodes if n.state not in ("failed", LOST)) >= train_nodes
