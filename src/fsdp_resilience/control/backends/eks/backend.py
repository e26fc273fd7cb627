"""The EKS backend: one launch = one Indexed Job (a pod per node) + one headless Service + one
NetworkPolicy, all named ``job_name_for(run_id, launch_id)`` (a DNS-1035 label).

    backend = get_backend("eks", image="123.dkr.ecr.../fsdp-training:0.1.0", cluster_name="prod",
                          namespace="fsdp-training", replacement="asg")
    handle = backend.submit(cfg, launch_id="0")

Kubernetes is reached through the cncf.kubernetes provider's hooks (client.py: a Kubernetes
connection, or with ``cluster_name`` a kubeconfig from the amazon provider's ``EksHook``; the
triggerer polls with ``AsyncKubernetesHook`` in ``status_async``). AWS (Auto Scaling) is reached
through ``AwsBaseHook``. The objects come from manifests.py and networking.py, the state from
status.py (the Job's conditions and its pods, read fresh on every call, so any process can pick up
a job another process submitted; a cancel verdict and the nodes a cancelled job ran on are kept in
the Job's annotations), the node pool's logic from nodes.py, the spare pool's from spares.py, the
checks before a launch from launch_checks.py, the blame from diagnosis.py, the evaluation run from
evaluation.py.

``submit`` is safe to retry and never leaves pods running without their Service: it creates the
Job suspended, then its Service and NetworkPolicy (both owned by the Job), then resumes it
(``spec.suspend: false``, sent with the resourceVersion it read). A retry finds the suspended
Job and finishes the steps; a Job a cancel suspended (CANCEL_ANNOTATION) is never resumed. The
image must be under the backend's allowlist (``image_allowlist``; the DAG checks it first, in
validate_config). Every API error becomes a BackendError saying what to do (``kube_error``).

How each failure class plays out (see also the Job's ``podFailurePolicy`` in manifests.py):
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
  launch_ended        exit 69 (a pod started after its launch ended) -> ignored: not counted, never the outcome
  unknown             other exit codes count against backoffLimit; then the Job fails, no replacement
"""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any

from fsdp_resilience.control.backends.base import (
    LOST,
    BackendError,
    Capacity,
    Diagnosis,
    JobConflictError,
    JobHandle,
    JobNotFoundError,
    JobStatus,
    NodeStatus,
    Replacement,
    ServiceReturn,
    TrainingBackend,
    current_operator,
    require_reason,
)
from fsdp_resilience.control.backends.eks.client import KubeClient, connect, eks_kubeconfig
from fsdp_resilience.control.backends.eks.completion import (
    cached_version,
    read_version,
    settle,
    status_as_read,
)
from fsdp_resilience.control.backends.eks.constants import CANCEL_ANNOTATION, LABEL_JOB, LABEL_RUN
from fsdp_resilience.control.backends.eks.diagnosis import diagnose_job
from fsdp_resilience.control.backends.eks.disruption import disruption_budget, ensure_budget
from fsdp_resilience.control.backends.eks.evaluation import read_evaluation_result, wait_for_evaluation_job
from fsdp_resilience.control.backends.eks.images import check_image_prefix, image_allowed, image_repository
from fsdp_resilience.control.backends.eks.launch_checks import check_capacity, check_no_other_launch, check_references
from fsdp_resilience.control.backends.eks.listing import read_launch_async
from fsdp_resilience.control.backends.eks.manifests import evaluation_job, training_job
from fsdp_resilience.control.backends.eks.networking import rendezvous_network_policy, rendezvous_service
from fsdp_resilience.control.backends.eks.nodes import (
    REPLACEMENT_MODES,
    devices_needed,
    pool_capacity,
    quarantine_report,
    replace_pool_nodes,
)
from fsdp_resilience.control.backends.eks.pod_settings import PodTemplateSettings
from fsdp_resilience.control.backends.eks.spares import spare_status
from fsdp_resilience.control.backends.eks.status import (
    job_finished,
    job_status,
    newest_pods,
    run_config_of,
    timestamp,
)
from fsdp_resilience.control.backends.evidence import verdict_at_cancel
from fsdp_resilience.control.backends.replacement import DEFAULT_MAX_UNHEALTHY_SHARE
from fsdp_resilience.training.contract import RunConfig


