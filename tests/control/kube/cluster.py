"""The test-facing side of the real control plane: seed and read cluster state, end pods and lose
nodes the way a node would (through kwok), issue ServiceAccount tokens, and list who asked the
apiserver for what (its audit log).

Every read goes to the apiserver; nothing here keeps state of its own. State changes made by the
controllers are asynchronous, so the helpers that start one (``terminate_pod``, ``lose_node``,
``remove_node``) wait until it has happened, and ``wait_for`` waits for anything else.
"""

from __future__ import annotations

import json
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from control.kube.control_plane import (
    KWOK_ANNOTATION,
    LOST_NODES_CONFIGMAP,
    NODE_MONITOR_GRACE_S,
    ControlPlane,
    write_kubeconfig,
)

#: The annotation kwok's pod-exit stage reads (stages.yaml).
EXIT_CODE_ANNOTATION = "test.fsdp-resilience/exit-code"
LABEL_JOB_NAME = "batch.kubernetes.io/job-name"
#: Identities whose requests are the cluster's own, not the code under test's.
_INTERNAL_USERS = ("test-harness", "system:kube-controller-manager", "system:kube-scheduler", "kwok")


class ApiError(Exception):
    def __init__(self, status: int, body: dict | str):
        self.status, self.body = status, body
        message = body.get("message") if isinstance(body, dict) else body
        super().__init__(f"{status}: {message}")


@dataclass(frozen=True)
class UserInfo:
    username: str
    groups: tuple[str, ...] = ()


def service_account_user(namespace: str, name: str) -> UserInfo:
    return UserInfo(
        f"system:serviceaccount:{namespace}:{name}",
        ("system:serviceaccounts", f"system:serviceaccounts:{namespace}", "system:authenticated"),
    )


@dataclass(frozen=True)
class Request:
    """One audited API request, named as RBAC names it ("" for the core group and no subresource)."""

    verb: str
    api_group: str
    resource: str
    subresource: str
    namespace: str
    name: str
    user: str = field(default="", compare=False)
    code: int = field(default=0, compare=False)


def wait_for(predicate: Callable, timeout: float = 60.0, what: str = "condition", interval: float = 0.2):
    """Poll ``predicate`` until it returns something truthy; return it, or fail saying ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def taint_keys(node: dict) -> list[str]:
    """The keys of a node's taints, in the order the node has them."""
    return [t["key"] for t in node["spec"].get("taints") or []]


