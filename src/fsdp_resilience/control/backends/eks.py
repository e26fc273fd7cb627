"""The EKS backend: one launch = one Indexed Job (a pod per node) + one headless Service + one
NetworkPolicy, all named ``job_name_for(run_id, launch_id)`` (a DNS-1035 label).

    backend = get_backend("eks", image="123.dkr.ecr.../fsdp-training:0.1.0", cluster_name="prod",
                          namespace="fsdp-training", replacement="asg")
    handle = backend.submit(cfg, launch_id="0")

Kubernetes is reached through the cncf.kubernetes provider's hooks: ``KubernetesHook`` (an Airflow
connection, ``kubernetes_default``: in-cluster or a kubeconfig) or, with ``cluster_name``, a
kubeconfig that the amazon provider's ``EksHook`` builds from the cluster's endpoint and the AWS
connection's credentials. The triggerer polls with ``AsyncKubernetesHook`` (``status_async``).
AWS (Auto Scaling) is reached through ``AwsBaseHook``.

The state is the cluster's: a Job's conditions and its pods' container statuses, read fresh on
every call, so any process can pick up a job another process submitted. What the control plane
needs beyond that (a cancel verdict, the nodes a cancelled job ran on) is kept in the Job's
annotations.

``submit`` is safe to retry and never leaves pods running without their Service: it creates the
Job suspended, then its Service and NetworkPolicy (both owned by the Job), then resumes it
(``spec.suspend: false``, sent with the resourceVersion it read). A retry finds the suspended
Job and finishes the steps; a Job a cancel suspended (CANCEL_ANNOTATION) is never resumed. The
image must be under the backend's allowlist (``image_allowlist``; the DAG checks it first, in
validate_config). Every API error becomes a BackendError saying what to do (``kube_error``).

How each failure class plays out (see also the Job's ``podFailurePolicy`` in eks_manifests.py):
  user_error          exit 78/2 -> the Job fails at once; never a node replacement
  storage_error       exit 74 (run dir full or read-only) -> as user_error: free space or fix the mount
  non_finite          exit 65 (NaN/inf after the rollbacks) -> as user_error: lower lr or check the data
  already_running     exit 73 (another launcher holds the node's launch lock) -> the Job fails at once,
                      nothing retries it, nothing is replaced, the other launcher is left alone
  restarts_exhausted  exit 75 -> the Job fails at once; diagnose blames node(s), replace_nodes
                      cordons + taints them, evicts leftovers, and has the ASG (or Karpenter)
                      replace the instance; the DAG relaunches from the newest checkpoint
  no_progress         exit 93, or a stall seen by the watch (cancel suspends the Job) -> as above
  lost node           a pod disrupted (node gone, evicted, OOMKilled launcher) -> restarts_exhausted;
                      the Job replaces up to backoff_limit + max_pod_disruptions failed pods, then
                      fails; a Job whose budget disruptions used up -> restarts_exhausted
  ... with spares     (cfg.spare_nodes: the Job runs nodes + spare_nodes pods) the job stays running
                      while enough nodes are left (base.job_can_train): the lost node shows as lost,
                      a spare takes its place at the next in-job restart, and the Job controller
                      recreates the lost pod for its index, whose launcher parks as the new spare
                      (add_spare checks it). Too few nodes left (more lost than spares, or a lost
                      pod's replacement that cannot be scheduled) -> failed, restarts_exhausted
  unknown             other exit codes count against backoffLimit; then the Job fails, no replacement
"""

from __future__ import annotations

import calendar
import contextlib
import dataclasses
import json
import re
import time
from pathlib import Path
from typing import Any, Iterator

from fsdp_resilience.training.contract import (
    FINAL_FAILURES,
    FailureClass,
    REPLACEABLE_FAILURES,
    RunConfig,
    failure_class_for_exit,
    most_telling_failure,
    what_to_do,
)

from fsdp_resilience.control.backends.base import (
    DEFAULT_MAX_UNHEALTHY_SHARE,
    LOST,
    BackendError,
    Capacity,
    Diagnosis,
    InsufficientCapacityError,
    JobConflictError,
    JobHandle,
    JobNotFoundError,
    JobStatus,
    NodeStatus,
    Replacement,
    ServiceReturn,
    TrainingBackend,
    current_operator,
    job_can_train,
    plan_replacement,
    require_reason,
)
from fsdp_resilience.control.backends.eks_manifests import (
    COMPONENT_TRAINING,
    CONFIG_ENV,
    CONTAINER,
    EFA_RESOURCE,
    LABEL_COMPONENT,
    LABEL_JOB,
    LABEL_RUN,
    MANAGED_BY,
    PodTemplateSettings,
    check_image_prefix,
    evaluation_job,
    image_allowed,
    image_repository,
    rendezvous_network_policy,
    rendezvous_service,
    training_job,
)
from fsdp_resilience.control.backends.evidence import blame_from_events, verdict_at_cancel

#: How a node whose restarts ran out is taken out of service, and by whom it is replaced.
REPLACEMENT_MODES = ("asg", "karpenter", "cordon")
#: Tainted on a node taken out of service (with ``spec.unschedulable``), so nothing of ours lands
#: there again even if someone uncordons it by hand; its value says why (a label value).
QUARANTINE_TAINT = "fsdp-resilience/quarantined"
#: The full reason and time, on the node.
QUARANTINE_ANNOTATION = "fsdp-resilience/quarantine-reason"
#: On a node returned to service (return_nodes): when, by whom, why, and the quarantine it ended.
RETURN_ANNOTATION = "fsdp-resilience/return-reason"
#: On a Job the control plane stopped: the verdict (failure class, message) and its nodes.
CANCEL_ANNOTATION = "fsdp-resilience/cancel"
#: Auto Scaling groups whose instances the backend may terminate carry this tag = "true" (the
#: deploy kit's IAM policy allows TerminateInstanceInAutoScalingGroup only on them).
MANAGED_ASG_TAG = "fsdp-resilience/managed"
#: The EKS node monitoring agent's conditions: False means the node is unhealthy for that reason.
HEALTH_CONDITIONS = ("AcceleratedHardwareReady", "NetworkingReady", "StorageReady", "KernelReady",
                     "ContainerRuntimeReady")
GPU_RESOURCE = "nvidia.com/gpu"
_INSTANCE_ID = re.compile(r"(i-[0-9a-f]{8,17})$")
#: Pod failure reasons that mean the pod, not the program, was taken away.
_DISRUPTION_REASONS = ("NodeLost", "Evicted", "Preempting", "DeadlineExceeded", "Terminated", "Shutdown",
                       "NodeShutdown", "UnexpectedAdmissionError")


#: Where the worker's grants are (RBAC) and how Airflow outside the cluster gets them.
RBAC_HINT = ("grant it in deploy/base/rbac.yaml (the worker's Role/ClusterRole, bound to the ServiceAccount "
             "airflow/airflow-worker and the group fsdp-airflow-worker; the triggerer's are read-only) and apply "
             "the kit; Airflow outside the cluster needs the EKS access entry that maps its IAM role to that "
             "group (docs/deploy-on-eks.md, 4b)")
_FORBIDDEN = re.compile(r'User "(?P<user>[^"]*)" cannot (?P<verb>\S+) resource "(?P<resource>[^"]*)"'
                        r'(?: in API group "(?P<group>[^"]*)")?(?: in the namespace "(?P<ns>[^"]*)")?')


def _status_message(e: Exception) -> str:
    """The apiserver's own message from an ApiException's Status body (else its reason)."""
    body = getattr(e, "body", None)
    if isinstance(body, bytes):
        body = body.decode(errors="replace")
    if body:
        try:
            message = json.loads(body).get("message")
        except (ValueError, AttributeError):
            message = None
        return str(message or body)[:1000]
    return str(getattr(e, "reason", None) or e)[:1000]


