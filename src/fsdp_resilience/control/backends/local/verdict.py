"""The job verdict: a local job's state and failure from its record, its nodes' liveness and
the run's events (the run contract's ``final`` events).

One rule for ``status`` and for the supervisor's failure policy. A node is done when its launcher
wrote its ``final`` event for this launch; one whose launcher is gone without one, and that nobody
stopped, is *lost* (``restarts_exhausted``: the restart layers went down with the node). A standby
that ends without ever training is a *dropped* spare and fails nothing by itself; ``job_can_train``
says whether the job goes on.
"""

from __future__ import annotations

import dataclasses
import re
import time
from pathlib import Path
from typing import Any

from fsdp_resilience.control.backends.base import LOST, BackendError, JobStatus, NodeStatus
from fsdp_resilience.control.backends.evidence import final_events, trained_nodes
from fsdp_resilience.control.backends.local.processes import process_alive
from fsdp_resilience.control.backends.local.state import StateStore, read_json, tail_lines
from fsdp_resilience.control.backends.replacement import job_can_train
from fsdp_resilience.training.contract import FailureClass, RunDir, failure_class_for_exit, most_telling_failure

#: Lines of a dropped spare's log searched for why its launcher left the rendezvous.
_DROP_REASON = re.compile(r"health ?check|unhealthy|exception|error", re.IGNORECASE)


def judge_job(store: "StateStore", record: dict[str, Any]) -> JobStatus:
    """The job's state from its record, its nodes' liveness and the run's events. One function for
    ``status`` and for the supervisor's failure policy, so that both apply the same rule.

    The job fails when a node that is not a dropped spare failed (a failing ``final`` of a node
    that trained, a training node that could not start), or when it can no longer train
    (``job_can_train``: fewer nodes neither lost nor failed than ``train_nodes``). Without spares
    that is any failed or lost node, as it always was."""
    # Liveness first, then the events: a node seen gone has written any final event it ever will.
    alive = {n["index"]: process_alive(n["pid"], n["start_ticks"]) for n in record["nodes"]}
    finals = final_events(Path(record["run_dir"]), record["launch_id"])
    has_standby = any(n.get("standby") for n in record["nodes"])
    trained = trained_nodes(record["run_dir"], record["launch_id"]) if has_standby else set()
    nodes = [_node_status(store, record, n, alive[n["index"]], finals.get(n["index"])) for n in record["nodes"]]
    # A standby that ended without ever training: its launcher left the rendezvous (NVRx's health
    # check at join turned it away, the launch ended), or we stopped it (its slot was quarantined).
    dropped = {
        n["index"]
        for n, s in zip(record["nodes"], nodes)
        if n.get("standby") and n["index"] not in trained and s.state == "failed"
    }
    nodes = [_dropped_spare(s, n) if s.index in dropped else s for n, s in zip(record["nodes"], nodes)]
    return _verdict(record, nodes, dropped)


def promotion_pending(record: dict[str, Any], status: JobStatus) -> bool:
    """Whether a node that trained was lost after the training nodes last recorded who trains
    (control/membership.json, written by global rank 0 as each attempt starts): a spare is still
    taking its place."""
    lost = [record["nodes"][n.index] for n in status.nodes if n.state == LOST]
    if not lost:
        return False
    trained = trained_nodes(record["run_dir"], record["launch_id"])
    lost_at = [n["ended_at"] or time.time() for n in lost if n["index"] in trained]
    if not lost_at:
        return False  # only spares that never trained were lost: nobody's place is being taken
    try:
        membership = read_json(RunDir(record["run_dir"]).membership) or {}
    except BackendError:  # torn by a full disk: no record to go by
        membership = {}
    recorded_at = membership.get("ts") if membership.get("launch_id") == record["launch_id"] else None
    return not isinstance(recorded_at, (int, float)) or recorded_at < max(lost_at)


#: How a dropped spare's status message begins (fsdp_resilience.training.launch writes the same in its final).
DROPPED_SPARE = "spare dropped before it trained: "


def _dropped_spare(status: NodeStatus, node: dict[str, Any]) -> NodeStatus:
    reason = status.message
    if reason.startswith(DROPPED_SPARE):
        reason = reason[len(DROPPED_SPARE) :]  # its launcher already said why (NVRx's reason)
    elif not node.get("stopped_by"):
        # Not stopped by us: the launcher's log says why it left (NVRx names the failed check).
        lines = [
            line.strip() for line in tail_lines(Path(node["log_path"]), 60).splitlines() if _DROP_REASON.search(line)
        ]
        if lines:
            reason += f"; its log: {lines[-1][:300]}"
    return dataclasses.replace(status, message=DROPPED_SPARE + reason)