_PLURALS = {
    "Namespace": ("/api/v1", "namespaces"),
    "ServiceAccount": ("/api/v1", "serviceaccounts"),
    "PersistentVolume": ("/api/v1", "persistentvolumes"),
    "PersistentVolumeClaim": ("/api/v1", "persistentvolumeclaims"),
    "ConfigMap": ("/api/v1", "configmaps"),
    "Role": ("/apis/rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "rolebindings"),
    "ClusterRole": ("/apis/rbac.authorization.k8s.io/v1", "clusterroles"),
    "ClusterRoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "clusterrolebindings"),
    "ValidatingAdmissionPolicy": ("/apis/admissionregistration.k8s.io/v1", "validatingadmissionpolicies"),
    "ValidatingAdmissionPolicyBinding": ("/apis/admissionregistration.k8s.io/v1", "validatingadmissionpolicybindings"),
    "NetworkPolicy": ("/apis/networking.k8s.io/v1", "networkpolicies"),
    "PriorityClass": ("/apis/scheduling.k8s.io/v1", "priorityclasses"),
}


def _object_key(obj: dict) -> tuple[str, str, str]:
    return obj["kind"], obj["metadata"].get("namespace", ""), obj["metadata"]["name"]


def _object_path(obj: dict) -> str:
    prefix, plural = _PLURALS[obj["kind"]]
    namespace = obj["metadata"].get("namespace")
    return (
        f"{prefix}/namespaces/{namespace}/{plural}/{obj['metadata']['name']}"
        if namespace
        else (f"{prefix}/{plural}/{obj['metadata']['name']}")
    )


class KubeCluster:
    """The running control plane, seen as a test sees a cluster."""

    def __init__(self, plane: ControlPlane):
        self.plane = plane
        pki = plane.pki
        self._ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        self._ctx.load_cert_chain(str(pki / "harness.crt"), str(pki / "harness.key"))
        # For requests with a bearer token: no client certificate, which would authenticate first.
        self._token_ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        self._audit_from = plane.audit_offset()
        self.kit_applied: list[dict] = []

    # -- raw API --------------------------------------------------------------------------

    def api(self, method: str, path: str, body=None, *, query: dict | None = None,
            content_type: str = "application/json", token: str | None = None):  # fmt: skip
        url = self.plane.server + path + (("?" + urllib.parse.urlencode(query)) if query else "")
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": content_type, "Accept": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        deadline = time.monotonic() + 30
        while True:
            request = urllib.request.Request(url, data=data, method=method, headers=headers)
            try:
                context = self._token_ctx if token else self._ctx
                with urllib.request.urlopen(request, context=context, timeout=60) as r:
                    raw = r.read()
                return json.loads(raw) if raw else None
            except urllib.error.HTTPError as e:
                raw = e.read()
                # 429: the apiserver asks to come back (a cache still initialising, priority and
                # fairness), as the Kubernetes clients do.
                if e.code == 429 and time.monotonic() < deadline:
                    time.sleep(float(e.headers.get("Retry-After") or 1))
                    continue
                try:
                    parsed = json.loads(raw)
                except ValueError:
                    parsed = raw.decode(errors="replace")
                raise ApiError(e.code, parsed) from None

    def get(self, path: str, **query):
        return self.api("GET", path, query=query or None)

    def exists(self, path: str) -> bool:
        try:
            self.get(path)
            return True
        except ApiError as e:
            if e.status == 404:
                return False
            raise

    def patch(self, path: str, body, kind: str = "strategic"):
        types = {
            "strategic": "application/strategic-merge-patch+json",
            "merge": "application/merge-patch+json",
            "json": "application/json-patch+json",
        }
        return self.api("PATCH", path, body, content_type=types[kind])

    # -- identities -----------------------------------------------------------------------

    def token_for(self, user: UserInfo | tuple[str, str], expiration_seconds: int = 7200) -> str:
        """A real ServiceAccount token (TokenRequest) for ``user``, a ServiceAccount's identity."""
        if isinstance(user, UserInfo):
            _, _, namespace, name = user.username.split(":")
        else:
            namespace, name = user
        self.ensure_service_account(namespace, name)
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                "spec": {"expirationSeconds": expiration_seconds}}  # fmt: skip
        out = self.api("POST", f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token", body)
        return out["status"]["token"]

    def ensure_namespace(self, name: str, labels: dict | None = None) -> None:
        if not self.exists(f"/api/v1/namespaces/{name}"):
            self.api("POST", "/api/v1/namespaces", {"metadata": {"name": name, "labels": labels or {}}})

    def ensure_service_account(self, namespace: str, name: str) -> None:
        self.ensure_namespace(namespace)
        if not self.exists(f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}"):
            self.api("POST", f"/api/v1/namespaces/{namespace}/serviceaccounts", {"metadata": {"name": name}})

    def kubeconfig(self, path, namespace: str = "default", user: UserInfo | None = None) -> Path:
        """A kubeconfig for ``user`` (a ServiceAccount, with a real token), or the cluster admin."""
        path = Path(path)
        ca = self.plane.pki / "ca.crt"
        if user is None:
            pki = self.plane.pki
            return write_kubeconfig(path, self.plane.server, ca, cert=pki / "admin.crt", key=pki / "admin.key",
                                    namespace=namespace)  # fmt: skip
        return write_kubeconfig(path, self.plane.server, ca, token=self.token_for(user), namespace=namespace)

    @staticmethod
    def airflow_connection(kubeconfig_path, namespace: str = "default") -> str:
        """A value for AIRFLOW_CONN_<ID> that points the cncf.kubernetes hooks at this cluster."""
        return json.dumps(
            {"conn_type": "kubernetes", "extra": {"kube_config_path": str(kubeconfig_path), "namespace": namespace}}
        )

    # -- the deploy kit ---------------------------------------------------------------------

    def apply(self, objects: list[dict], *, manager: str = "fsdp-resilience-tests") -> None:
        """``kubectl apply --server-side`` of ``objects`` (as the deploy kit's users apply it)."""
        manifest = "\n".join(json.dumps(o) for o in objects)
        self.plane.kubectl("apply", "--server-side", "--force-conflicts", f"--field-manager={manager}", "-f", "-",
                           input=manifest)  # fmt: skip

    def load(self, objects: list[dict]) -> None:
        """Apply a rendered deploy kit as its users do. What an earlier test's kit had and this one
        lacks is deleted first (as ``kubectl apply --prune`` would), and the kit's Namespaces get
        back exactly the kit's labels, so no test sees another's."""
        keep = {_object_key(o) for o in objects}
        for obj in self.plane.applied_kit:
            if _object_key(obj) not in keep and obj["kind"] != "Namespace":
                self._delete(_object_path(obj))
        for obj in objects:
            if obj["kind"] == "Namespace":
                name = obj["metadata"]["name"]
                if self.exists(f"/api/v1/namespaces/{name}"):
                    labels = {"kubernetes.io/metadata.name": name, **(obj["metadata"].get("labels") or {})}
                    current = self.get(f"/api/v1/namespaces/{name}")
                    current["metadata"]["labels"] = labels
                    self.api("PUT", f"/api/v1/namespaces/{name}", current)
        changed = objects != self.plane.applied_kit
        self.apply(objects)
        self.plane.applied_kit = objects
        if changed and any(o["kind"].startswith("ValidatingAdmissionPolicy") for o in objects):
            # Another kit's policies (an overlay's): the admission plugin reads them from informers,
            # so under load a request right after could still meet the old ones.
            self.wait_admission_policies()

    def add_namespace(self, name: str, labels: dict | None = None) -> dict:
        """Create the Namespace, or give it exactly ``labels`` (e.g. pod-security.kubernetes.io/*)."""
        labels = {"kubernetes.io/metadata.name": name, **(labels or {})}
        if not self.exists(f"/api/v1/namespaces/{name}"):
            return self.api("POST", "/api/v1/namespaces", {"metadata": {"name": name, "labels": labels}})
        current = self.get(f"/api/v1/namespaces/{name}")
        current["metadata"]["labels"] = labels
        return self.api("PUT", f"/api/v1/namespaces/{name}", current)

    # -- nodes ----------------------------------------------------------------------------

    def add_node(self, name: str, *, ready: bool = True, labels: dict | None = None, taints: list | None = None,
                 allocatable: dict | None = None, provider_id: str | None = None, conditions: list | None = None,
                 unschedulable: bool = False) -> dict:  # fmt: skip
        """A node as kwok runs it: Ready with a renewed lease (``ready=False``: registered, never
        Ready). ``allocatable`` adds to cpu 192 / memory 2000Gi / pods 110."""
        resources = {"cpu": "192", "memory": "2000Gi", "pods": "110", "ephemeral-storage": "500Gi",
                     **{k: str(v) for k, v in (allocatable or {}).items()}}  # fmt: skip
        instance = "i-" + uuid.uuid5(uuid.NAMESPACE_DNS, name).hex[:17]
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())

        def condition(type_, status, reason="", message=""):
            return {"type": type_, "status": status, "reason": reason, "message": message,
                    "lastHeartbeatTime": now, "lastTransitionTime": now}  # fmt: skip

        status_conditions = [condition(t, "False", f"KubeletHasNo{t}") for t in ("MemoryPressure", "DiskPressure",
                                                                                 "PIDPressure")]  # fmt: skip
        status_conditions.append(condition("Ready", "True" if ready else "False",
                                           "KubeletReady" if ready else "KubeletNotReady"))  # fmt: skip
        for c in conditions or []:
            status_conditions = [x for x in status_conditions if x["type"] != c["type"]]
            status_conditions.append(condition(c["type"], c["status"], c.get("reason", ""), c.get("message", "")))
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "annotations": {KWOK_ANNOTATION[0]: KWOK_ANNOTATION[1]} if ready else {},
                "labels": {
                    "kubernetes.io/hostname": name,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                    "type": "kwok",
                    **(labels or {}),
                },  # fmt: skip
            },
            "spec": {"providerID": provider_id or f"aws:///us-west-2a/{instance}"},
            "status": {
                "capacity": dict(resources),
                "allocatable": dict(resources),
                "conditions": status_conditions,
                "nodeInfo": {
                    "architecture": "amd64",
                    "kubeletVersion": "kwok",
                    "operatingSystem": "linux",
                    "machineID": instance,
                    "systemUUID": instance,
                    "bootID": str(uuid.uuid4()),
                    "containerRuntimeVersion": "containerd://kwok",
                    "kernelVersion": "6.1",
                    "kubeProxyVersion": "",
                    "osImage": "Amazon Linux 2023",
                },
            },  # fmt: skip
        }
        if taints:
            node["spec"]["taints"] = taints
        if unschedulable:
            node["spec"]["unschedulable"] = True
        created = self.api("POST", "/api/v1/nodes", node)
        # The apiserver keeps a created node's status (as the kubelet registers it); make sure.
        if not created.get("status", {}).get("allocatable"):
            self.patch(f"/api/v1/nodes/{name}/status", {"status": node["status"]})
        return self.node(name)

    def set_node_condition(self, name: str, type: str, status: str, reason: str = "", message: str = "") -> None:
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        condition = {"type": type, "status": status, "reason": reason, "message": message,
                     "lastHeartbeatTime": now, "lastTransitionTime": now}  # fmt: skip
        self.patch(f"/api/v1/nodes/{name}/status", {"status": {"conditions": [condition]}})

    def add_node_taint(self, name: str, taint: dict) -> dict:
        """A second controller adds ``taint`` (its own read-modify-write, with resourceVersion,
        read again on a conflict: the cluster's own controllers write nodes too)."""
        for attempt in range(20):
            node = self.node(name)
            taints = node["spec"].get("taints") or []
            if not any((t["key"], t["effect"]) == (taint["key"], taint["effect"]) for t in taints):
                taints = [*taints, taint]
            body = {"metadata": {"resourceVersion": node["metadata"]["resourceVersion"]}, "spec": {"taints": taints}}
            try:
                return self.patch(f"/api/v1/nodes/{name}", body, "merge")
            except ApiError as e:
                if e.status != 409 or attempt == 19:
                    raise
        raise AssertionError("unreachable")

    def lose_node(self, name: str, *, evict_pods: bool = True, timeout: float = 120) -> None:
        """The node stops reporting: kwok stops running it and its lease renewals no longer reach the
        apiserver (LOST_NODE_POLICY), so the real node lifecycle controller marks it Ready=Unknown
        and taints it unreachable (NoSchedule and NoExecute).
        With ``evict_pods``, wait until the taint eviction controller has deleted its pods (they
        stay Terminating: no kubelet is left to end them)."""
        # kwok would still end its pods once deleted (its pod-terminate stage): marked, they stay
        # Terminating as without a kubelet (stages.yaml).
        mark = {"metadata": {"annotations": {NODE_LOST_ANNOTATION: "true"}}}
        for pod in self.pods_on(name):
            path = f"/api/v1/namespaces/{pod['metadata']['namespace']}/pods/{pod['metadata']['name']}"
            self._ignore_missing(lambda path=path: self.patch(path, mark, "merge"))
        self.patch(f"/api/v1/nodes/{name}", {"metadata": {"annotations": {KWOK_ANNOTATION[0]: None}}}, "merge")
        self._set_lost(name, True)

        def tainted(effect):
            taints = self.node(name)["spec"].get("taints") or []
            return any(t.get("key") == "node.kubernetes.io/unreachable" and t.get("effect") == effect for t in taints)

        wait_for(
            lambda: tainted("NoSchedule"),
            timeout=timeout + NODE_MONITOR_GRACE_S,
            what=f"node {name} tainted unreachable by the node lifecycle controller",
        )
        if evict_pods:
            # NoExecute only while most of the zone is healthy: a zone whose nodes all stopped
            # reporting is "fully disrupted", and the controller evicts nothing there.
            wait_for(lambda: tainted("NoExecute"), timeout=timeout, what=f"node {name} tainted unreachable:NoExecute")
            wait_for(
                lambda: all(p["metadata"].get("deletionTimestamp") for p in self.pods_on(name)),
                timeout=timeout,
                what=f"the pods on {name} evicted by the taint eviction controller",
            )

    def _set_lost(self, name: str, lost: bool) -> None:
        path = f"/api/v1/namespaces/kube-node-lease/configmaps/{LOST_NODES_CONFIGMAP}"
        if not self.exists(path):
            self.api("POST", "/api/v1/namespaces/kube-node-lease/configmaps",
                     {"metadata": {"name": LOST_NODES_CONFIGMAP}, "data": {}})  # fmt: skip
        self.patch(path, {"data": {name: "lost" if lost else None}}, "merge")

    def remove_node(self, name: str, *, timeout: float = 120) -> None:
        """The node object is deleted (its instance is gone); the real PodGC then fails and deletes
        the pods bound to it (it waits 40 s for the node to come back first)."""
        try:
            self.api("DELETE", f"/api/v1/nodes/{name}")
        except ApiError as e:
            if e.status != 404:
                raise
        wait_for(
            lambda: all(p["status"].get("phase") in ("Failed", "Succeeded") for p in self.pods_on(name)),
            timeout=timeout,
            what=f"PodGC to fail the pods of deleted node {name}",
            interval=1.0,
        )

    def node(self, name: str) -> dict:
        return self.get(f"/api/v1/nodes/{name}")

    def nodes(self) -> list[dict]:
        return sorted(self.get("/api/v1/nodes")["items"], key=lambda n: n["metadata"]["name"])

    # -- Karpenter ------------------------------------------------------------------------

    def add_nodeclaim(self, name: str, node_name: str, *, nodepool: str = "default") -> dict:
        node = self.node(node_name) if self.exists(f"/api/v1/nodes/{node_name}") else None
        claim = {
            "apiVersion": "karpenter.sh/v1",
            "kind": "NodeClaim",
            "metadata": {
                "name": name,
                "labels": {"karpenter.sh/nodepool": nodepool},
                "finalizers": ["karpenter.sh/termination"],
            },  # fmt: skip
            "spec": {
                "nodeClassRef": {"group": "karpenter.k8s.aws", "kind": "EC2NodeClass", "name": "default"},
                "requirements": [],
            },  # fmt: skip
        }
        self.api("POST", "/apis/karpenter.sh/v1/nodeclaims", claim)
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        conditions = [{"type": t, "status": "True", "reason": t, "message": "", "lastTransitionTime": now}
                      for t in ("Launched", "Registered", "Initialized", "Ready")]  # fmt: skip
        status = {"nodeName": node_name, "providerID": node["spec"]["providerID"] if node else "",
                  "conditions": conditions}  # fmt: skip
        self.patch(f"/apis/karpenter.sh/v1/nodeclaims/{name}/status", {"status": status}, "merge")
        return self.nodeclaim(name)

    def nodeclaim(self, name: str) -> dict:
        return self.get(f"/apis/karpenter.sh/v1/nodeclaims/{name}")

    # -- pods and jobs ----------------------------------------------------------------------

    def pods(self, namespace: str, job_name: str | None = None) -> list[dict]:
        query = {"labelSelector": f"{LABEL_JOB_NAME}={job_name}"} if job_name else {}
        items = self.get(f"/api/v1/namespaces/{namespace}/pods", **query)["items"]
        return sorted(items, key=lambda p: p["metadata"]["name"])

    def pods_on(self, node_name: str) -> list[dict]:
        return self.get("/api/v1/pods", fieldSelector=f"spec.nodeName={node_name}")["items"]

    def pod(self, namespace: str, name: str) -> dict:
        return self.get(f"/api/v1/namespaces/{namespace}/pods/{name}")

    def job(self, namespace: str, name: str) -> dict:
        return self.get(f"/apis/batch/v1/namespaces/{namespace}/jobs/{name}")

    def events(self, namespace: str, involved_name: str | None = None) -> list[dict]:
        query = {"fieldSelector": f"involvedObject.name={involved_name}"} if involved_name else {}
        items = self.get(f"/api/v1/namespaces/{namespace}/events", **query)["items"]
        return sorted(items, key=lambda e: int(e["metadata"]["resourceVersion"]))

    def wait_running(self, namespace: str, name: str, timeout: float = 60) -> dict:
        return wait_for(
            lambda: (p := self.pod(namespace, name))["status"].get("phase") == "Running" and p,
            timeout=timeout,
            what=f"pod {namespace}/{name} Running",
        )

    def terminate_pod(self, namespace: str, name: str, exit_code: int, *, timeout: float = 60) -> dict:
        """The pod's container exits with ``exit_code`` (kwok's pod-exit stage): Succeeded on 0,
        else Failed. Waits until the pod is running first, then until it is terminal."""
        self.wait_running(namespace, name, timeout)
        self.patch(
            f"/api/v1/namespaces/{namespace}/pods/{name}",
            {"metadata": {"annotations": {EXIT_CODE_ANNOTATION: str(int(exit_code))}}},
            "merge",
        )
        return wait_for(
            lambda: (p := self.pod(namespace, name))["status"].get("phase") in ("Succeeded", "Failed") and p,
            timeout=timeout,
            what=f"pod {namespace}/{name} to exit {exit_code}",
        )

    def succeed_pods(self, namespace: str, job_name: str) -> None:
        for pod in self.pods(namespace, job_name):
            if pod["status"].get("phase") in ("Pending", "Running") and not pod["metadata"].get("deletionTimestamp"):
                self.terminate_pod(namespace, pod["metadata"]["name"], 0)

    # -- who asked for what -----------------------------------------------------------------

    @property
    def requests(self) -> list[Request]:
        """Requests made since the last ``clear_requests`` by anyone but the cluster's own
        components and this harness, from the apiserver's audit log (ResponseComplete records).
        A request made with impersonation counts as the impersonated user's."""
        records = self._audit_barrier()
        out = []
        for r in records:
            # An impersonated request is authorized and admitted as the user it impersonates.
            user = (r.get("impersonatedUser") or r.get("user") or {}).get("username", "")
            if r.get("stage") != "ResponseComplete" or user in _INTERNAL_USERS:
                continue
            if user.startswith(("system:serviceaccount:kube-system:", "system:node:")):
                continue
            ref = r.get("objectRef") or {}
            if not ref.get("resource"):
                continue
            out.append(
                Request(
                    verb=r["verb"],
                    api_group=ref.get("apiGroup", ""),
                    resource=ref["resource"],
                    subresource=ref.get("subresource", ""),
                    namespace=ref.get("namespace", ""),
                    name=ref.get("name", ""),
                    user=user,
                    code=(r.get("responseStatus") or {}).get("code", 0),
                )
            )
        return out

    def _audit_barrier(self) -> list[dict]:
        """The audit records so far, once a request made now has been logged: a request's record is
        written just after its response, so one made before this call is in the log by then."""
        marker = uuid.uuid4().hex
        self.get("/api/v1/namespaces/default", labelSelector=f"audit-barrier={marker}")
        return wait_for(
            lambda: (
                (records := self.plane.audit_records(self._audit_from))
                and any(marker in r.get("requestURI", "") and r.get("stage") == "ResponseComplete" for r in records)
                and records
            ),
            timeout=10,
            what="the apiserver's audit log to catch up",
            interval=0.05,
        )

    def clear_requests(self) -> None:
        self._audit_barrier()
        self._audit_from = self.plane.audit_offset()

    def rbac_usage(self) -> set[tuple[str, str, str]]:
        """(api_group, resource[/subresource], verb) of every request so far: what a Role must grant."""
        return {
            (r.api_group, f"{r.resource}/{r.subresource}" if r.subresource else r.resource, r.verb)
            for r in self.requests
        }

    # -- admission policies in effect -------------------------------------------------------

    def wait_admission_policies(self, timeout: float = 60) -> None:
        """Wait until the apiserver enforces every ValidatingAdmissionPolicy and binding written so
        far (e.g. by ``load``): its admission plugin reads them from informers, so a new one takes
        effect a moment later. A sentinel policy written after them denies a dry-run probe once the
        plugin has caught up with it, and so with everything written before it; then it goes."""
        name, marker = "test-harness-sentinel", f"sentinel-{uuid.uuid4().hex[:12]}"
        policy = {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicy",
            "metadata": {"name": name},
            "spec": {
                "failurePolicy": "Fail",
                "matchConstraints": {"resourceRules": [{"apiGroups": [""], "apiVersions": ["v1"],
                                                        "resources": ["configmaps"], "operations": ["CREATE"]}]},
                "validations": [{"expression": f"object.metadata.name != '{marker}'", "message": marker}],
            },
        }  # fmt: skip
        binding = {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicyBinding",
            "metadata": {"name": name},
            "spec": {"policyName": name, "validationActions": ["Deny"]},
        }
        self.apply([policy, binding], manager="test-harness")

        def refused() -> bool:
            try:
                self.api("POST", "/api/v1/namespaces/default/configmaps", {"metadata": {"name": marker}},
                         query={"dryRun": "All"})  # fmt: skip
            except ApiError as e:
                return marker in str(e)
            return False

        try:
            wait_for(refused, timeout=timeout, what="the apiserver to enforce the admission policies", interval=0.1)
        finally:
            prefix = "/apis/admissionregistration.k8s.io/v1"
            self._delete(f"{prefix}/validatingadmissionpolicybindings/{name}")
            self._delete(f"{prefix}/validatingadmissionpolicies/{name}")

    # -- between tests ----------------------------------------------------------------------

    def reset(self, timeout: float = 60) -> None:
        """Back to an empty cluster for the next test: no Jobs, pods, nodes or NodeClaims, no
        events, and no objects the Jobs owned. Namespaces, the kit and ServiceAccounts stay."""
        system = {"kube-system", "kube-public", "kube-node-lease", "default"}
        namespaces = [n["metadata"]["name"] for n in self.get("/api/v1/namespaces")["items"]]
        for ns in namespaces:
            if ns in system:
                continue
            self.api("DELETE", f"/apis/batch/v1/namespaces/{ns}/jobs", query={"propagationPolicy": "Background"})
            # Objects a launch owns go with their Job, but the garbage collector takes its time;
            # Services go whoever made them (the kit has none; a client test makes one unowned).
            for kind, path in (("services", "/api/v1"), ("configmaps", "/api/v1"),
                               ("networkpolicies", "/apis/networking.k8s.io/v1"),
                               ("poddisruptionbudgets", "/apis/policy/v1")):  # fmt: skip
                for obj in self.get(f"{path}/namespaces/{ns}/{kind}")["items"]:
                    owners = obj["metadata"].get("ownerReferences") or []
                    if kind == "services" or any(o.get("kind") == "Job" for o in owners):
                        self._delete(f"{path}/namespaces/{ns}/{kind}/{obj['metadata']['name']}")
            self.api("DELETE", f"/api/v1/namespaces/{ns}/events")
        for pod in self.get("/api/v1/pods")["items"]:
            ns, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
            if ns in system:
                continue
            if pod["metadata"].get("finalizers"):
                self._drop_finalizers(f"/api/v1/namespaces/{ns}/pods/{name}")
            self._delete(f"/api/v1/namespaces/{ns}/pods/{name}", gracePeriodSeconds=0)
        if self.exists("/apis/karpenter.sh/v1/nodeclaims"):
            for claim in self.get("/apis/karpenter.sh/v1/nodeclaims")["items"]:
                path = f"/apis/karpenter.sh/v1/nodeclaims/{claim['metadata']['name']}"
                self._drop_finalizers(path)
                self._delete(path)
        for node in self.get("/api/v1/nodes")["items"]:
            self._delete(f"/api/v1/nodes/{node['metadata']['name']}")
        self._delete(f"/api/v1/namespaces/kube-node-lease/configmaps/{LOST_NODES_CONFIGMAP}")
        wait_for(
            lambda: (
                not [p for p in self.get("/api/v1/pods")["items"] if p["metadata"]["namespace"] not in system]
                and not self.get("/apis/batch/v1/jobs")["items"]
            ),
            timeout=timeout,
            what="the previous test's pods and Jobs to be gone",
        )
        self.clear_requests()

    def _drop_finalizers(self, path: str) -> None:
        try:
            self.patch(path, {"metadata": {"finalizers": None}}, "merge")
        except ApiError as e:
            if e.status not in (404, 409):
                raise

    def _delete(self, path: str, **query) -> None:
        self._ignore_missing(lambda: self.api("DELETE", path, query=query or None))

    @staticmethod
    def _ignore_missing(call) -> None:
        try:
            call()
        except ApiError as e:
            if e.status not in (404, 409):
                raise

    # -- ending pods with a reason ----------------------------------------------------------

    def terminate_pod_with_reason(self, namespace: str, name: str, exit_code: int, reason: str, **kw) -> dict:
        """``terminate_pod``, the container's terminated reason ``reason`` (e.g. ``OOMKilled``, as
        the kubelet writes it) instead of kwok's Completed/Error (stages.yaml reads it)."""
        path = f"/api/v1/namespaces/{namespace}/pods/{name}"
        self.patch(path, {"metadata": {"annotations": {EXIT_REASON_ANNOTATION: reason}}}, "merge")
        return self.terminate_pod(namespace, name, exit_code, **kw)

    # -- nodes that joined ------------------------------------------------------------------

    def wait_nodes_ready(self, names: list[str] | None = None, timeout: float = 60) -> list[dict]:
        """Wait until the node lifecycle controller has seen each node (``names``, else every
        node) Ready and taken off the ``node.kubernetes.io/not-ready:NoSchedule`` taint that the
        NodeTaint admission plugin puts on every new node (a few seconds after ``add_node``), as a
        node that joined a while ago is. A test whose code reads and writes a node's taints waits
        for this first, else it may see the taint come and go."""

        def settled() -> list[dict] | None:
            nodes = [n for n in self.nodes() if names is None or n["metadata"]["name"] in names]
            if names is not None and len(nodes) < len(names):
                return None
            for node in nodes:
                ready = [c for c in node["status"].get("conditions") or [] if c["type"] == "Ready"]
                taints = node["spec"].get("taints") or []
                if not ready or ready[0]["status"] != "True":
                    return None
                if any(t.get("key") == "node.kubernetes.io/not-ready" for t in taints):
                    return None
            return nodes

        return wait_for(settled, timeout=timeout, what=f"nodes {names or 'all'} Ready without the not-ready taint")


#: The annotation kwok's pod-exit stage takes the terminated reason from, when set (stages.yaml).
EXIT_REASON_ANNOTATION = "test.fsdp-resilience/exit-reason"
#: On the pods of a node lose_node stopped: kwok's pod-terminate stage leaves them Terminating.
NODE_LOST_ANNOTATION = "test.fsdp-resilience/node-lost"