def kube_error(e: Exception, doing: str, namespace: str) -> BackendError:
    """A Kubernetes API error (sync or async client) or a connection error as a BackendError that
    says what failed and what to do. ``doing``: what the backend was doing ("create job x")."""
    status = getattr(e, "status", None)
    if status is None or not isinstance(status, int) or status == 0:
        return BackendError(f"cannot reach the Kubernetes API to {doing}: {type(e).__name__}: {str(e)[:300]}. Check "
                            "the Kubernetes connection (FSDP_KUBERNETES_CONN_ID) or FSDP_EKS_CLUSTER_NAME and the AWS "
                            "connection, and that the cluster's endpoint is reachable from Airflow")
    message = _status_message(e)
    if status == 401:
        return BackendError(f"the Kubernetes API refused the credentials to {doing} (401 Unauthorized: {message}). "
                            "Check the Kubernetes connection's kubeconfig or token; with FSDP_EKS_CLUSTER_NAME, that "
                            "the AWS connection's IAM identity has an EKS access entry (docs/deploy-on-eks.md, 4b)")
    if status == 403:
        match = _FORBIDDEN.search(message)
        if match:
            where = f" in namespace {match['ns']}" if match["ns"] else " (cluster-wide)"
            group = match["group"] or "core"
            who = (f"identity {match['user']} lacks the grant '{match['verb']}' on {match['resource']} "
                   f"(API group {group}){where}")
        else:  # an admission policy (Pod Security, the kit's ValidatingAdmissionPolicies) said no
            who = "the request was refused by RBAC or an admission policy"
        return BackendError(f"forbidden to {doing}: {who}. The apiserver said: {message}. If the grant is "
                            f"missing, {RBAC_HINT}")
    if status == 404:
        if re.search(r'namespaces? "[^"]*" not found', message):
            return BackendError(f"cannot {doing}: namespace {namespace} does not exist ({message}). Create it by "
                                "applying the deploy kit (kubectl apply -k deploy/overlays/<cluster>; "
                                "docs/deploy-on-eks.md), "
                                "or set FSDP_EKS_NAMESPACE to the training namespace")
        return BackendError(f"cannot {doing}: not found (404: {message}). Is this the right cluster, and is its API "
                            "(and the kit) installed?")
    if status == 409:
        return BackendError(f"cannot {doing}: conflict (409: {message}); someone changed it meanwhile: retry the task")
    if status == 422:
        return BackendError(f"the apiserver rejected the request to {doing} as invalid (422): {message}")
    if status == 429 or status >= 500:
        return BackendError(f"the Kubernetes API could not {doing} now ({status}: {message}); the apiserver is busy "
                            "or failing: retry the task later")
    return BackendError(f"cannot {doing}: {status} {getattr(e, 'reason', '')}: {message}")


def _ts(text: str | None) -> float:
    """Seconds since the epoch of an RFC 3339 UTC time as the apiserver writes it (0: none)."""
    if not text:
        return 0.0
    return float(calendar.timegm(time.strptime(text[:19], "%Y-%m-%dT%H:%M:%S")))


def _conditions(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c.get("type"): c for c in (obj.get("status") or {}).get("conditions") or []}


# --------------------------------------------------------------------------------------------
# Reading a job: pure functions over the API's JSON (the sync and the async client alike)
# --------------------------------------------------------------------------------------------


def pod_index(pod: dict[str, Any]) -> int | None:
    meta = pod.get("metadata") or {}
    value = (meta.get("labels") or {}).get("batch.kubernetes.io/job-completion-index") or \
        (meta.get("annotations") or {}).get("batch.kubernetes.io/job-completion-index")
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
            return NodeStatus(index, None, "failed", FailureClass.UNKNOWN.value, None,
                              f"stopped before it reported: {stopped}")
        return NodeStatus(index, None, "pending", None, None, "no pod yet")
    name = pod["metadata"]["name"]
    status = pod.get("status") or {}
    node = (pod.get("spec") or {}).get("nodeName")
    phase = status.get("phase")
    term = _terminated(pod)
    code = term.get("exitCode") if term else None
    reason = (term or {}).get("reason") or status.get("reason") or ""
    disrupted = (_conditions(pod).get("DisruptionTarget") or {}).get("status") == "True"
    where = f"pod {name} on {node or 'no node'}"
    if phase == "Succeeded":
        return NodeStatus(index, node, "succeeded", FailureClass.SUCCESS.value, 0, f"{where} succeeded")
    if phase == "Failed":
        if disrupted or reason in _DISRUPTION_REASONS or reason == "OOMKilled" or code is None:
            # The pod went, and the restart layers inside it with it: to the control plane the node
            # ran out of restarts (a relaunch elsewhere may succeed).
            detail = (status.get("message") or (term or {}).get("message") or "").strip()
            return NodeStatus(index, node, LOST, FailureClass.RESTARTS_EXHAUSTED.value, code,
                              f"{where} lost: {reason or 'disrupted'}"
                              + (f" (exit {code})" if code is not None else "") + (f": {detail}" if detail else ""))
        failure = failure_class_for_exit(int(code)).value
        return NodeStatus(index, node, "failed", failure, int(code), f"{where} exited {code} ({reason or 'Error'})")
    if disrupted and (pod.get("metadata") or {}).get("deletionTimestamp"):
        # Deleted from outside and not yet terminal: its node stopped reporting and the taint
        # manager deleted it (it stays Terminating until PodGC fails it), or an eviction runs.
        target = _conditions(pod).get("DisruptionTarget") or {}
        why = f"{target.get('reason') or 'disrupted'}" + (f": {target['message']}" if target.get("message") else "")
        return NodeStatus(index, node, LOST, FailureClass.RESTARTS_EXHAUSTED.value, None,
                          f"{where} lost: {why} (terminating; the Job replaces it once it is terminal)")
    if stopped and (pod.get("metadata") or {}).get("deletionTimestamp"):
        return NodeStatus(index, node, "failed", FailureClass.UNKNOWN.value, None, f"{where} stopped: {stopped}")
    if phase == "Running":
        return NodeStatus(index, node, "running", None, None, f"{where} running")
    scheduled = _conditions(pod).get("PodScheduled") or {}
    why = scheduled.get("message") or scheduled.get("reason") or "waiting to start"
    return NodeStatus(index, node, "pending", None, None, f"{where} pending: {why}")


def _unschedulable(pod: dict[str, Any]) -> str | None:
    """The scheduler's message when it found no node for the pod (None: scheduled, or not tried)."""
    scheduled = _conditions(pod).get("PodScheduled") or {}
    if scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable":
        return scheduled.get("message") or "Unschedulable"
    return None


def _age_key(pod: dict[str, Any]) -> tuple[str, int]:
    """Orders the pods of one index oldest first. Creation times have whole seconds, so within
    one second a pod still live is the newer: the Job replaces a pod only once it is ending."""
    meta, phase = pod.get("metadata") or {}, (pod.get("status") or {}).get("phase")
    ending = phase in ("Succeeded", "Failed") or bool(meta.get("deletionTimestamp"))
    return meta.get("creationTimestamp") or "", 0 if ending else 1


