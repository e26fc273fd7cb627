"""Keeping a launch's hot-spare pool whole while training goes on (``keep_spare_pool``, what the
DAG's keep_spare_pool task calls): take a lost node out of service, ask the backend for a new spare
and record it (``spare_added``). Each refill spends one of the run's ``max_node_replacements``, which
the ladder's rungs (ladder.py) spend too; what was spent and which nodes were already handled come
from the run's events log, so a retried task does nothing twice.
"""

from __future__ import annotations

import time
from typing import Any

from fsdp_resilience.control.backends import LOST, BackendError, InsufficientCapacityError, JobHandle, get_backend
from fsdp_resilience.control.backends.base import node_key
from fsdp_resilience.control.task_data import Launch, Run
from fsdp_resilience.training.contract import REPLACEABLE_FAILURES, Event, EventLog, RunConfig, read_events
from fsdp_resilience.training.contract.replacements import announce_no_replacement, announce_replacement

#: How long the survivors of a loss no parked spare covers wait for the spare just added, placed on
#: a node (control/membership-deadline.json): a new local slot starts in seconds; on EKS the pod
#: pulls its image and starts.
SPARE_JOIN_S = 300.0
#: The same for a spare that waits for a node being provisioned (EKS: Karpenter's NodeClaim, or the
#: node group's replacement instance): a new node takes minutes.
NEW_NODE_SPARE_JOIN_S = 900.0
#: The keeper's standing notice while it watches with replacements left (renewed at each poll of
#: its trigger): what a loss takes to reach the keeper's word on it (the trigger's poll, the task
#: resuming on a worker, the backend's calls), with room for a loaded scheduler.
KEEPER_NOTICE_S = 60.0


def _control_events(cfg: RunConfig, event: Event, since: float) -> list[dict[str, Any]]:
    """The run's ``event`` records written since ``since`` (epoch seconds): a run dir reused by a
    later DAG run (the same run_name) keeps the records of the earlier ones, which are not this
    run's to count."""
    return [
        r for r in read_events(cfg.layout.events, event) if isinstance(r.get("ts"), (int, float)) and r["ts"] >= since
    ]


def spares_added(run: Run, launch: Launch) -> list[dict[str, Any]]:
    """The ``spare_added`` records of this launch: one per lost node whose spare was replaced."""
    cfg = RunConfig.from_dict(run.config)
    launch_id = launch.launch_id
    return [
        r for r in _control_events(cfg, Event.SPARE_ADDED, launch.launched_at) if str(r.get("launch_id")) == launch_id
    ]


def handled_nodes(run: Run, launch: Launch) -> list[str]:
    """The nodes of this launch (``NodeStatus.key``: index and machine) whose loss the pool
    keeper already made up for (from the events log, so a retried task never quarantines and
    refills for the same node twice; on EKS a recreated pod keeps a lost pod's index on another
    machine, and is handled on its own if it is lost too)."""
    return sorted(
        {
            node_key(r["lost_node_rank"], r.get("lost_node_id"))
            for r in spares_added(run, launch)
            if isinstance(r.get("lost_node_rank"), int)
        }
    )


def node_replacements_done(run: Run, since: float) -> tuple[int, int]:
    """(escalations, spare refills) of this DAG run, whose first launch was at ``since``."""
    cfg = RunConfig.from_dict(run.config)
    return (len(_control_events(cfg, Event.ESCALATION, since)), len(_control_events(cfg, Event.SPARE_ADDED, since)))


def replacements_left(run: Run, since: float) -> int:
    """How many of ``max_node_replacements`` this DAG run (first launch at ``since``) has left."""
    escalations, refills = node_replacements_done(run, since)
    return max(0, int(run.max_node_replacements) - escalations - refills)