def _verdict(record: dict[str, Any], nodes: list[NodeStatus], dropped: set[int]) -> JobStatus:
    exit_codes = {n.index: n.exit_code for n in nodes if n.state in ("succeeded", "failed", LOST)}
    failed = [n for n in nodes if n.state in ("failed", LOST)]
    train_nodes = record.get("train_nodes", len(record["nodes"]))
    cancel = record["cancel"]
    if cancel and not all(n.state == "succeeded" or n.index in dropped for n in nodes):
        # Stopped while running: the verdict taken at cancel time, unless a node ended with a
        # more telling one by itself (the launcher beat the SIGTERM).
        failure = most_telling_failure([n.failure_class for n in failed] + [cancel["failure_class"]])
        if failure == cancel["failure_class"]:
            return JobStatus("failed", failure, exit_codes, cancel["message"], nodes)
    fatal = [n for n in failed if n.state == "failed" and n.index not in dropped]
    if fatal or not job_can_train(train_nodes, nodes):
        # A dropped spare explains a failure only when nothing else does.
        blamed = [n for n in failed if n.index not in dropped] or failed
        failure = most_telling_failure([n.failure_class for n in blamed])
        # Name the node that explains the failure: lost before merely failed, then by index.
        first = min(blamed, key=lambda n: (n.failure_class != failure, n.state != LOST, n.index))
        others = [f"node {n.index} ({n.node_id}) {n.state}: {n.failure_class}" for n in failed if n is not first]
        message = f"node {first.index} ({first.node_id}) {first.state}: {first.failure_class}"
        exit_note = f" (exit {first.exit_code})" if first.exit_code is not None else ""
        message += f"{exit_note}: {first.message}"
        if others:
            message += "; also " + "; ".join(others)
        if dropped or len(nodes) > train_nodes:
            left = sum(1 for n in nodes if n.state not in ("failed", LOST))
            message += f" ({left} node(s) left to train, the launch needs {train_nodes})"
        return JobStatus("failed", failure, exit_codes, message, nodes)
    # The job can train: a lost node has a spare behind it, a dropped spare is one fewer.
    notes = [
        f"node {n.index} ({n.node_id}) lost ({n.message}): a spare covers it (in-job restart, no relaunch)"
        for n in nodes
        if n.state == LOST
    ]
    notes += [f"node {n.index} ({n.node_id}): {n.message}" for n in nodes if n.index in dropped]
    suffix = "; " + "; ".join(notes) if notes else ""
    counted = [n for n in nodes if n.state != LOST and n.index not in dropped]
    if all(n.state == "succeeded" for n in counted):
        count = f"all {len(nodes)}" if len(counted) == len(nodes) else f"{len(counted)} of {len(nodes)}"
        return JobStatus(
            "succeeded",
            FailureClass.SUCCESS.value,
            exit_codes,
            f"{count} node(s) succeeded: {counted[0].message}{suffix}",
            nodes,
        )
    running = [n for n in nodes if n.state == "running"]
    if running:
        return JobStatus(
            "running",
            None,
            exit_codes,
            f"{len(running)} of {len(nodes)} node(s) running on {[n.node_id for n in running]}{suffix}",
            nodes,
        )
    return JobStatus("pending", None, exit_codes, f"waiting for {len(nodes)} node(s) to start{suffix}", nodes)


def _node_status(
    store: "StateStore", record: dict[str, Any], node: dict[str, Any], alive: bool, final: dict[str, Any] | None
) -> NodeStatus:
    index, slot = node["index"], node["node_id"]
    if final is not None:
        failure = final.get("failure_class")
        state = "succeeded" if failure == FailureClass.SUCCESS.value else "failed"
        message = final.get("message", "")
        if node.get("stopped_by") and state == "failed":
            message = f"stopped by {node['stopped_by']}: {message}"
        return NodeStatus(index, slot, state, failure, final.get("exit_code"), message)
    if node["pid"] is None:
        if record["error"]:
            return NodeStatus(index, slot, "failed", FailureClass.UNKNOWN.value, None, record["error"])
        if node.get("start_error"):
            return NodeStatus(index, slot, "failed", FailureClass.UNKNOWN.value, None, node["start_error"])
        supervisor = record["supervisor"]
        started = supervisor["pid"] is not None
        if (started and not process_alive(supervisor["pid"], supervisor["start_ticks"])) or (
            not started and time.time() - record["created_at"] > 2 * record["start_timeout_s"]
        ):
            return NodeStatus(
                index,
                slot,
                "failed",
                FailureClass.UNKNOWN.value,
                None,
                f"the supervisor ended before starting this node; see {supervisor['log_path']}",
            )
        return NodeStatus(index, slot, "pending", None, None, "starting")
    if alive:
        return NodeStatus(index, slot, "running", None, None, f"launcher pid {node['pid']}")
    rc = node["exit_code"]
    if node["stopped_by"]:  # we stopped it (SIGKILL after the grace period): not a lost node
        return NodeStatus(
            index,
            slot,
            "failed",
            FailureClass.UNKNOWN.value,
            rc if rc is not None and rc >= 0 else None,
            f"stopped by {node['stopped_by']} before it reported (exit {rc})",
        )
    if rc is None:
        # Gone, and no exit code in the record read above. Its supervisor reaps it within a poll
        # and records the code before it ends itself: look again after checking on it. Judging
        # it meanwhile would call a launcher that exited by itself (73: another launcher holds
        # the run; 2: a bad config) a lost node, and replace a healthy machine.
        supervisor = record["supervisor"]
        supervising = process_alive(supervisor["pid"], supervisor["start_ticks"])
        rc = ((store.read_job(record["job_name"]) or record)["nodes"][index]).get("exit_code")
        if rc is None and supervising:
            return NodeStatus(
                index, slot, "running", None, None, f"launcher pid {node['pid']} ended; its exit code is being recorded"
            )
    if rc is not None and rc >= 0:
        # Exited without a final event: rejected before training started (exit 2), or crashed.
        failure = failure_class_for_exit(rc).value
        return NodeStatus(
            index,
            slot,
            "failed",
            failure,
            rc,
            f"the launcher exited {rc} without a final event; see {node['log_path']}",
        )
    how = f"killed by signal {-rc}" if rc is not None else "gone"
    # The restart layers went with the node: to the control plane this is restarts exhausted.
    return NodeStatus(
        index,
        slot,
        LOST,
        FailureClass.RESTARTS_EXHAUSTED.value,
        None,
        f"node lost: launcher pid {node['pid']} {how} without reporting",
    )