class EksBackend(TrainingBackend):
    """Training jobs on an EKS cluster's GPU node pool. See the module docstring."""

    name = "eks"

    def __init__(
        self,
        *,
        image: str = "",
        namespace: str = "fsdp-training",
        kubernetes_conn_id: str | None = "kubernetes_default",
        cluster_name: str | None = None,
        aws_conn_id: str | None = "aws_default",
        region_name: str | None = None,
        replacement: str = "asg",
        max_unhealthy_share: float = DEFAULT_MAX_UNHEALTHY_SHARE,
        pool_selector: dict[str, str] | None = None,
        evaluation_poll_s: float = 10.0,
        pod: dict[str, Any] | None = None,
        image_allowlist: list[str] | None = None,
    ):
        if replacement not in REPLACEMENT_MODES:
            raise BackendError(
                f"replacement={replacement!r}: use one of {REPLACEMENT_MODES} (asg: a managed node "
                "group or Auto Scaling group; karpenter: delete the node's NodeClaim; cordon: "
                "take the node out of service and let a human replace it)"
            )
        if not 0 < max_unhealthy_share <= 1:
            raise BackendError(f"max_unhealthy_share={max_unhealthy_share} must be in (0, 1]")
        if {"image", "namespace"} & set(pod or {}):
            raise BackendError("give image and namespace as the backend's own settings, not in pod")
        try:
            self.settings = PodTemplateSettings.from_dict(
                {"image": image, "namespace": namespace, **(pod or {})}, validate=False
            )
        except (TypeError, ValueError) as e:
            raise BackendError(f"EKS pod settings: {e}") from None
        try:
            #: Registry/repository prefixes the image must be under (None: the image's own repository).
            self.image_allowlist = (
                [check_image_prefix(p) for p in image_allowlist] if image_allowlist is not None else None
            )
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
        return {
            "name": self.name,
            "image": self.image,
            "namespace": self.namespace,
            "kubernetes_conn_id": self.kubernetes_conn_id,
            "cluster_name": self.cluster_name,
            "aws_conn_id": self.aws_conn_id,
            "region_name": self.region_name,
            "replacement": self.replacement,
            "max_unhealthy_share": self.max_unhealthy_share,
            "pool_selector": self.pool_selector,
            "evaluation_poll_s": self.evaluation_poll_s,
            "pod": self.pod,
            "image_allowlist": self.image_allowlist,
        }

    # -- clients ------------------------------------------------------------------------------
    def _kubeconfig(self) -> contextlib.AbstractContextManager[str | None]:
        """A kubeconfig for ``cluster_name`` (built by EksHook, removed afterwards), else None:
        the Kubernetes connection says how to reach the cluster."""
        return eks_kubeconfig(
            self.cluster_name, aws_conn_id=self.aws_conn_id, region_name=self.region_name, namespace=self.namespace
        )

    def _kube(self) -> contextlib.AbstractContextManager[KubeClient]:
        """A ``KubeClient`` on a fresh client (client.connect)."""
        return connect(self._kubeconfig(), self.kubernetes_conn_id, self.namespace)

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
                check_no_other_launch(kube, cfg.run_id, job_name)
                if self.replacement != "karpenter":  # Karpenter provisions nodes for pending pods
                    check_capacity(self._capacity(kube), cfg, self.pool_selector)
                check_references(kube, self.settings, self.namespace)
                existing = kube.create_job(job)  # suspended: no pod starts yet
            elif (existing["metadata"].get("labels") or {}).get(LABEL_RUN) != cfg.run_id:
                owner = (existing["metadata"].get("labels") or {}).get(LABEL_RUN)
                raise JobConflictError(f"job {job_name} exists but belongs to run {owner!r}, not {cfg.run_id!r}")
            # A retry finishes what a failed try left: each step is a no-op once done.
            try:
                kube.ensure_service(
                    rendezvous_service(cfg, launch_id, self.settings, owner=existing, airflow_run_id=airflow_run_id)
                )
                kube.ensure_network_policy(
                    rendezvous_network_policy(
                        cfg, launch_id, self.settings, owner=existing, airflow_run_id=airflow_run_id
                    )
                )
                budget = disruption_budget(cfg, launch_id, self.settings, owner=existing, airflow_run_id=airflow_run_id)
                ensure_budget(kube, budget)  # before any pod runs: no voluntary eviction by others
                existing = kube.resume_job(existing)
            except BackendError as e:
                raise BackendError(
                    f"{e}. Job {job_name} stays suspended (no pod runs without its Service); once "
                    "this is fixed, retrying the launch task finishes the launch"
                ) from e
        return self._handle(cfg, launch_id, existing)

    def check_launch(
        self, cfg: RunConfig, launch_id: str = "0", *, airflow_run_id: str | None = None
    ) -> dict[str, Any]:
        """The launch's Job, or BackendError for what would make submit refuse it before calling
        the cluster: no image, an image outside the allowlist, pod settings or a run config the Job
        cannot be built for (paths outside the FSx mount, more processes than GPUs per pod).
        validate_config calls it too, so bad input fails before anything starts."""
        if not self.image:
            raise BackendError(
                "the EKS backend needs a training image: set the DAG's `image` param or "
                "FSDP_EKS_IMAGE (see images/training/Dockerfile)"
            )
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
            raise BackendError(
                f"image {image!r} is not allowed: images must come from {allowed} (whole path "
                "components; a valid reference with :tag and/or @sha256:digest). It is not under the "
                "image allowlist: use an image from there, or have an administrator add its "
                "registry/repository to FSDP_EKS_IMAGE_ALLOWLIST (comma-separated prefixes) in "
                "Airflow's environment"
            )

    def _handle(self, cfg: RunConfig, launch_id: str, job: dict[str, Any]) -> JobHandle:
        created = timestamp(job["metadata"].get("creationTimestamp")) or time.time()
        return JobHandle(
            self.name,
            cfg.run_id,
            launch_id,
            job["metadata"]["name"],
            {
                "namespace": self.namespace,
                "cluster_name": self.cluster_name,
                "run_dir": cfg.run_dir,
                "submitted_at": created,
            },
        )

    def _job(self, kube: KubeClient, handle: JobHandle) -> dict[str, Any]:
        self._check_handle(handle)
        job = kube.get_job(handle.job_name)
        if job is None:
            raise JobNotFoundError(
                f"no job {handle.job_name} in namespace {self.namespace}"
                + (f" of cluster {self.cluster_name}" if self.cluster_name else "")
                + "; deleted, or another cluster/namespace?"
            )
        return job

    def _server_version(self, kube: KubeClient) -> tuple[int, int] | None:
        """The cluster's Kubernetes (major, minor), read once and kept (completion.py)."""
        return cached_version(self._version_key(), lambda: read_version(kube.api))

    def _version_key(self) -> str:
        return f"{self.cluster_name or ''}|{self.kubernetes_conn_id or ''}"

    def status(self, handle: JobHandle) -> JobStatus:
        """The launch's state. A launch with spares whose training nodes succeeded on a cluster
        without the Job's successPolicy is ended here: the Job suspended and marked succeeded."""
        with self._kube() as kube:
            job = settle(kube, self._job(kube, handle), lambda: self._server_version(kube))
            return job_status(
                job,
                kube.list_pods(f"{LABEL_JOB}={handle.job_name}"),
                provisions_on_demand=self.replacement == "karpenter",
            )

    async def status_async(self, handle: JobHandle) -> JobStatus:
        """``status`` through ``AsyncKubernetesHook``: what the triggerer calls between sleeps."""
        self._check_handle(handle)
        kubeconfig = self._kubeconfig() if self.cluster_name else None
        job, pods, version = await read_launch_async(
            kubeconfig, self.kubernetes_conn_id, self.namespace, handle.job_name, self._version_key()
        )
        status = job_status(job, pods, provisions_on_demand=self.replacement == "karpenter")
        return await status_as_read(job, status, version)

    def logs(self, handle: JobHandle, node: int | None = None, tail: int = 200) -> str:
        with self._kube() as kube:
            job = self._job(kube, handle)
            pods = newest_pods(kube.list_pods(f"{LABEL_JOB}={handle.job_name}"))
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
            status = job_status(
                job,
                kube.list_pods(f"{LABEL_JOB}={handle.job_name}"),
                provisions_on_demand=self.replacement == "karpenter",
            )
            cfg = run_config_of(job)
            run_dir = cfg.run_dir if cfg else handle.extra.get("run_dir", "")
            stall = cfg.stall_timeout_s if cfg else float("inf")
            if status.state == "failed":
                # Failed while its Job still runs (too few nodes left behind the spares): the
                # verdict is that failure, kept for diagnose once the suspended Job's pods are gone.
                verdict = {"at": time.time(), "failure_class": status.failure_class, "message": status.message}
            else:
                verdict = verdict_at_cancel(
                    run_dir, timestamp(job["metadata"].get("creationTimestamp")), stall, status.state
                )
            verdict["nodes"] = {str(n.index): n.node_id for n in status.nodes if n.node_id}
            kube.patch_job(
                handle.job_name,
                {"metadata": {"annotations": {CANCEL_ANNOTATION: json.dumps(verdict)}}, "spec": {"suspend": True}},
            )

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
            kube_nodes = {n.node_id: kube.get_node(n.node_id) for n in status.nodes if n.state == LOST and n.node_id}
        return spare_status(
            handle.job_name,
            job,
            pods,
            status,
            kube_nodes,
            reason,
            replacement=self.replacement,
            namespace=self.namespace,
            pool_selector=self.pool_selector,
        )

    def diagnose(self, handle: JobHandle) -> Diagnosis:
        with self._kube() as kube:
            job = self._job(kube, handle)
            return diagnose_job(kube, handle, job, provisions_on_demand=self.replacement == "karpenter")

    # -- nodes --------------------------------------------------------------------------------
    def _pool(self, kube: KubeClient) -> list[dict[str, Any]]:
        selector = ",".join(f"{k}={v}" for k, v in sorted(self.pool_selector.items()))
        return kube.list_nodes(selector)

    def _capacity(self, kube: KubeClient) -> Capacity:
        return pool_capacity(
            self._pool(kube), devices_needed(self.settings), provisions_on_demand=self.replacement == "karpenter"
        )

    def capacity(self) -> Capacity:
        with self._kube() as kube:
            return self._capacity(kube)

    def replace_nodes(self, node_ids: list[str], reason: str) -> Replacement:
        """Cordon and taint each node, evict the pods of ours left on it, then have the platform
        replace it: terminate its instance in its Auto Scaling group (the group launches a new one;
        desired capacity unchanged), or delete its Karpenter NodeClaim, or (``cordon``) leave the
        replacement to a human. Refuses more than ``max_unhealthy_share`` of the pool at once.

        A hot spare parked on the node is evicted too (past its launch's budget: disruption.py);
        the Job recreates it for the same index, and the cordon and taint keep it off this node."""
        with self._kube() as kube:
            return replace_pool_nodes(
                kube,
                self._pool(kube),
                node_ids,
                reason,
                replacement=self.replacement,
                max_unhealthy_share=self.max_unhealthy_share,
                autoscaling=self._autoscaling,
            )

    def quarantined_nodes(self) -> list[dict[str, Any]]:
        """The pool's nodes this project quarantined that still exist. Under replacement=asg or
        karpenter such a node is usually on its way out (``ready`` False once its instance
        stops); under cordon it waits for a person."""
        with self._kube() as kube:
            pool = self._pool(kube)
        return quarantine_report(pool)

    def return_nodes(
        self, node_ids: list[str], reason: str, *, by: str | None = None, quarantined_before: float | None = None
    ) -> ServiceReturn:
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

    # -- evaluation ---------------------------------------------------------------------------
    def run_evaluation(
        self, cfg: RunConfig, checkpoint_id: str | None = None, timeout_s: float = 3600.0
    ) -> dict[str, Any]:
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
        with self._kube() as kube:
            wait_for_evaluation_job(
                kube, job, timeout_s=timeout_s, poll_s=self.evaluation_poll_s, namespace=self.namespace
            )
        return read_evaluation_result(cfg.run_dir, job["metadata"]["name"])