def keep_spare_pool(
    run: Run, launch: Launch, nodes: list[dict[str, Any]], since: float, log: Any = print
) -> list[dict[str, Any]]:
    """Make up for ``nodes`` (``NodeStatus`` dicts: lost, or spares that dropped out) of a launch
    that trains on, a spare having taken (or being ready to take) their place: take each out of
    service (``replace_nodes``: the local slot is quarantined; on EKS the node is cordoned,
    tainted and replaced, under the same share rule as the ladder's), ask the backend for a new
    spare (``add_spare``) and record it (``spare_added``).

    The bound: each refill spends one of the run's ``max_node_replacements``, which the rungs
    spend too (escalations and refills of this DAG run since ``since``, its first launch, from
    the events log). With the budget spent, the node refused by the share rule, or no free
    healthy node, nothing is refilled: the launch trains on with one spare fewer (with none left,
    the next loss fails it and the ladder decides as without spares). That is logged, never
    raised: the run is not failed for a spare it could not add. A node already handled (a
    ``spare_added`` of this launch names it) is skipped, so a retried task does nothing twice.

    Returns one dict per node: ``node_rank``, ``node_id``, ``refilled`` and ``why`` (and the
    new spare's ``spare`` when refilled)."""
    cfg = RunConfig.from_dict(run.config)
    backend = get_backend(**run.backend)
    handle = JobHandle.from_dict(launch.handle)
    budget = int(run.max_node_replacements)
    done = handled_nodes(run, launch)
    results = []
    for node in nodes:
        index, node_id = int(node["index"]), node.get("node_id")
        key = node_key(index, node_id)
        what = f"launch {handle.launch_id}: node {index} ({node_id}) {node['state']}: {node.get('message') or '?'}"

        # Called within this iteration only, so the loop variables it reads are this node's.
        def result(refilled: bool, why: str, announce: bool = True, **extra: Any) -> None:
            log(f"{what}; {'spare pool refilled' if refilled else 'spare pool not refilled'}: {why}")  # noqa: B023
            if announce and not refilled:  # survivors waiting for a node stop waiting
                announce_no_replacement(cfg.layout.control, handle.launch_id, why=f"spare pool not refilled: {why}")
            results.append(
                {"node_rank": index, "node_id": node_id, "key": key, "refilled": refilled, "why": why, **extra}  # noqa: B023
            )

        if key in done:
            result(False, "already handled (a spare_added record of this launch names it)", announce=False)
            continue
        escalations, refills = node_replacements_done(run, since)
        if escalations + refills >= budget:
            result(
                False,
                f"max_node_replacements={budget} spent ({escalations} escalation(s), {refills} spare "
                "refill(s)); the launch trains on with one spare fewer, and with none left a lost node "
                "fails it and the ladder decides",
            )
            continue
        if not node_id:
            result(False, "the backend names no machine for it: nothing to take out of service")
            continue
        reason = (
            f"launch {handle.launch_id}: node {index} {node['state']} while training went on "
            f"({node.get('failure_class')}: {node.get('message') or 'no message'})"
        )
        quarantined: list[str] = []
        if node["state"] == LOST or node.get("failure_class") in REPLACEABLE_FAILURES:
            try:
                replacement = backend.replace_nodes([node_id], reason=reason)
            except BackendError as e:
                result(False, f"could not take {node_id} out of service: {e}")
                continue
            if node_id in replacement.refused:
                result(False, f"the backend refused to take {node_id} out of service: {replacement.reason}")
                continue
            quarantined = list(replacement.replaced)
            log(f"{what}; out of service: {replacement.reason}")
        else:  # ended by its own decision (a user or storage error): not the machine's fault
            log(f"{what}; {node_id} stays in service: {node.get('failure_class')} is not a node fault")
        try:
            spare = backend.add_spare(handle, reason=reason)
        except InsufficientCapacityError as e:
            result(False, f"no free healthy node for a new spare: {e}", quarantined=quarantined)
            continue
        except BackendError as e:  # the launch ended meanwhile, or the backend cannot add spares
            result(False, f"the backend added no spare: {e}", quarantined=quarantined)
            continue
        # Announced once the backend has a place for it (add_spare raised otherwise): a node that
        # runs it now, or one being provisioned (EKS: Karpenter's NodeClaim, the group's instance).
        announce_replacement(
            cfg.layout.control,
            handle.launch_id,
            until=time.time() + (SPARE_JOIN_S if spare.node_id else NEW_NODE_SPARE_JOIN_S),
            why=f"the pool keeper added a spare for node {index} ({node_id}): "
            + (f"node {spare.index} on {spare.node_id}" if spare.node_id else f"node {spare.index}, {spare.state}"),
            nodes=[spare.node_id] if spare.node_id else [],
            node_ranks=[spare.index],
        )
        EventLog(cfg.layout.events, run_id=cfg.run_id, role="control-plane").emit(
            Event.SPARE_ADDED,
            launch_id=handle.launch_id,
            lost_node_id=node_id,
            lost_node_rank=index,
            quarantined=quarantined,
            node_id=spare.node_id,
            node_rank=spare.index,
            reason=reason,
        )
        done.append(key)
        joined = (
            f"node {spare.index} ({spare.node_id})"
            if spare.node_id
            else f"node {spare.index} (a new pod, not yet placed on a machine: {spare.message or spare.state})"
        )
        result(
            True,
            f"{joined} joined as a spare" + (f"; {', '.join(quarantined)} out of service" if quarantined else ""),
            quarantined=quarantined,
            spare=spare.to_dict(),
        )
    return results
