"""Reading an EKS launch: pure functions over the API's JSON (the sync and the async client
alike) that turn a Job and its pods into the backend interface's ``JobStatus`` and ``NodeStatus``.

The state is the cluster's: a Job's conditions and its pods' container statuses, read fresh on
every call, so any process can pick up a job another process submitted. A Job the control plane
stopped carries its verdict in CANCEL_ANNOTATION (``cancel_verdict``); a Job the backend suspended
because its training nodes succeeded (completion.py) carries SUCCEEDED_ANNOTATION.
"""

from __future__ import annotations

import calendar
import dataclasses
import json
import time
from typing import Any

from fsdp_resilience.control.backends.base import LOST, JobStatus, NodeStatus
from fsdp_resilience.control.backends.eks.constants import (
    CANCEL_ANNOTATION,
    CONFIG_ENV,
    CONTAINER,
    SUCCEEDED_ANNOTATION,
)
from fsdp_resilience.control.backends.replacement import job_can_train
from fsdp_resilience.training.contract import (
    FINAL_FAILURES,
    ExitCode,
    FailureClass,
    RunConfig,
    failure_class_for_exit,
    most_telling_failure,
)

#: Pod failure reasons that mean the pod, not the program, was taken away.
_DISRUPTION_REASONS = (
    "NodeLost",
    "Evicted",
    "Preempting",
    "DeadlineExceeded",
    "Terminated",
    "Shutdown",
    "NodeShutdown",
    "UnexpectedAdmissionError",
)


def timestamp(text: str | None) -> float:
    """Seconds since the epoch of an RFC 3339 UTC time as the apiserver writes it (0: none)."""
    if not text:
        return 0.0
    return float(calendar.timegm(time.strptime(text[:19], "%Y-%m-%dT%H:%M:%S")))


def conditions_of(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c.get("type"): c for c in (obj.get("status") or {}).get("conditions") or []}


def pod_index(pod: dict[str, Any]) -> int | None:
    meta = pod.get("metadata") or {}
    value = (meta.get("labels") or {}).get("batch.kubernetes.io/job-completion-index") or (
        meta.get("annotations") or {}
    ).get("batch.kubernetes.io/job-completion-index")
    return int(value) if value is not None and str(value).isdigit() else None


def _terminated(pod: dict[str, Any]) -> dict[str, Any] | None:
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        if cs.get("name") == CONTAINER:
            state = cs.get("state") or {}
            return state.get("terminated") or (cs.get("lastState") or {}).get("terminated")
    return None


def node_from_pod(index: int, pod: dict[str, Any] | None, stopped: str | None) -> NodeStatus:
    """One node of a job from its newest pod. ``stopped``: why the job was stopped (its pods
    deleted by the job controller or by a cancel), or None while it may still run."""
    if pod is None:
        if stopped:
            return NodeStatus(
                index, None, "failed", FailureClass.UNKNOWN.value, None, f"stopped before it reported: {stopped}"
            )
        return NodeStatus(index, None, "pending", None, None, "no pod yet")
    name = pod["metadata"]["name"]
    status = pod.get("status") or {}
    node = (pod.get("spec") or {}).get("nodeName")
    phase = status.get("phase")
    term = _terminated(pod)
    code = term.get("exitCode") if term else None
    reason = (term or {}).get("reason") or status.get("reason") or ""
    disrupted = (conditions_of(pod).get("DisruptionTarget") or {}).get("status") == "True"
    where = f"pod {name} on {node or 'no node'}"
    if phase == "Succeeded":
        return NodeStatus(index, node, "succeeded", FailureClass.SUCCESS.value, 0, f"{where} succeeded")
    if phase == "Failed":
        if disrupted or reason in _DISRUPTION_REASONS or reason == "OOMKilled" or code is None:
            # The pod went, and the restart layers inside it with it: to the control plane the node
            # ran out of restarts (a relaunch elsewhere may succeed).
            detail = (status.get("message") or (term or {}).get("message") or "").strip()
            return NodeStatus(
                index,
                node,
                LOST,
                FailureClass.RESTARTS_EXHAUSTED.value,
                code,
                f"{where} lost: {reason or 'disrupted'}"
                + (f" (exit {code})" if code is not None else "")
                + (f": {detail}" if detail else ""),
            )
        if int(code) == ExitCode.LAUNCH_ENDED:
            # Started after its launch ended and did nothing; the Job ignores it (podFailurePolicy)
            # and, while it is not finished, recreates it: not a failure of the node or the launch.
            return NodeStatus(
                index, node, "pending", None, None, f"{where} exited {code} (launch_ended): its launch had ended"
            )
        failure = failure_class_for_exit(int(code)).value
        return NodeStatus(index, node, "failed", failure, int(code), f"{where} exited {code} ({reason or 'Error'})")
    if disrupted and (pod.get("metadata") or {}).get("deletionTimestamp"):
        # Deleted from outside and not yet terminal: its node stopped reporting and the taint
        # manager deleted it (it stays Terminating until PodGC fails it), or an eviction runs.
        target = conditions_of(pod).get("DisruptionTarget") or {}
        why = f"{target.get('reason') or 'disrupted'}" + (f": {target['message']}" if target.get("message") else "")
        return NodeStatus(
            index,
            node,
            LOST,
            FailureClass.RESTARTS_EXHAUSTED.value,
            None,
            f"{where} lost: {why} (terminating; the Job replaces it once it is terminal)",
        )
    if stopped and (pod.get("metadata") or {}).get("deletionTimestamp"):
        return NodeStatus(index, node, "failed", FailureClass.UNKNOWN.value, None, f"{where} stopped: {stopped}")
    if phase == "Running":
        return NodeStatus(index, node, "running", None, None, f"{where} running")
    scheduled = conditions_of(pod).get("PodScheduled") or {}
    why = scheduled.get("message") or scheduled.get("reason") or "waiting to start"
    return NodeStatus(index, node, "pending", None, None, f"{where} pending: {why}")


