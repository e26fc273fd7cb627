"""The EKS backend's Kubernetes client: how it connects (a Kubernetes connection, or a kubeconfig
that EksHook builds for a cluster name), the few API calls it makes (``KubeClient``, and the
triggerer's async read of a launch), and what an API error means (``kube_error``).

Kubernetes is reached through the cncf.kubernetes provider's hooks: ``KubernetesHook`` (an Airflow
connection, ``kubernetes_default``: in-cluster or a kubeconfig) or, with a cluster name, a
kubeconfig that the amazon provider's ``EksHook`` builds from the cluster's endpoint and the AWS
connection's credentials. The triggerer polls with ``AsyncKubernetesHook`` (``read_job_async``,
listing.py, where the lists that grow with the cluster are paged and kept as JSON).
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from typing import Any, Iterator

from fsdp_resilience.control.backends.base import BackendError
from fsdp_resilience.control.backends.eks.constants import (
    CONTAINER,
    QUARANTINE_ANNOTATION,
    QUARANTINE_TAINT,
    RETURN_ANNOTATION,
)
from fsdp_resilience.control.backends.eks.disruption import evict_pods_on
from fsdp_resilience.control.backends.eks.listing import list_all, read_job_async  # noqa: F401 (its old home)
from fsdp_resilience.control.backends.eks.nodes import quarantine_record, quarantined_by_us
from fsdp_resilience.control.backends.eks.status import job_finished

#: Where the worker's grants are (RBAC) and how Airflow outside the cluster gets them.
RBAC_HINT = (
    "grant it in deploy/base/rbac.yaml (the worker's Role/ClusterRole, bound to the ServiceAccount "
    "airflow/airflow-worker and the group fsdp-airflow-worker; the triggerer's are read-only) and apply "
    "the kit; Airflow outside the cluster needs the EKS access entry that maps its IAM role to that "
    "group (docs/deploy-on-eks.md, 4b)"
)
_FORBIDDEN = re.compile(
    r'User "(?P<user>[^"]*)" cannot (?P<verb>\S+) resource "(?P<resource>[^"]*)"'
    r'(?: in API group "(?P<group>[^"]*)")?(?: in the namespace "(?P<ns>[^"]*)")?'
)


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
        return BackendError(
            f"cannot reach the Kubernetes API to {doing}: {type(e).__name__}: {str(e)[:300]}. Check "
            "the Kubernetes connection (FSDP_KUBERNETES_CONN_ID) or FSDP_EKS_CLUSTER_NAME and the AWS "
            "connection, and that the cluster's endpoint is reachable from Airflow"
        )
    message = _status_message(e)
    if status == 401:
        return BackendError(
            f"the Kubernetes API refused the credentials to {doing} (401 Unauthorized: {message}). "
            "Check the Kubernetes connection's kubeconfig or token; with FSDP_EKS_CLUSTER_NAME, that "
            "the AWS connection's IAM identity has an EKS access entry (docs/deploy-on-eks.md, 4b)"
        )
    if status == 403:
        match = _FORBIDDEN.search(message)
        if match:
            where = f" in namespace {match['ns']}" if match["ns"] else " (cluster-wide)"
            group = match["group"] or "core"
            who = (
                f"identity {match['user']} lacks the grant '{match['verb']}' on {match['resource']} "
                f"(API group {group}){where}"
            )
        else:  # an admission policy (Pod Security, the kit's ValidatingAdmissionPolicies) said no
            who = "the request was refused by RBAC or an admission policy"
        return BackendError(
            f"forbidden to {doing}: {who}. The apiserver said: {message}. If the grant is missing, {RBAC_HINT}"
        )
    if status == 404:
        if re.search(r'namespaces? "[^"]*" not found', message):
            return BackendError(
                f"cannot {doing}: namespace {namespace} does not exist ({message}). Create it by "
                "applying the deploy kit (kubectl apply -k deploy/overlays/<cluster>; docs/deploy-on-eks.md), "
                "or set FSDP_EKS_NAMESPACE to the training namespace"
            )
        return BackendError(
            f"cannot {doing}: not found (404: {message}). Is this the right cluster, and is its API "
            "(and the kit) installed?"
        )
    if status == 409:
        return BackendError(f"cannot {doing}: conflict (409: {message}); someone changed it meanwhile: retry the task")
    if status == 422:
        return BackendError(f"the apiserver rejected the request to {doing} as invalid (422): {message}")
    if status == 429 or status >= 500:
        return BackendError(
            f"the Kubernetes API could not {doing} now ({status}: {message}); the apiserver is busy "
            "or failing: retry the task later"
        )
    return BackendError(f"cannot {doing}: {status} {getattr(e, 'reason', '')}: {message}")


# --------------------------------------------------------------------------------------------
# Connecting
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def eks_kubeconfig(
    cluster_name: str | None, *, aws_conn_id: str | None, region_name: str | None, namespace: str
) -> Iterator[str | None]:
    """A kubeconfig for ``cluster_name`` (built by EksHook, removed afterwards), else None:
    the Kubernetes connection says how to reach the cluster."""
    if not cluster_name:
        yield None
        return
    from airflow.providers.amazon.aws.hooks.eks import EksHook

    hook = EksHook(aws_conn_id=aws_conn_id, region_name=region_name)
    with hook.generate_config_file_with_credentials(eks_cluster_name=cluster_name, pod_namespace=namespace) as (
        config_file,
        _,
    ):
        yield config_file


@contextlib.contextmanager
def connect(
    kubeconfig: contextlib.AbstractContextManager[str | None], kubernetes_conn_id: str | None, namespace: str
) -> Iterator["KubeClient"]:
    """A ``KubeClient`` on a fresh client, through the kubeconfig ``kubeconfig`` yields (None: the
    Kubernetes connection ``kubernetes_conn_id``). An API or connection error that escapes the
    block becomes a BackendError (``kube_error``); KubeClient's own calls already name what they
    were doing."""
    import urllib3
    from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook
    from kubernetes.client import ApiException

    with kubeconfig as config_file:
        if config_file:
            hook = KubernetesHook(conn_id=None, kubernetes_conn_id=None, config_file=config_file)
        else:
            hook = KubernetesHook(conn_id=kubernetes_conn_id)
        try:
            yield KubeClient(hook.get_conn(), namespace)
        except (ApiException, urllib3.exceptions.HTTPError) as e:
            raise kube_error(e, "call the Kubernetes API", namespace) from e


# --------------------------------------------------------------------------------------------
# The API calls
# --------------------------------------------------------------------------------------------


class KubeClient:
    """The few API calls the backend makes, on one ``ApiClient``, returning the API's JSON.

    Every verb used here must be granted by the deploy kit's RBAC (deploy/); a test checks the two
    agree, from the audit log of a real apiserver this class ran against. Every call goes through
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
            result = call(*args, **kwargs)
            # A list read as JSON (listing.list_all) is JSON already: walking it again costs CPU.
            return result if isinstance(result, (dict, list)) else self._json(result)
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
        return self._call(
            f"list jobs ({label_selector})",
            self.batch.list_namespaced_job,
            self.namespace,
            label_selector=label_selector,
        )["items"]

    def create_job(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._create(
            f"create job {body['metadata']['name']}", self.batch.create_namespaced_job, body, self.get_job
        )

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
                return self._call(
                    f"resume job {name}",
                    self.batch.patch_namespaced_job,
                    name,
                    self.namespace,
                    {"metadata": {"resourceVersion": job["metadata"]["resourceVersion"]}, "spec": {"suspend": False}},
                    ok=(409,),
                )
            except self.ApiException:
                job = self.get_job(name)
                if job is None:
                    raise BackendError(f"job {name} was deleted while submit resumed it; retry the task") from None
        raise BackendError(
            f"job {name} kept changing while submit resumed it ({self.PATCH_TRIES} tries); retry the task"
        )

    # services: get, create
    def get_service(self, name: str) -> dict[str, Any] | None:
        return self._or_none(f"read service {name}", self.core.read_namespaced_service, name, self.namespace)

    def ensure_service(self, body: dict[str, Any]) -> dict[str, Any]:
        name = body["metadata"]["name"]
        return self.get_service(name) or self._create(
            f"create service {name}", self.core.create_namespaced_service, body, self.get_service
        )

    # serviceaccounts, persistentvolumeclaims: get
    def get_service_account(self, name: str) -> dict[str, Any] | None:
        return self._or_none(
            f"read service account {name}", self.core.read_namespaced_service_account, name, self.namespace
        )

    def get_claim(self, name: str) -> dict[str, Any] | None:
        return self._or_none(
            f"read persistent volume claim {name}",
            self.core.read_namespaced_persistent_volume_claim,
            name,
            self.namespace,
        )

    # networkpolicies.networking.k8s.io: get, create
    def get_network_policy(self, name: str) -> dict[str, Any] | None:
        return self._or_none(
            f"read network policy {name}", self.networking.read_namespaced_network_policy, name, self.namespace
        )

    def ensure_network_policy(self, body: dict[str, Any]) -> dict[str, Any]:
        name = body["metadata"]["name"]
        return self.get_network_policy(name) or self._create(
            f"create network policy {name}",
            self.networking.create_namespaced_network_policy,
            body,
            self.get_network_policy,
        )

    # pods: list; pods/log: get; pods/eviction: create (disruption.py)
    def list_pods(self, label_selector: str, field_selector: str | None = None) -> list[dict[str, Any]]:
        return self._call(
            f"list pods ({label_selector})",
            list_all,
            self.api,
            f"/api/v1/namespaces/{self.namespace}/pods",
            label_selector=label_selector,
            field_selector=field_selector,
        )

    def pod_log(self, name: str, tail: int) -> str:
        try:
            # Raw bytes: with content preloaded, this client version returns the repr of the bytes.
            return self.core.read_namespaced_pod_log(
                name, self.namespace, container=CONTAINER, tail_lines=tail, _preload_content=False
            ).data.decode(errors="replace")
        except self.ApiException as e:
            return f"(no log: {e.status} {e.reason})"

    def evict_pods_on(self, node_name: str, label_selector: str) -> list[str]:
        """Evict our pods still running on a node, past the launch's own disruption budget
        (disruption.evict_pods_on)."""
        return evict_pods_on(self, node_name, label_selector)

    # nodes: get, list, patch
    def get_node(self, name: str) -> dict[str, Any] | None:
        return self._or_none(f"read node {name}", self.core.read_node, name)

    def list_nodes(self, label_selector: str) -> list[dict[str, Any]]:
        return self._call(
            f"list nodes ({label_selector})", list_all, self.api, "/api/v1/nodes", label_selector=label_selector
        )

    #: Up to this many nodes are read one GET each; more, in one paged list of every node.
    NODE_GETS_MAX = 8

    def get_nodes(self, names: list[str]) -> dict[str, dict[str, Any] | None]:
        """name -> node (None: gone) for ``names``: a GET each for a few, else the nodes listed in
        pages and picked (3 requests at 1,024 nodes, not 512)."""
        if len(names) <= self.NODE_GETS_MAX:
            return {name: self.get_node(name) for name in names}
        listed = {n["metadata"]["name"]: n for n in self.list_nodes("")}
        return {name: listed.get(name) for name in names}

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
                return self._call(
                    f"cordon and taint node {name}",
                    self.core.patch_node,
                    name,
                    {
                        "metadata": {
                            "resourceVersion": node["metadata"].get("resourceVersion"),
                            "annotations": {QUARANTINE_ANNOTATION: note},
                        },
                        "spec": {"unschedulable": True, "taints": taints},
                    },
                    ok=(409,),
                )
            except self.ApiException:
                node = self.get_node(name)
                if node is None:
                    raise BackendError(f"node {name} is gone (deleted while it was being cordoned)") from None
        raise BackendError(
            f"node {name} kept changing while it was being cordoned and tainted "
            f"({self.PATCH_TRIES} tries got 409 Conflict); retry the task"
        )

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
            if not quarantined_by_us(node) or (
                quarantined_before is not None and (since is None or since > quarantined_before)
            ):
                return "not_quarantined"
            note = json.dumps(
                {
                    "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "by": by,
                    "reason": reason,
                    "quarantine": (node["metadata"].get("annotations") or {}).get(QUARANTINE_ANNOTATION),
                }
            )
            taints = [t for t in (node.get("spec") or {}).get("taints") or [] if t.get("key") != QUARANTINE_TAINT]
            try:
                self._call(
                    f"return node {name} to service (uncordon, remove taint {QUARANTINE_TAINT})",
                    self.core.patch_node,
                    name,
                    {
                        "metadata": {
                            "resourceVersion": node["metadata"].get("resourceVersion"),
                            "annotations": {QUARANTINE_ANNOTATION: None, RETURN_ANNOTATION: note},
                        },
                        "spec": {"unschedulable": None, "taints": taints},
                    },
                    ok=(404, 409),
                )
                return "returned"
            except self.ApiException as e:
                node = None if e.status == 404 else self.get_node(name)
        raise BackendError(
            f"node {name} kept changing while it was being returned to service "
            f"({self.PATCH_TRIES} tries got 409 Conflict); run the return again"
        )

    # karpenter.sh nodeclaims: list, delete
    def list_nodeclaims(self) -> list[dict[str, Any]]:
        return self._call(
            "list Karpenter NodeClaims", self.custom.list_cluster_custom_object, "karpenter.sh", "v1", "nodeclaims"
        )["items"]

    def delete_nodeclaim(self, name: str) -> None:
        try:
            self._call(
                f"delete Karpenter NodeClaim {name}",
                self.custom.delete_cluster_custom_object,
                "karpenter.sh",
                "v1",
                "nodeclaims",
                name,
                ok=(404,),
            )
        except self.ApiException:
            pass  # gone already