def _newest_pods(pods: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """index -> the newest pod of that completion index."""
    newest: dict[int, dict[str, Any]] = {}
    for pod in pods:
        index = pod_index(pod)
        if index is None:
            continue
        if index not in newest or _age_key(pod) >= _age_key(newest[index]):
            newest[index] = pod
    return newest


def recreated_indexes(job: dict[str, Any], newest: dict[int, dict[str, Any]]) -> list[int]:
    """Indices whose newest pod the Job controller recreated after the launch started: created
    after the Job's pods were (its startTime, set when submit resumed it), in a Job that counted a
    failed pod. The pod it replaced may be gone (PodGC and evictions delete it)."""
    status = job.get("status") or {}
    if not status.get("failed"):
        return []
    started = status.get("startTime") or min((p["metadata"].get("creationTimestamp") or "" for p in newest.values()),
                                             default="")
    return sorted(i for i, p in newest.items() if (p["metadata"].get("creationTimestamp") or "") > started)


def lost_before(pods: list[dict[str, Any]], newest: dict[int, dict[str, Any]]) -> dict[int, NodeStatus]:
    """index -> the node status of the newest pod of that index that was lost (disrupted, its
    node gone) and that the Job controller has since replaced: a node the job lost while it ran."""
    out: dict[int, tuple[tuple[str, int], NodeStatus]] = {}
    for pod in pods:
        index = pod_index(pod)
        if index is None or pod is newest.get(index):
            continue
        status = node_from_pod(index, pod, None)
        created = _age_key(pod)
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
    conds = {t: c for t, c in _conditions(job).items() if c.get("status") == "True"}
    cancel = cancel_verdict(job)
    failed_cond = conds.get("Failed") or conds.get("FailureTarget")
    stopped = None
    if failed_cond:
        stopped = f"job {name} failed ({failed_cond.get('reason')}: {failed_cond.get('message', '')})"
    elif cancel:
        stopped = cancel["message"]
    newest = _newest_pods(pods)
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
            why = _unschedulable(newest[index]) if nodes[index].state == "pending" and not provisions_on_demand \
                else None
            if why:
                nodes[index] = NodeStatus(index, was.node_id if was else None, LOST,
                                          FailureClass.RESTARTS_EXHAUSTED.value, was.exit_code if was else None,
                                          f"{was.message if was else f'node {index} was lost'}; its replacement pod "
                                          f"{pod_name} cannot be scheduled: {why}")
            elif nodes[index].state in ("pending", "running"):
                nodes[index] = dataclasses.replace(nodes[index], message=(
                    f"{nodes[index].message} (the Job recreated it for {lost_on}; its launcher rejoins the "
                    "rendezvous, as a spare once another node took the lost one's place)"))
    # Pods the job controller already replaced (their failures counted against backoffLimit) are
    # part of the story too: a node that lost a pod is suspect even if a new pod now runs there.
    replaced = [node_from_pod(pod_index(p), p, stopped) for p in pods
                if pod_index(p) is not None and p is not newest.get(pod_index(p))
                and (p.get("status") or {}).get("phase") == "Failed"]
    if cancel and not any(n.node_id for n in nodes):
        nodes = [NodeStatus(n.index, cancel.get("nodes", {}).get(str(n.index)), n.state, n.failure_class,
                            n.exit_code, n.message) for n in nodes]
    exit_codes = {n.index: n.exit_code for n in nodes if n.state in ("succeeded", "failed", LOST)}
    if "Complete" in conds or "SuccessCriteriaMet" in conds:
        return JobStatus("succeeded", FailureClass.SUCCESS.value, exit_codes,
                         f"all {completions} node(s) of job {name} succeeded", nodes)
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
        failure = most_telling_failure([n.failure_class for n in failed + replaced]
                                       + ([cancel["failure_class"]] if cancel else []))
        parts = []
        if (failure in (None, FailureClass.UNKNOWN.value) and failed_cond
                and failed_cond.get("reason") == "BackoffLimitExceeded"
                and not [n for n in failed + replaced if n.state == "failed" and n.exit_code is not None]):
            # The Job used up its failure budget and no pod it kept failed on its own: the failed
            # pods were deleted, as disrupted pods are (evicted, preempted, lost with their node).
            failure = FailureClass.RESTARTS_EXHAUSTED.value
            parts.append(f"the job's pods were disrupted (evicted, preempted or lost with their node) more often than "
                         f"its backoffLimit={(job.get('spec') or {}).get('backoffLimit')} allows "
                         "(PodTemplateSettings.backoff_limit + max_pod_disruptions)")
        failure = failure or FailureClass.UNKNOWN.value
        if too_few and not (failed_cond or cancel or fatal):
            left = sum(1 for n in nodes if n.state not in ("failed", LOST))
            if store_lost:
                parts.append("node 0 was lost, and it hosts the rendezvous store every node meets at: no spare can "
                             "take its place")
            if not job_can_train(train_nodes, nodes):
                parts.append(f"too few nodes left to train: {left} of the {train_nodes} needed "
                             f"({completions - train_nodes} spare(s) launched, {len(lost)} node(s) lost)")
        telling = [n for n in failed + replaced if n.failure_class == failure]
        parts += [n.message for n in telling[:3]]
        if cancel and failure == cancel["failure_class"]:
            parts.insert(0, cancel["message"])
        if failed_cond:
            parts.append(f"job condition {failed_cond.get('reason')}: {failed_cond.get('message', '')}")
        return JobStatus("failed", failure, exit_codes, f"{failure}: " + "; ".join(p for p in parts if p), nodes)
    if (job.get("spec") or {}).get("suspend"):
        # Created suspended and not yet resumed: submit has not finished (a retry resumes it).
        return JobStatus("pending", None, exit_codes,
                         f"job {name} is suspended until its Service and NetworkPolicy exist and submit resumes it "
                         "(a submit that did not finish: retry the launch task)", nodes)
    if lost:
        # Covered: a spare takes each lost node's place at the next in-job restart.
        left = sum(1 for n in nodes if n.state not in ("failed", LOST))
        covered = {n.index for n in lost}
        nodes = [dataclasses.replace(n, message=f"{n.message}; a spare covers it ({left} node(s) left for the "
                                                f"{train_nodes} that train)") if n.index in covered else n
                 for n in nodes]
    running = [n for n in nodes if n.state == "running"]
    if running and len(running) == len(nodes):
        return JobStatus("running", None, exit_codes,
                         f"{len(running)} node(s) running on {[n.node_id for n in running]}", nodes)
    if running:
        waiting = [n.message for n in nodes if n.state != "running"]
        return JobStatus("running", None, exit_codes,
                         f"{len(running)} of {len(nodes)} node(s) running; " + "; ".join(waiting[:3]), nodes)
    return JobStatus("pending", None, exit_codes,
                     "; ".join(n.message for n in nodes[:3]) or f"job {name}: waiting for pods", nodes)


def cancel_verdict(job: dict[str, Any]) -> dict[str, Any] | None:
    text = ((job.get("metadata") or {}).get("annotations") or {}).get(CANCEL_ANNOTATION)
    if not text:
        return None
    try:
        verdict = json.loads(text)
    except ValueError:
        return {"failure_class": FailureClass.UNKNOWN.value, "message": f"cancelled ({text[:200]})"}
    return verdict if isinstance(verdict, dict) else None


def job_finished(job: dict[str, Any]) -> bool:
    conds = {t for t, c in _conditions(job).items() if c.get("status") == "True"}
    return bool(conds & {"Complete", "Failed", "SuccessCriteriaMet", "FailureTarget"}) or cancel_verdict(job) is not None


def run_config_of(job: dict[str, Any]) -> RunConfig | None:
    """The run config a Job was submitted with (it travels in its pods' env)."""
    containers = (((job.get("spec") or {}).get("template") or {}).get("spec") or {}).get("containers") or []
    for container in containers:
        for env in container.get("env") or []:
            if env.get("name") == CONFIG_ENV and env.get("value"):
                return RunConfig.from_json(env["value"])
    return None


def node_problems(node: dict[str, Any]) -> list[str]:
    """Why a node cannot take a training pod now (empty: healthy)."""
    problems = []
    conds = _conditions(node)
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
    return QUARANTINE_ANNOTATION in annotations or \
        any(t.get("key") == QUARANTINE_TAINT for t in (node.get("spec") or {}).get("taints") or [])


def quarantine_record(node: dict[str, Any]) -> tuple[float | None, str]:
    """(since, reason) from the quarantine annotation ("<RFC 3339 time> <reason>"); since is None
    when the annotation is missing or has no time (the taint alone carries no time)."""
    note = ((node.get("metadata") or {}).get("annotations") or {}).get(QUARANTINE_ANNOTATION) or ""
    stamp, _, reason = note.partition(" ")
    if re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", stamp):
        return _ts(stamp), reason
    taint = next((t for t in (node.get("spec") or {}).get("taints") or [] if t.get("key") == QUARANTINE_TAINT), {})
    return None, note or taint.get("value", "")


def instance_id_of(node: dict[str, Any]) -> str | None:
    """The EC2 instance behind a node: ``spec.providerID`` is ``aws:///<zone>/<instance id>``."""
    match = _INSTANCE_ID.search((node.get("spec") or {}).get("providerID") or "")
    return match.group(1) if match else None


# --------------------------------------------------------------------------------------------
# The backend
# --------------------------------------------------------------------------------------------


class EksBackend(TrainingBackend):
    """Training jobs on an EKS cluster's GPU node pool. See the module docstring."""

    name = "eks"

    def __init__(self, *, image: str = "", namespace: str = "fsdp-training",
                 kubernetes_conn_id: str | None = "kubernetes_default", cluster_name: str | None = None,
                 aws_conn_id: str | None = "aws_default", region_name: str | None = None,
                 replacement: str = "asg", max_unhealthy_share: float = DEFAULT_MAX_UNHEALTHY_SHARE,
                 pool_selector: dict[str, str] | None = None, evaluation_poll_s: float = 10.0,
                 pod: dict[str, Any] | None = None, image_allowlist: list[str] | None = None):
        if replacement not in REPLACEMENT_MODES:
            raise BackendError(f"replacement={replacement!r}: use one of {REPLACEMENT_MODES} (asg: a managed node "
                               "group or Auto Scaling group; karpenter: delete the node's NodeClaim; cordon: "
                               "take the node out of service and let a human replace it)")
        if not 0 < max_unhealthy_share <= 1:
            raise BackendError(f"max_unhealthy_share={max_unhealthy_share} must be in (0, 1]")
        if {"image", "namespace"} & set(pod or {}):
            raise BackendError("give image and namespace as the backend's own settings, not in pod")
        try:
            self.settings = PodTemplateSettings.from_dict({"image": image, "namespace": namespace, **(pod or {})},
                                                          validate=False)
        except (TypeError, ValueError) as e:
            raise BackendError(f"EKS pod settings: {e}") from None
        try:
            #: Registry/repository prefixes the image must be under (None: the image's own repository).
            self.image_allowlist = [check_image_prefix(p) for p in image_allowlist] \
                if image_allowlist is not None else None
        except ValueError as e:
            raise BackendError(f"{e}; fix FSDP_EKS_IMAGE_ALLOWLIST") from None
        self.image = image
        self.namespace = namespace
        self.kubernetes_conn_id = kubernetes_conn_id
        self.cluster_name = cluster_name
        self.aws_conn_id = aws_conn_id
        self.region_name = region_name
        self.replacement = replacement
        self.max_unhealthy_share = float(max_unhealthy_share)
        self.evaluation_poll_s = float(evaluation_poll_s)
        self.pod = dict(pod or {})
        #: The GPU node pool: the nodes training pods may land on (default: the pods' nodeSelector,
        #: instance type included).
        self.pool_selector = dict(pool_selector if pool_selector is not None else self.settings.pod_node_selector())

    def to_config(self) -> dict[str, Any]:
        return {"name": self.name, "image": self.image, "namespace": self.namespace,
                "kubernetes_conn_id": self.kubernetes_conn_id, "cluster_name": self.cluster_name,
                "aws_conn_id": self.aws_conn_id, "region_name": self.region_name, "replacement": self.replacement,
                "max_unhealthy_share": self.max_unhealthy_share, "pool_selector": self.pool_selector,
                "evaluation_poll_s": self.evaluation_poll_s, "pod": self.pod,
                "image_allowlist": self.image_allowlist}

    # -- clients ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _kubeconfig(self) -> Iterator[str | None]:
        """A kubeconfig for ``cluster_name`` (built by EksHook, removed afterwards), else None:
        the Kubernetes connection says how to reach the cluster."""
        if not self.cluster_name:
            yield None
            return
        from airflow.providers.amazon.aws.hooks.eks import EksHook

        hook = EksHook(aws_conn_id=self.aws_conn_id, region_name=self.region_name)
        with hook.generate_config_file_with_credentials(eks_cluster_name=self.cluster_name,
                                                        pod_namespace=self.namespace) as (config_file, _):
            yield config_file

    @contextlib.contextmanager
    def _kube(self) -> Iterator["_Kube"]:
        """A ``_Kube`` on a fresh client. An API or connection error that escapes the block becomes
        a BackendError (``kube_error``); _Kube's own calls already name what they were doing."""
        import urllib3
        from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook
        from kubernetes.client import ApiException

        with self._kubeconfig() as config_file:
            if config_file:
                hook = KubernetesHook(conn_id=None, kubernetes_conn_id=None, config_file=config_file)
            else:
                hook = KubernetesHook(conn_id=self.kubernetes_conn_id)
            try:
                yield _Kube(hook.get_conn(), self.namespace)
            except (ApiException, urllib3.exceptions.HTTPError) as e:
                raise kube_error(e, "call the Kubernetes API", self.namespace) from e

    def _autoscaling(self):
        from airflow.providers.amazon.aws.hooks.base_aws import AwsBaseHook

        return AwsBaseHook(aws_conn_id=self.aws_conn_id, region_name=self.region_name, client_type="autoscaling").conn

    # -- jobs ---------------------------------------------------------------------------------
    def submit(self, cfg: RunConfig, launch_id: str, *, airflow_run_id: str | None = None) -> JobHandle:
        if not isinstance(launch_id, str) or not launch_id.strip() or len(launch_id) > 200:
            raise ValueError(f"launch_id={launch_id!r} must be a non-empty string of at most 200 characters")
        job = self.check_launch(cfg, launch_id, airflow_run_id=airflow_run_id)
        job_name = job["metadata"]["name"]
        with self._kube() as kube:
            existing = kube.get_job(job_name)
            if existing is None:
                self._check_no_other_launch(kube, cfg.run_id, job_name)
                if self.replacement != "karpenter":  # Karpenter provisions nodes for pending pods
                    capacity = self._capacity(kube)
                    if capacity.healthy < cfg.nodes:
                        raise InsufficientCapacityError(
                            f"run {cfg.run_id} needs {cfg.nodes} healthy node(s) in the pool {self.pool_selector}; "
                            f"{capacity.healthy} of {capacity.total} are (out of service: {capacity.quarantined}). "
                            "Wait for replacements to join, or scale the node group up")
                self._check_references(kube)
                existing = kube.create_job(job)  # suspended: no pod starts yet
            elif (existing["metadata"].get("labels") or {}).get(LABEL_RUN) != cfg.run_id:
                raise JobConflictError(f"job {job_name} exists but belongs to run "
                                       f"{(existing['metadata'].get('labels') or {}).get(LABEL_RUN)!r}, not {cfg.run_id!r}")
            # A retry finishes what a failed try left: each step is a no-op once done.
            try:
                kube.ensure_service(rendezvous_service(cfg, launch_id, self.settings, owner=existing,
                                                       airflow_run_id=airflow_run_id))
                kube.ensure_network_policy(rendezvous_network_policy(cfg, launch_id, self.settings, owner=existing,
                                                                     airflow_run_id=airflow_run_id))
                existing = kube.resume_job(existing)
            except BackendError as e:
                raise BackendError(f"{e}. Job {job_name} stays suspended (no pod runs without its Service); once "
                                   "this is fixed, retrying the launch task finishes the launch") from e
        return self._handle(cfg, launch_id, existing)

    def check_launch(self, cfg: RunConfig, launch_id: str = "0", *,
                     airflow_run_id: str | None = None) -> dict[str, Any]:
        """The launch's Job, or BackendError for what would make submit refuse it before calling
        the cluster: no image, an image outside the allowlist, pod settings or a run config the Job
        cannot be built for (paths outside the FSx mount, more processes than GPUs per pod).
        validate_config calls it too, so bad input fails before anything starts."""
        if not self.image:
            raise BackendError("the EKS backend needs a training image: set the DAG's `image` param or "
                               "FSDP_EKS_IMAGE (see images/training/Dockerfile)")
        self.check_image(self.image)
        try:
            return training_job(cfg, launch_id, self.settings, airflow_run_id=airflow_run_id)
        except ValueError as e:
            raise BackendError(f"cannot launch run {cfg.run_id} on EKS: {e}") from e

    def check_image(self, image: str) -> None:
        """Refuse an image outside the allowlist (BackendError): whoever can trigger the DAG must
        not bring an arbitrary image to the shared FSx."""
        allowlist = self.image_allowlist
        if allowlist is None:
            try:
                allowlist = [image_repository(self.image)]
            except ValueError as e:
                raise BackendError(f"the EKS backend's image: {e}") from None
        if not image_allowed(image, allowlist):
            allowed = ", ".join(allowlist) or "nothing (FSDP_EKS_IMAGE_ALLOWLIST and FSDP_EKS_IMAGE are unset)"
            raise BackendError(f"image {image!r} is not allowed: images must come from {allowed} (whole path "
                               "components; a valid reference with :tag and/or @sha256:digest). It is not under the "
                               "image allowlist: use an image from there, or have an administrator add its "
                               "registry/repository to FSDP_EKS_IMAGE_ALLOWLIST (comma-separated prefixes) in "
                               "Airflow's environment")

    def _check_references(self, kube: "_Kube") -> None:
        """The objects the pods name must exist, or the Job controller retries pod creation forever
        (a missing ServiceAccount: FailedCreate events) or the pods stay Pending (a missing claim),
        and the launch only fails at its stall timeout. Checked before the Job is created, so the
        error comes at once and says what to apply. (A ``priority_class`` is the user's own
        setting and not checked: that would need a cluster-wide grant.)"""
        s = self.settings
        missing = []
        if kube.get_service_account(s.service_account) is None:
            missing.append(f"ServiceAccount {s.service_account}")
        if kube.get_claim(s.fsx_claim) is None:
            missing.append(f"PersistentVolumeClaim {s.fsx_claim} (the FSx for Lustre volume)")
        if missing:
            raise BackendError(f"the training pods need {', '.join(missing)} in namespace {self.namespace}, which "
                               "the cluster lacks: apply the deploy kit (kubectl apply -k deploy/overlays/<yours>, "
                               "docs/deploy-on-eks.md), or set FSDP_EKS_POD's service_account / fsx_claim / "
                               "priority_class to objects that exist")

    def _check_no_other_launch(self, kube: "_Kube", run_id: str, job_name: str) -> None:
        for other in kube.list_jobs(f"{LABEL_RUN}={run_id},{LABEL_COMPONENT}={COMPONENT_TRAINING}"):
            if other["metadata"]["name"] != job_name and not job_finished(other):
                raise JobConflictError(
                    f"run {run_id} already has job {other['metadata']['name']} active; two launches would share one "
                    "run dir. Wait for it to end, or cancel it, before submitting another launch")

    def _handle(self, cfg: RunConfig, launch_id: str, job: dict[str, Any]) -> JobHandle:
        created = _ts(job["metadata"].get("creationTimestamp")) or time.time()
        return JobHandle(self.name, cfg.run_id, launch_id, job["metadata"]["name"],
                         {"namespace": self.namespace, "cluster_name": self.cluster_name, "run_dir": cfg.run_dir,
                          "submitted_at": created})

    def _job(self, kube: "_Kube", handle: JobHandle) -> dict[str, Any]:
        self._check_handle(handle)
        job = kube.get_job(handle.job_name)
        if job is None:
            raise JobNotFoundError(f"no job {handle.job_name} in namespace {self.namespace}"
                                   + (f" of cluster {self.cluster_name}" if self.cluster_name else "")
                                   + "; deleted, or another cluster/namespace?")
        return job

    def status(self, handle: JobHandle) -> JobStatus:
        with self._kube() as kube:
            job = self._job(kube, handle)
            return job_status(job, kube.list_pods(f"{LABEL_JOB}={handle.job_name}"),
                              provisions_on_demand=self.replacement == "karpenter")

    async def status_async(self, handle: JobHandle) -> JobStatus:
        """``status`` through ``AsyncKubernetesHook``: what the triggerer calls between sleeps."""
        import asyncio

        import yaml
        from airflow.providers.cncf.kubernetes.hooks.kubernetes import AsyncKubernetesHook
        from kubernetes_asyncio import client as async_client

        self._check_handle(handle)
        with contextlib.ExitStack() as stack:
            if self.cluster_name:  # EksHook is synchronous (boto3): build the kubeconfig off the loop
                cm = self._kubeconfig()
                config_file = await asyncio.to_thread(cm.__enter__)
                stack.push(cm.__exit__)
                # The async hook reads a kubeconfig from its connection or a dict, not from a path.
                config = yaml.safe_load(Path(config_file).read_text())
                hook = AsyncKubernetesHook(conn_id=None, kubernetes_conn_id=None, config_dict=config)
            else:
                hook = AsyncKubernetesHook(conn_id=self.kubernetes_conn_id)
            import aiohttp

            doing = f"read job {handle.job_name}"
            try:
                async with hook.get_conn() as api:
                    batch, core = async_client.BatchV1Api(api), async_client.CoreV1Api(api)
                    try:
                        job = api.sanitize_for_serialization(
                            await batch.read_namespaced_job(handle.job_name, self.namespace))
                    except async_client.ApiException as e:
                        if e.status == 404:
                            raise JobNotFoundError(f"no job {handle.job_name} in namespace {self.namespace}") from None
                        raise
                    doing = f"list the pods of job {handle.job_name}"
                    pods = api.sanitize_for_serialization(await core.list_namespaced_pod(
                        self.namespace, label_selector=f"{LABEL_JOB}={handle.job_name}"))["items"]
            except (async_client.ApiException, aiohttp.ClientError, OSError) as e:
                raise kube_error(e, doing, self.namespace) from e
        return job_status(job, pods, provisions_on_demand=self.replacement == "karpenter")

    def logs(self, handle: JobHandle, node: int | None = None, tail: int = 200) -> str:
        with self._kube() as kube:
            job = self._job(kube, handle)
            pods = _newest_pods(kube.list_pods(f"{LABEL_JOB}={handle.job_name}"))
            completions = int(job["spec"].get("completions") or 1)
            indexes = [node] if node is not None else list(range(completions))
            if node is not None and not 0 <= node < completions:
                raise BackendError(f"job {handle.job_name} has nodes 0..{completions - 1}, not {node}")
            out = []
            for i in indexes:
                pod = pods.get(i)
                text = kube.pod_log(pod["metadata"]["name"], tail) if pod else "(no pod: deleted or never created)"
                if node is not None:
                    return text
                where = f"{pod['metadata']['name']} on {pod['spec'].get('nodeName')}" if pod else "no pod"
                out.append(f"==> node {i} ({where}) <==\n{text}")
            return "\n".join(out)

    def cancel(self, handle: JobHandle) -> None:
        """Stop a running launch, keeping the Job and its finished pods as evidence: the Job is
        suspended (the job controller terminates its pods) and annotated with the verdict — the
        launch's failure if its status already says failed (too few nodes left behind its spares),
        no progress if no checkpoint was committed for ``stall_timeout_s``, else unknown — and the
        nodes it ran on. A finished job is left as it is, so ``diagnose`` still says why it failed."""
        with self._kube() as kube:
            job = self._job(kube, handle)
            if job_finished(job):
                return
            status = job_status(job, kube.list_pods(f"{LABEL_JOB}={handle.job_name}"),
                                provisions_on_demand=self.replacement == "karpenter")
            cfg = run_config_of(job)
            run_dir = cfg.run_dir if cfg else handle.extra.get("run_dir", "")
            stall = cfg.stall_timeout_s if cfg else float("inf")
            if status.state == "failed":
                # Failed while its Job still runs (too few nodes left behind the spares): the
                # verdict is that failure, kept for diagnose once the suspended Job's pods are gone.
                verdict = {"at": time.time(), "failure_class": status.failure_class, "message": status.message}
            else:
                verdict = verdict_at_cancel(run_dir, _ts(job["metadata"].get("creationTimestamp")), stall,
                                            status.state)
            verdict["nodes"] = {str(n.index): n.node_id for n in status.nodes if n.node_id}
            kube.patch_job(handle.job_name, {"metadata": {"annotations": {CANCEL_ANNOTATION: json.dumps(verdict)}},
                                             "spec": {"suspend": True}})

    def add_spare(self, handle: JobHandle, reason: str) -> NodeStatus:
        """Check that the pool of a running job is whole again after a spare took a lost node's
        place, and return the new spare's status. Nothing is created: the Job controller recreates
        a lost pod for its completion index (the podFailurePolicy counts the disruption and does
        not fail the Job; podReplacementPolicy Failed: once the old pod is terminal), and the new
        pod's launcher parks in the rendezvous as a spare. So the backend needs no grant to create
        pods. Returns the replacement pod of the most recently lost index (pending or running).

        A lost pod still Terminating on its unreachable node is replaced once the node object is
        deleted (PodGC then fails the pod): when replace_nodes took that node out of service and
        has its instance replaced (replacement=asg or karpenter), that is under way, and the
        index's status comes back pending. Under replacement=cordon, or before replace_nodes ran,
        BackendError says what to do.

        Raises InsufficientCapacityError when the replacement pod cannot be scheduled (no healthy
        node left in the pool), BackendError when the job is not running or lost no node, each
        saying what to do."""
        reason = (reason or "").strip() or "spare pool refill"
        with self._kube() as kube:
            job = self._job(kube, handle)
            pods = kube.list_pods(f"{LABEL_JOB}={handle.job_name}")
            status = job_status(job, pods, provisions_on_demand=self.replacement == "karpenter")
            kube_nodes = {n.node_id: kube.get_node(n.node_id) for n in status.nodes
                          if n.state == LOST and n.node_id}
        if status.state != "running":
            raise BackendError(f"cannot add a spare to job {handle.job_name}: it is {status.state} ({status.message})")
        newest = _newest_pods(pods)
        replaced = set(lost_before(pods, newest)) | set(recreated_indexes(job, newest))
        waiting = [n for n in status.nodes if n.state == LOST and n.index not in replaced]
        if waiting:
            return self._spare_to_come(kube_nodes, handle, job, waiting[0], reason)
        if not replaced:
            raise BackendError(f"job {handle.job_name} lost no node: its {len(status.nodes)} pod(s) are the ones it "
                               "launched, so the spare pool is whole; nothing to add")
        index = max(replaced, key=lambda i: (_age_key(newest[i]), i))
        node, pod = status.nodes[index], newest[index]
        if node.state == LOST:  # the replacement cannot be scheduled (job_status says why)
            raise InsufficientCapacityError(
                f"the replacement pod {pod['metadata']['name']} of job {handle.job_name}'s lost node {index} has no "
                f"node to run on: {node.message}. Wait for replace_nodes' new node to join (capacity()), or scale the "
                f"node group {self.pool_selector} up; the Job starts it there as the new spare")
        if node.state not in ("pending", "running"):
            raise BackendError(f"the replacement pod {pod['metadata']['name']} of job {handle.job_name}'s lost node "
                               f"{index} is {node.state}: {node.message}")
        return dataclasses.replace(node, message=f"{reason}: {node.message}")

    def _spare_to_come(self, kube_nodes: dict[str, dict[str, Any] | None], handle: JobHandle, job: dict[str, Any],
                       lost: NodeStatus, reason: str) -> NodeStatus:
        """add_spare for an index whose lost pod the Job has not replaced yet (see add_spare)."""
        node = kube_nodes.get(lost.node_id) if lost.node_id else None
        where = f"job {handle.job_name} lost node {lost.index} ({lost.message})"
        if lost.node_id and node is not None and not quarantined_by_us(node):
            raise BackendError(f"{where}, and its node {lost.node_id} is still in service: take it out with "
                               "replace_nodes first (its pod is replaced once the node object is deleted)")
        if self.replacement == "cordon" and node is not None:
            raise BackendError(f"{where}. Under replacement=cordon nothing deletes node {lost.node_id}, so the Job "
                               f"controller keeps waiting for the pod to end: once the machine is dealt with, run "
                               f"`kubectl delete node {lost.node_id}` (PodGC then fails the pod and the Job recreates "
                               "it as the new spare)")
        if node is None and lost.node_id is None:
            budget = (job.get("spec") or {}).get("backoffLimit")
            raise BackendError(f"{where}, and the Job controller has not recreated its pod: see `kubectl -n "
                               f"{self.namespace} describe job {handle.job_name}` (its backoffLimit={budget} counts "
                               "PodTemplateSettings.backoff_limit + max_pod_disruptions)")
        how = ("its node object is gone, so PodGC fails the pod" if node is None else
               f"{lost.node_id} is out of service and its instance is being replaced ({self.replacement}); once "
               "the node object is deleted, PodGC fails the pod")
        return NodeStatus(lost.index, None, "pending", None, None,
                          f"{reason}: {how} and the Job controller recreates node {lost.index}'s pod on a healthy "
                          "node, where its launcher parks as the new spare")

    def diagnose(self, handle: JobHandle) -> Diagnosis:
        with self._kube() as kube:
            job = self._job(kube, handle)
            pods = kube.list_pods(f"{LABEL_JOB}={handle.job_name}")
            status = job_status(job, pods, provisions_on_demand=self.replacement == "karpenter")
            failure = status.failure_class
            if status.state != "failed":
                return Diagnosis(failure, [], False, [f"job {handle.job_name} is {status.state}: nothing to diagnose"])
            evidence = [f"status: {status.message}"]
            if failure not in REPLACEABLE_FAILURES:  # a user, storage or data fault; unknown: don't guess
                return Diagnosis(failure, [], False, evidence + [f"{failure}: {what_to_do(failure)}"])
            job_nodes = sorted({n.node_id for n in status.nodes if n.node_id}
                               | {(p.get("spec") or {}).get("nodeName") for p in pods} - {None})
            bad: list[str] = []
            for name in job_nodes:  # what the node itself says (kubelet, EKS node monitoring agent)
                node = kube.get_node(name)
                problems = ["the node is gone"] if node is None else node_problems(node)
                if problems:
                    bad.append(name)
                    evidence.append(f"node {name}: {'; '.join(problems)}")
            # Every pod the job had, replaced ones included: a node that lost a pod is suspect.
            every_pod = status.nodes + [node_from_pod(pod_index(p), p, None) for p in pods if pod_index(p) is not None]
            for n in every_pod:
                if n.state == LOST and n.node_id and n.node_id not in bad:
                    bad.append(n.node_id)
                    evidence.append(f"node {n.index} ({n.node_id}): {n.message}")
            if bad:
                return Diagnosis(failure, sorted(bad), True, evidence)
        cfg = run_config_of(job)
        run_dir = cfg.run_dir if cfg else handle.extra.get("run_dir")
        if run_dir and Path(run_dir).is_dir():  # FSx mounted in this worker
            blamed, why = blame_from_events(run_dir, handle.launch_id, status, job_nodes)
            return Diagnosis(failure, blamed, bool(blamed), evidence + why)
        reporting = sorted({n.node_id for n in status.nodes if n.failure_class == failure and n.node_id})
        if reporting:
            return Diagnosis(failure, reporting, True, evidence + [
                f"run dir {run_dir} is not mounted here (no events to read); blaming the node(s) whose pod reported "
                f"{failure}: {reporting}"])
        return Diagnosis(failure, job_nodes, bool(job_nodes), evidence + [
            f"run dir {run_dir} is not mounted here and no pod names a node; every node of the job is suspect: "
            f"{job_nodes}"])

    # -- nodes --------------------------------------------------------------------------------
    def _pool(self, kube: "_Kube") -> list[dict[str, Any]]:
        selector = ",".join(f"{k}={v}" for k, v in sorted(self.pool_selector.items()))
        return kube.list_nodes(selector)

    def _devices_needed(self) -> dict[str, int]:
        """The devices each training pod requests (its real request): a node whose device plugin
        has not registered them yet (allocatable 0) cannot take one, so it is not healthy capacity.
        gpus_per_node=None (one per process: unknown until a run) needs at least one GPU."""
        gpus = self.settings.gpus_per_node
        return {GPU_RESOURCE: 1 if gpus is None else int(gpus), EFA_RESOURCE: int(self.settings.efa_per_node or 0)}

    def _healthy(self, node: dict[str, Any]) -> bool:
        if out_of_service(node) or node_problems(node):
            return False
        allocatable = (node.get("status") or {}).get("allocatable") or {}
        for resource, need in self._devices_needed().items():
            try:
                have = int(str(allocatable.get(resource, "0")) or 0)
            except ValueError:
                have = 0
            if have < need:
                return False
        return True

    def _capacity(self, kube: "_Kube") -> Capacity:
        pool = self._pool(kube)
        healthy = sorted(n["metadata"]["name"] for n in pool if self._healthy(n))
        quarantined = sorted(n["metadata"]["name"] for n in pool if out_of_service(n))
        return Capacity(total=len(pool), healthy=len(healthy), quarantined=quarantined, healthy_node_ids=healthy,
                        provisions_on_demand=self.replacement == "karpenter")

    def capacity(self) -> Capacity:
        with self._kube() as kube:
            return self._capacity(kube)

    def replace_nodes(self, node_ids: list[str], reason: str) -> Replacement:
        """Cordon and taint each node, evict the pods of ours left on it, then have the platform
        replace it: terminate its instance in its Auto Scaling group (the group launches a new one;
        desired capacity unchanged), or delete its Karpenter NodeClaim, or (``cordon``) leave the
        replacement to a human. Refuses more than ``max_unhealthy_share`` of the pool at once.

        A hot spare parked on the node goes too, before the node could be promoted at the next
        in-job restart: its pod is evicted (the Eviction API deletes it with a DisruptionTarget
        condition, through the grant the worker already has), the Job recreates it for the same
        index, and the cordon and quarantine taint keep the new pod off this node."""
        with self._kube() as kube:
            pool = {n["metadata"]["name"]: n for n in self._pool(kube)}
            out = [name for name, n in pool.items() if out_of_service(n)]
            replace, refused, note = plan_replacement(list(node_ids), sorted(pool), out, self.max_unhealthy_share)
            done, notes = [], [note] if note else []
            for name in replace:
                node = pool[name]
                kube.quarantine_node(node, reason)
                evicted = kube.evict_pods_on(name, ",".join(f"{k}={v}" for k, v in MANAGED_BY.items()))
                try:
                    how = self._replace_instance(kube, node)
                except BackendError as e:
                    refused.append(name)
                    notes.append(f"{name}: cordoned and tainted, but not replaced: {e}")
                    continue
                done.append(name)
                notes.append(f"{name}: cordoned, tainted {QUARANTINE_TAINT}, evicted {evicted}; {how}")
        return Replacement(done, refused, "; ".join(notes) or "nothing to replace")

    def quarantined_nodes(self) -> list[dict[str, Any]]:
        """The pool's nodes this project quarantined that still exist. Under replacement=asg or
        karpenter such a node is usually on its way out (``ready`` False once its instance
        stops); under cordon it waits for a person."""
        with self._kube() as kube:
            pool = self._pool(kube)
        out = []
        for node in pool:
            if not quarantined_by_us(node):
                continue
            since, reason = quarantine_record(node)
            out.append({"node_id": node["metadata"]["name"], "reason": reason, "since": since,
                        "ready": not node_problems(node), "instance_id": instance_id_of(node)})
        return sorted(out, key=lambda q: (q["since"] is None, q["since"] or 0, q["node_id"]))

    def return_nodes(self, node_ids: list[str], reason: str, *, by: str | None = None,
                     quarantined_before: float | None = None) -> ServiceReturn:
        """Uncordon each node this project quarantined, remove its quarantine taint and reason
        annotation, and record the return in RETURN_ANNOTATION. Other taints stay. A node that
        no longer exists (its Auto Scaling group or Karpenter replaced it) is reported as gone;
        a node not quarantined by this project is left as it is."""
        reason = require_reason(reason)
        by = by or current_operator()
        returned, not_quarantined, gone = [], [], []
        with self._kube() as kube:
            for name in dict.fromkeys(node_ids):
                outcome = kube.return_node(name, reason, by, quarantined_before)
                {"returned": returned, "not_quarantined": not_quarantined, "gone": gone}[outcome].append(name)
        return ServiceReturn(returned, not_quarantined, gone)

    def _replace_instance(self, kube: "_Kube", node: dict[str, Any]) -> str:
        name = node["metadata"]["name"]
        if self.replacement == "cordon":
            return "left for a human to replace (replacement=cordon)"
        if self.replacement == "karpenter":
            claims = [c for c in kube.list_nodeclaims() if (c.get("status") or {}).get("nodeName") == name]
            if not claims:
                raise BackendError(f"no Karpenter NodeClaim has status.nodeName={name}; is the node Karpenter's?")
            for claim in claims:
                kube.delete_nodeclaim(claim["metadata"]["name"])
            return f"deleted NodeClaim(s) {[c['metadata']['name'] for c in claims]}: Karpenter drains and replaces it"
        instance = instance_id_of(node)
        if not instance:
            raise BackendError(f"node {name} has no EC2 instance in spec.providerID "
                               f"({(node.get('spec') or {}).get('providerID')!r})")
        asg = self._autoscaling()
        found = asg.describe_auto_scaling_instances(InstanceIds=[instance])["AutoScalingInstances"]
        if not found:
            raise BackendError(f"instance {instance} of node {name} is in no Auto Scaling group; replace it by hand "
                               "or use replacement=karpenter/cordon")
        group = found[0]["AutoScalingGroupName"]
        tags = asg.describe_auto_scaling_groups(AutoScalingGroupNames=[group])["AutoScalingGroups"][0].get("Tags", [])
        if not any(t["Key"] == MANAGED_ASG_TAG and t["Value"] == "true" for t in tags):
            raise BackendError(f"Auto Scaling group {group} lacks the tag {MANAGED_ASG_TAG}=true, so this project "
                               "may not terminate its instances; tag it (see deploy/) or replace the node by hand")
        asg.terminate_instance_in_auto_scaling_group(InstanceId=instance, ShouldDecrementDesiredCapacity=False)
        return f"terminated {instance} in Auto Scaling group {group} (desired capacity kept: a new node replaces it)"

    # -- evaluation ---------------------------------------------------------------------------
    def run_evaluation(self, cfg: RunConfig, checkpoint_id: str | None = None,
                       timeout_s: float = 3600.0) -> dict[str, Any]:
        """Evaluate ``checkpoint_id`` (None: the newest committed one) in a one-pod Job and return
        its result (``<run_dir>/eval.json``, read from the FSx mount). One Job per checkpoint, so a
        retried task waits for the same Job rather than starting another."""
        from fsdp_resilience.training.contract import CheckpointCatalog

        if checkpoint_id is None:
            latest = CheckpointCatalog(cfg.run_dir).latest()
            if latest is None:
                raise BackendError(f"run {cfg.run_id} has no committed checkpoint under {cfg.run_dir} to evaluate")
            checkpoint_id = latest.checkpoint_id
        self.check_image(self.image)
        try:
            job = evaluation_job(cfg, self.settings, checkpoint_id=checkpoint_id)
        except ValueError as e:
            raise BackendError(f"cannot evaluate run {cfg.run_id} on EKS: {e}") from e
        name = job["metadata"]["name"]
        deadline = time.time() + timeout_s
        with self._kube() as kube:
            if kube.get_job(name) is None:
                kube.create_job(job)
            while True:
                current = kube.get_job(name) or {}
                conds = {t for t, c in _conditions(current).items() if c.get("status") == "True"}
                if conds & {"Complete", "SuccessCriteriaMet"}:
                    break
                if conds & {"Failed", "FailureTarget"}:
                    pods = kube.list_pods(f"{LABEL_JOB}={name}")  # our label: on every pod of the Job
                    tail = kube.pod_log(pods[-1]["metadata"]["name"], 50) if pods else "(no pod)"
                    raise BackendError(f"evaluation job {name} failed; its log ends:\n{tail}")
                if time.time() > deadline:
                    raise BackendError(f"evaluation job {name} did not finish within {timeout_s:.0f}s; "
                                       f"see `kubectl -n {self.namespace} describe job {name}`")
                time.sleep(self.evaluation_poll_s)
        result = Path(cfg.run_dir, "eval.json")
        try:
            return json.loads(result.read_text())
        except (OSError, ValueError) as e:
            raise BackendError(f"evaluation job {name} succeeded but {result} is unreadable here ({e}); is FSx "
                               "mounted in the Airflow workers at the same path as in the pods?") from e


class _Kube:
    """The few API calls the backend makes, on one ``ApiClient``, returning the API's JSON.

    Every verb used here must be granted by the deploy kit's RBAC (deploy/); a test checks the two
    agree, by recording what this class does against a fake apiserver. Every call goes through
    ``_call``, so an API or connection error becomes a BackendError naming what was being done.
    """

    #: Tries of a patch that meets a 409 (someone else changed the object since it was read).
    PATCH_TRIES = 5

    def __init__(self, api_client, namespace: str):
        from kubernetes import client

        self.api = api_client
        self.namespace = namespace
        self.core = client.CoreV1Api(api_client)
        self.batch = client.BatchV1Api(api_client)
        self.networking = client.NetworkingV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self._json = api_client.sanitize_for_serialization
        self.ApiException = client.ApiException

    def _call(self, doing: str, call, *args, ok: tuple[int, ...] = (), **kwargs):
        """``call(*args, **kwargs)`` as JSON; an ApiException whose status is in ``ok`` is raised
        as is (the caller handles it), any other error becomes a BackendError."""
        import urllib3

        try:
            return self._json(call(*args, **kwargs))
        except self.ApiException as e:
            if e.status in ok:
                raise
            raise kube_error(e, doing, self.namespace) from e
        except (urllib3.exceptions.HTTPError, OSError) as e:
            raise kube_error(e, doing, self.namespace) from e

    def _or_none(self, doing: str, call, *args, **kwargs):
        try:
            return self._call(doing, call, *args, ok=(404,), **kwargs)
        except self.ApiException:
            return None

    def _create(self, doing: str, call, body: dict[str, Any], read) -> dict[str, Any]:
        """Create ``body``; if it exists already (a retried task, a concurrent try), the existing one."""
        try:
            return self._call(doing, call, self.namespace, body, ok=(409,))
        except self.ApiException:
            existing = read(body["metadata"]["name"])
            if existing is None:  # deleted between the two calls: say so rather than guess
                raise BackendError(f"cannot {doing}: it existed a moment ago and is gone now; retry the task") from None
            return existing

    # jobs: get, list, create, patch
    def get_job(self, name: str) -> dict[str, Any] | None:
        return self._or_none(f"read job {name}", self.batch.read_namespaced_job, name, self.namespace)

    def list_jobs(self, label_selector: str) -> list[dict[str, Any]]:
        return self._call(f"list jobs ({label_selector})", self.batch.list_namespaced_job, self.namespace,
                          label_selector=label_selector)["items"]

    def create_job(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._create(f"create job {body['metadata']['name']}", self.batch.create_namespaced_job, body,
                            self.get_job)

    def patch_job(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._call(f"patch job {name}", self.batch.patch_namespaced_job, name, self.namespace, body)

    def resume_job(self, job: dict[str, Any]) -> dict[str, Any]:
        """Resume a Job that submit created suspended, unless a cancel suspended it (its verdict
        annotation) or it already finished. The patch carries the resourceVersion read, so a cancel
        that lands in between wins (409: read again and decide again)."""
        name = job["metadata"]["name"]
        for _ in range(self.PATCH_TRIES):
            if not (job.get("spec") or {}).get("suspend") or job_finished(job):
                return job
            try:
                return self._call(f"resume job {name}", self.batch.patch_namespaced_job, name, self.namespace,
                                  {"metadata": {"resourceVersion": job["metadata"]["resourceVersion"]},
                                   "spec": {"suspend": False}}, ok=(409,))
            except self.ApiException:
                job = self.get_job(name)
                if job is None:
                    raise BackendError(f"job {name} was deleted while submit resumed it; retry the task") from None
        raise BackendError(f"job {name} kept changing while submit resumed it ({self.PATCH_TRIES} tries); retry "
                           "the task")

    # services: get, create
    def get_service(self, name: str) -> dict[str, Any] | None:
        return self._or_none(f"read service {name}", self.core.read_namespaced_service, name, self.namespace)

    def ensure_service(self, body: dict[str, Any]) -> dict[str, Any]:
        name = body["metadata"]["name"]
        return self.get_service(name) or self._create(f"create service {name}", self.core.create_namespaced_service,
                                                      body, self.get_service)

    # serviceaccounts, persistentvolumeclaims: get
    def get_service_account(self, name: str) -> dict[str, Any] | None:
        return self._or_none(f"read service account {name}", self.core.read_namespaced_service_account, name,
                             self.namespace)

    def get_claim(self, name: str) -> dict[str, Any] | None:
        return self._or_none(f"read persistent volume claim {name}",
                             self.core.read_namespaced_persistent_volume_claim, name, self.namespace)

    # networkpolicies.networking.k8s.io: get, create
    def get_network_policy(self, name: str) -> dict[str, Any] | None:
        return self._or_none(f"read network policy {name}", self.networking.read_namespaced_network_policy, name,
                             self.namespace)

    def ensure_network_policy(self, body: dict[str, Any]) -> dict[str, Any]:
        name = body["metadata"]["name"]
        return self.get_network_policy(name) or self._create(
            f"create network policy {name}", self.networking.create_namespaced_network_policy, body,
            self.get_network_policy)

    # pods: list; pods/log: get; pods/eviction: create
    def list_pods(self, label_selector: str, field_selector: str | None = None) -> list[dict[str, Any]]:
        kwargs = {"label_selector": label_selector}
        if field_selector:
            kwargs["field_selector"] = field_selector
        return self._call(f"list pods ({label_selector})", self.core.list_namespaced_pod, self.namespace,
                          **kwargs)["items"]

    def pod_log(self, name: str, tail: int) -> str:
        try:
            # Raw bytes: with content preloaded, this client version returns the repr of the bytes.
            return self.core.read_namespaced_pod_log(name, self.namespace, container=CONTAINER, tail_lines=tail,
                                                     _preload_content=False).data.decode(errors="replace")
        except self.ApiException as e:
            return f"(no log: {e.status} {e.reason})"

    def evict_pods_on(self, node_name: str, label_selector: str) -> list[str]:
        """Evict our pods still running on a node (finished ones stay: their status is evidence)."""
        from kubernetes import client

        evicted = []
        for pod in self.list_pods(label_selector, f"spec.nodeName={node_name}"):
            if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                continue
            name = pod["metadata"]["name"]
            body = client.V1Eviction(metadata=client.V1ObjectMeta(name=name, namespace=self.namespace))
            try:
                self._call(f"evict pod {name}", self.core.create_namespaced_pod_eviction, name, self.namespace, body,
                           ok=(404, 429))
            except self.ApiException as e:
                if e.status == 404:
                    continue
                # 429: a disruption budget forbids it now: the pod goes with the node when its
                # instance is terminated (or a human drains it under replacement=cordon).
                evicted.append(f"{name} (eviction blocked by a disruption budget)")
                continue
            evicted.append(name)
        return evicted

    # nodes: get, list, patch
    def get_node(self, name: str) -> dict[str, Any] | None:
        return self._or_none(f"read node {name}", self.core.read_node, name)

    def list_nodes(self, label_selector: str) -> list[dict[str, Any]]:
        return self._call(f"list nodes ({label_selector})", self.core.list_node, label_selector=label_selector)["items"]

    def quarantine_node(self, node: dict[str, Any], reason: str) -> dict[str, Any]:
        """Cordon and taint ``node`` (as read). The taint list is sent whole (a strategic merge
        replaces it), so the patch carries the resourceVersion it was computed from: if the node
        changed meanwhile (the node lifecycle controller or Karpenter added a taint), the apiserver
        answers 409 and the node is read again and the list recomputed, keeping their taints."""
        name = node["metadata"]["name"]
        value = re.sub(r"[^A-Za-z0-9_.-]+", "-", reason)[:63].strip("-_.") or "replaced"
        note = f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {reason}"
        for _ in range(self.PATCH_TRIES):
            taints = [t for t in (node.get("spec") or {}).get("taints") or [] if t.get("key") != QUARANTINE_TAINT]
            taints.append({"key": QUARANTINE_TAINT, "value": value, "effect": "NoSchedule"})
            try:
                return self._call(f"cordon and taint node {name}", self.core.patch_node, name, {
                    "metadata": {"resourceVersion": node["metadata"].get("resourceVersion"),
                                 "annotations": {QUARANTINE_ANNOTATION: note}},
                    "spec": {"unschedulable": True, "taints": taints}}, ok=(409,))
            except self.ApiException:
                node = self.get_node(name)
                if node is None:
                    raise BackendError(f"node {name} is gone (deleted while it was being cordoned)") from None
        raise BackendError(f"node {name} kept changing while it was being cordoned and tainted "
                           f"({self.PATCH_TRIES} tries got 409 Conflict); retry the task")

    def return_node(self, name: str, reason: str, by: str, quarantined_before: float | None = None) -> str:
        """Return node ``name`` to service if this project quarantined it (before
        ``quarantined_before``, when given): "returned", "not_quarantined" or "gone" (404). As in
        quarantine_node, the taint list goes whole with the resourceVersion it came from, and a
        409 means read again, so a taint another controller added meanwhile is kept."""
        node = self.get_node(name)
        for _ in range(self.PATCH_TRIES):
            if node is None:
                return "gone"
            since, _ = quarantine_record(node)
            if not quarantined_by_us(node) or (quarantined_before is not None and
                                               (since is None or since > quarantined_before)):
                return "not_quarantined"
            note = json.dumps({"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "by": by, "reason": reason,
                               "quarantine": (node["metadata"].get("annotations") or {}).get(QUARANTINE_ANNOTATION)})
            taints = [t for t in (node.get("spec") or {}).get("taints") or [] if t.get("key") != QUARANTINE_TAINT]
            try:
                self._call(f"return node {name} to service (uncordon, remove taint {QUARANTINE_TAINT})",
                           self.core.patch_node, name, {
                               "metadata": {"resourceVersion": node["metadata"].get("resourceVersion"),
                                            "annotations": {QUARANTINE_ANNOTATION: None, RETURN_ANNOTATION: note}},
                               "spec": {"unschedulable": None, "taints": taints}}, ok=(404, 409))
                return "returned"
            except self.ApiException as e:
                node = None if e.status == 404 else self.get_node(name)
        raise BackendError(f"node {name} kept changing while it was being returned to service "
                           f"({self.PATCH_TRIES} tries got 409 Conflict); run the return again")

    # karpenter.sh nodeclaims: list, delete
    def list_nodeclaims(self) -> list[dict[str, Any]]:
        return self._call("list Karpenter NodeClaims", self.custom.list_cluster_custom_object, "karpenter.sh", "v1",
                          "nodeclaims")["items"]

    def delete_nodeclaim(self, name: str) -> None:
        try:
            self._call(f"delete Karpenter NodeClaim {name}", self.custom.delete_cluster_custom_object, "karpenter.sh",
                       "v1", "nodeclaims", name, ok=(404,))
        except self.ApiException:
            pass  # gone already