def _unschedulable(pod: dict[str, Any]) -> str | None:
    """The scheduler's message when it found no node for the pod (None: scheduled, or not tried)."""
    scheduled = conditions_of(pod).get("PodScheduled") or {}
    if scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable":
        return scheduled.get("message") or "Unschedulable"
    return None


def age_key(pod: dict[str, Any]) -> tuple[str, int]:
    """Orders the pods of one index oldest first. Creation times have whole seconds, so within
    one second a pod still live is the newer: the Job replaces a pod only once it is ending."""
    meta, phase = pod.get("metadata") or {}, (pod.get("status") or {}).get("phase")
    ending = phase in ("Succeeded", "Failed") or bool(meta.get("deletionTimestamp"))
    return meta.get("creationTimestamp") or "", 0 if ending else 1


def newest_pods(pods: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """index -> the newest pod of that completion index."""
    newest: dict[int, dict[str, Any]] = {}
    for pod in pods:
        index = pod_index(pod)
        if index is None:
            continue
        if index not in newest or age_key(pod) >= age_key(newest[index]):
            newest[index] = pod
    return newest


def recreated_indexes(job: dict[str, Any], newest: dict[int, dict[str, Any]]) -> list[int]:
    """Indices whose newest pod the Job controller recreated after the launch started: created
    after the Job's pods were (its startTime, set when submit resumed it), in a Job that counted a
    failed pod. The pod it replaced may be gone (PodGC and evictions delete it)."""
    status = job.get("status") or {}
    if not status.get("failed"):
        return []
    created = {i: timestamp(p["metadata"].get("creationTimestamp")) for i, p in newest.items()}
    # As times, not text: the typed clients write "+00:00" where the API's JSON has "Z".
    started = timestamp(status.get("startTime")) or min(created.values(), default=0.0)
    return sorted(i for i, at in created.items() if at > started)


def lost_before(pods: list[dict[str, Any]], newest: dict[int, dict[str, Any]]) -> dict[int, NodeStatus]:
    """index -> the node status of the newest pod of that index that was lost (disrupted, its
    node gone) and that the Job controller has since replaced: a node the job lost while it ran."""
    out: dict[int, tuple[tuple[str, int], NodeStatus]] = {}
    for pod in pods:
        index = pod_index(pod)
        if index is None or pod is newest.get(index):
            continue
        status = node_from_pod(index, pod, None)
        created = age_key(pod)
        if status.state == LOST and (index not in out or created >= out[index][0]):
            out[index] = (created, status)
    return {index: status for index, (_, status) in out.items()}


def job_status(job: dict[str, Any], pods: list[dict[str, Any]], *, provisions_on_demand: bool = False) -> JobStatus:
    """A launch's state from its Job and pods, in the backend interface's terms.

    One pod per completion index: ``cfg.nodes`` train, the rest (``cfg.spare_nodes``) are hot
    spares. While the Job runs, a lost node (its pod disrupted, or that pod's replacement unable
    to find a node) fails the launch only when too few nodes are left to train
    (``job_can_train``), or when it is node 0, which hosts the rendezvous store: with a spare
    behind it, the job stays running and the node shows lost.
    ``provisions_on_demand`` (Karpenter): an unschedulable pod is what makes a node come, so a
    replacement waiting for one is pending, not lost."""
    name = job["metadata"]["name"]
    completions = int((job.get("spec") or {}).get("completions") or 1)
    cfg = run_config_of(job)
    train_nodes = min(cfg.nodes, completions) if cfg else completions
    conds = {t: c for t, c in conditions_of(job).items() if c.get("status") == "True"}
    cancel = cancel_verdict(job)
    failed_cond = conds.get("Failed") or conds.get("FailureTarget")
    stopped = None
    if failed_cond:
        stopped = f"job {name} failed ({failed_cond.get('reason')}: {failed_cond.get('message', '')})"
    elif cancel:
        stopped = cancel["message"]
    newest = newest_pods(pods)
    nodes = [node_from_pod(i, newest.get(i), stopped) for i in range(completions)]
    if not stopped:
        # A lost pod's replacement that no node can take (the pool has no healthy node left) does
        # not bring the node back: the node is still lost, blamed on the node it was lost on (when
        # the old pod is still there to say which).
        was_lost = lost_before(pods, newest)
        for index in sorted(set(was_lost) | set(recreated_indexes(job, newest))):
            was = was_lost.get(index)
            pod_name = newest[index]["metadata"]["name"]
            lost_on = f"pod lost on {was.node_id or 'no node'}" if was else "a failed pod"
            why = (
                _unschedulable(newest[index]) if nodes[index].state == "pending" and not provisions_on_demand else None
            )
            if why:
                nodes[index] = NodeStatus(
                    index,
                    was.node_id if was else None,
                    LOST,
                    FailureClass.RESTARTS_EXHAUSTED.value,
                    was.exit_code if was else None,
                    f"{was.message if was else f'node {index} was lost'}; its replacement pod "
                    f"{pod_name} cannot be scheduled: {why}",
                )
            elif nodes[index].state in ("pending", "running"):
                nodes[index] = dataclasses.replace(
                    nodes[index],
                    message=(
                        f"{nodes[index].message} (the Job recreated it for {lost_on}; its launcher rejoins the "
                        "rendezvous, as a spare once another node took the lost one's place)"
                    ),
                )
    # Pods the job controller already replaced (their failures counted against backoffLimit) are
    # part of the story too: a node that lost a pod is suspect even if a new pod now runs there.
    replaced = [
        node_from_pod(pod_index(p), p, stopped)
        for p in pods
        if pod_index(p) is not None
        and p is not newest.get(pod_index(p))
        and (p.get("status") or {}).get("phase") == "Failed"
    ]
    if cancel:
        # The suspended Job's pods are deleted: the nodes they ran on are the ones cancel recorded
        # (diagnose reads each node's own health, so a pod gone must not hide its node).
        recorded = cancel.get("nodes", {})
        nodes = [
            n
            if n.node_id
            else NodeStatus(n.index, recorded.get(str(n.index)), n.state, n.failure_class, n.exit_code, n.message)
            for n in nodes
        ]
    exit_codes = {n.index: n.exit_code for n in nodes if n.state in ("succeeded", "failed", LOST)}
    if "Complete" in conds or "SuccessCriteriaMet" in conds:
        what = f"all {completions} node(s)" if completions == train_nodes else f"{train_nodes} training node(s)"
        return JobStatus("succeeded", FailureClass.SUCCESS.value, exit_codes, f"{what} of job {name} succeeded", nodes)
    succeeded = succeeded_verdict(job)
    if succeeded is not None and not failed_cond:
        return JobStatus(
            "succeeded",
            FailureClass.SUCCESS.value,
            exit_codes,
            f"job {name}: {succeeded.get('message') or 'its training nodes succeeded'} (suspended by the backend)",
            nodes,
        )
    failed = [n for n in nodes if n.state in ("failed", LOST)]
    # A node that failed with a class the Job's podFailurePolicy fails the Job on: failed now,
    # even if the job controller has not written its condition yet.
    fatal = [n for n in failed if n.failure_class in FINAL_FAILURES and n.state == "failed"]
    lost = [n for n in nodes if n.state == LOST]
    # More nodes lost than spares behind them: the launch cannot train; the ladder takes over
    # (stop_launch suspends the Job, diagnose blames the lost nodes).
    # Node 0 hosts the rendezvous store (the pod every node rendezvouses at): no spare takes its place.
    store_lost = not stopped and any(n.index == 0 for n in lost)
    too_few = bool(lost) and not stopped and (store_lost or not job_can_train(train_nodes, nodes))
    if failed_cond or cancel or fatal or too_few:
        failure = most_telling_failure(
            [n.failure_class for n in failed + replaced] + ([cancel["failure_class"]] if cancel else [])
        )
        parts = []
        if (
            failure in (None, FailureClass.UNKNOWN.value)
            and failed_cond
            and failed_cond.get("reason") == "BackoffLimitExceeded"
            and not [n for n in failed + replaced if n.state == "failed" and n.exit_code is not None]
        ):
            # The Job used up its failure budget and no pod it kept failed on its own: the failed
            # pods were deleted, as disrupted pods are (evicted, preempted, lost with their node).
            failure = FailureClass.RESTARTS_EXHAUSTED.value
            parts.append(
                f"the job's pods were disrupted (evicted, preempted or lost with their node) more often than "
                f"its backoffLimit={(job.get('spec') or {}).get('backoffLimit')} allows "
                "(PodTemplateSettings.backoff_limit + max_pod_disruptions)"
            )
        failure = failure or FailureClass.UNKNOWN.value
        if too_few and not (failed_cond or cancel or fatal):
            left = sum(1 for n in nodes if n.state not in ("failed", LOST))
            if store_lost:
                parts.append(
                    "node 0 was lost, and it hosts the rendezvous store every node meets at: no spare can "
                    "take its place"
                )
            if not job_can_train(train_nodes, nodes):
                parts.append(
                    f"too few nodes left to train: {left} of the {train_nodes} needed "
                    f"({completions - train_nodes} spare(s) launched, {len(lost)} node(s) lost)"
                )
        telling = [n for n in failed + replaced if n.failure_class == failure]
        parts += [n.message for n in telling[:3]]
        if cancel and failure == cancel["failure_class"]:
            parts.insert(0, cancel["message"])
        if failed_cond:
            parts.append(f"job condition {failed_cond.get('reason')}: {failed_cond.get('message', '')}")
        return JobStatus("failed", failure, exit_codes, f"{failure}: " + "; ".join(p for p in parts if p), nodes)
    if (job.get("spec") or {}).get("suspend"):
        # Created suspended and not yet resumed: submit has not finished (a retry resumes it).
        return JobStatus(
            "pending",
            None,
            exit_codes,
            f"job {name} is suspended until its Service and NetworkPolicy exist and submit resumes it "
            "(a submit that did not finish: retry the launch task)",
            nodes,
        )
    if lost:
        # Covered: a spare takes each lost node's place at the next in-job restart.
        left = sum(1 for n in nodes if n.state not in ("failed", LOST))
        covered = {n.index for n in lost}
        nodes = [
            dataclasses.replace(
                n, message=f"{n.message}; a spare covers it ({left} node(s) left for the {train_nodes} that train)"
            )
            if n.index in covered
            else n
            for n in nodes
        ]
    running = [n for n in nodes if n.state == "running"]
    if running and len(running) == len(nodes):
        return JobStatus(
            "running", None, exit_codes, f"{len(running)} node(s) running on {[n.node_id for n in running]}", nodes
        )
    if running:
        waiting = [n.message for n in nodes if n.state != "running"]
        return JobStatus(
            "running",
            None,
            exit_codes,
            f"{len(running)} of {len(nodes)} node(s) running; " + "; ".join(waiting[:3]),
            nodes,
        )
    return JobStatus(
        "pending", None, exit_codes, "; ".join(n.message for n in nodes[:3]) or f"job {name}: waiting for pods", nodes
    )


def cancel_verdict(job: dict[str, Any]) -> dict[str, Any] | None:
    text = ((job.get("metadata") or {}).get("annotations") or {}).get(CANCEL_ANNOTATION)
    if not text:
        return None
    try:
        verdict = json.loads(text)
    except ValueError:
        return {"failure_class": FailureClass.UNKNOWN.value, "message": f"cancelled ({text[:200]})"}
    return verdict if isinstance(verdict, dict) else None


def succeeded_verdict(job: dict[str, Any]) -> dict[str, Any] | None:
    """What SUCCEEDED_ANNOTATION says (the backend ended the Job because its training nodes
    succeeded), or None."""
    text = ((job.get("metadata") or {}).get("annotations") or {}).get(SUCCEEDED_ANNOTATION)
    if not text:
        return None
    try:
        verdict = json.loads(text)
    except ValueError:
        return {"message": text[:200]}
    return verdict if isinstance(verdict, dict) else {"message": str(verdict)[:200]}


def job_finished(job: dict[str, Any]) -> bool:
    conds = {t for t, c in conditions_of(job).items() if c.get("status") == "True"}
    return (
        bool(conds & {"Complete", "Failed", "SuccessCriteriaMet", "FailureTarget"})
        or cancel_verdict(job) is not None
        or succeeded_verdict(job) is not None
    )


def run_config_of(job: dict[str, Any]) -> RunConfig | None:
    """The run config a Job was submitted with (it travels in its pods' env)."""
    containers = (((job.get("spec") or {}).get("template") or {}).get("spec") or {}).get("containers") or []
    for container in containers:
        for env in container.get("env") or []:
            if env.get("name") == CONFIG_ENV and env.get("value"):
                return RunConfig.from_json(env["value"])
    return None
