"""A fake Kubernetes apiserver over real HTTP, for the control-plane tests of the EKS backend.

It serves the JSON paths the `kubernetes` and `kubernetes_asyncio` clients use for pods (+log,
+eviction), services, events, nodes, namespaces, serviceaccounts, persistentvolumeclaims,
persistentvolumes, configmaps, batch/v1 jobs, scheduling.k8s.io priorityclasses,
networking.k8s.io networkpolicies, rbac.authorization.k8s.io roles/bindings,
admissionregistration.k8s.io validatingadmissionpolicies/bindings and karpenter.sh/v1 nodeclaims,
and keeps the cluster state realistic with a mini Job controller (Indexed jobs, podFailurePolicy,
backoffLimit, suspend, replacement pods), a mini scheduler (readiness, cordon, taints/tolerations,
nodeSelector, required node affinity, extended resources, required pod anti-affinity, PVCs) and
PodGC/Karpenter-like node loss. A node that stops reporting (``lose_node``) goes Ready=Unknown and
unreachable-tainted, its pods are deleted by the taint manager (DisruptionTarget) and stay
Terminating until PodGC (``remove_node``) fails them; the Job controller honours
podReplacementPolicy (Failed, the default with a podFailurePolicy: a Terminating pod keeps its index
until it is terminal; TerminatingOrFailed: replaced at once) and counts them in status.terminating.

What it checks, as the apiserver does (errors shaped like its Status, messages like its own):

- Schema: every created or changed object against the Kubernetes 1.33 OpenAPI schema
  (kubernetes_validate), strictly: an unknown or misspelt field is a 422, as with
  ``fieldValidation=Strict``.
- Semantics beyond the schema: names per kind (Services DNS-1035 labels, Namespaces RFC 1123
  labels, Jobs RFC 1123 subdomains of at most 63 characters, the rest subdomains), label keys and
  values, pod hostname/subdomain; podFailurePolicy (no exit code 0 with In, values unique and
  ordered, a containerName of the template, one of onExitCodes/onPodConditions); resources
  (extended resources and huge pages: requests equal limits, a limit when requested; huge pages
  need cpu or memory; requests <= limits); ports in range (containers, Services with named ports
  when there are several, NetworkPolicies); restartPolicy of Jobs.
- Immutability: a Job's template (except a never-started suspended Job's scheduling directives),
  selector, completionMode and podFailurePolicy (422 "field is immutable"); a pod's spec but for
  images, activeDeadlineSeconds and added tolerations.
- Optimistic concurrency: an update or patch carrying a resourceVersion other than the stored one
  is a 409 Conflict. ``taint_on_next_read`` / ``add_node_taint`` play a second controller (the
  node lifecycle controller, Karpenter) that taints a node between a client's read and write.
- Pod Security admission per namespace label (pod-security.kubernetes.io/enforce and warn, with
  their -version): the baseline and restricted checks a pod of this project can hit (host
  namespaces, privileged, capabilities, hostPath, hostPort, seccomp, volume types,
  allowPrivilegeEscalation, runAsNonRoot, runAsUser=0). A pod is refused with 403; a Job's
  template only warns (Warning headers) and its pods are refused by the job controller.
- Once ``load(objects)`` stored a deploy kit: pods' ServiceAccount and PriorityClass must exist
  (else 403 for a client's pod, a FailedCreate Warning event on the Job for the job controller's),
  PVCs too (else the pod stays Pending with a FailedScheduling event); RBAC (kube_authz
  RbacAuthorizer) authorises every request by its bearer token's user (``token_for``,
  ``kubeconfig(user=...)``; 401 for an unknown token, 403 with the apiserver's message); the kit's
  ValidatingAdmissionPolicies (kube_authz AdmissionPolicies, CEL in cel-python) admit creates,
  updates, patches, deletes and evictions, the job controller's pods as
  system:serviceaccount:kube-system:job-controller.

Every request is recorded in ``requests`` (verb, group, resource, subresource, namespace, name as
RBAC names them, and the user). Everything the fake does is immediate: there is no grace period,
no kubelet delay and no watch.

Use::

    from control.fake_kube import FakeKube, fake_kube  # noqa: F401  (fake_kube is a pytest fixture)

    with FakeKube() as kube:
        kube.add_node("gpu-0", allocatable={"nvidia.com/gpu": "8"})
        path = kube.kubeconfig(tmp_path / "kubeconfig")  # the admin's token; user=... for another
        # KubernetesHook and AsyncKubernetesHook(conn_id="kubernetes_fake") both reach it through
        # the connection's kube_config_path (the async hook ignores config_file=):
        monkeypatch.setenv("AIRFLOW_CONN_KUBERNETES_FAKE", kube.airflow_connection(path))

As on a real apiserver: node ``spec.taints`` is an atomic list (a strategic merge patch replaces it
whole); a Job deleted without ``propagationPolicy`` orphans its pods (with a Warning header); the
1.33 schema wants ``status`` on every ``podFailurePolicy`` ``onPodConditions`` entry; timestamps
are stored re-encoded (UTC, "Z", whole seconds), so a client's "+00:00" reads back as "Z". Client quirk:
kubernetes 36.0.x's sync ``read_namespaced_pod_log`` returns ``str(bytes)`` ("b'...'",
kubernetes-client/python#2596); read logs with ``_preload_content=False`` and decode.

What it does not model (a real cluster may still refuse or behave differently):

- watches, server-side apply, field managers, finalizers other than Karpenter's, graceful
  deletion (but for pods on a node lost with ``lose_node``, which stay Terminating), garbage
  collection other than a deleted Job's (its pods, and the Services, NetworkPolicies and
  ConfigMaps it owns, by its propagationPolicy);
- defaulting beyond a few fields (pod requests are not filled in from limits in the stored object,
  no QoS class computation), LimitRanges, ResourceQuotas, mutating webhooks and policies;
- validation the apiserver does outside these lists (e.g. env var names, probes, volume sources,
  most of the Service and NetworkPolicy semantics), and the schema of other Kubernetes versions
  than 1.33 (deploy/render.py checks the kit at 1.30 and 1.33);
- Pod Security checks outside the list above (AppArmor, SELinux, procMount, sysctls, Windows),
  PodSecurity on pod updates, exemptions, audit annotations;
- RBAC: ClusterRole aggregation, impersonation, nonResourceURLs (/version and discovery are open),
  the job controller's own RBAC; admission: cel-python instead of cel-go (no type checking, no cost
  limits), paramKind/paramRef;
- NetworkPolicies are stored, never enforced (any pod reaches any pod); DNS, the CNI, EFA devices,
  kubelet behaviour (images, probes, OOM), the device plugins' registration, node pressure,
  taint-based evictions other than ``lose_node``'s (a NoExecute taint added otherwise does not
  evict), preemption, PVC binding and volume attach.
"""

from __future__ import annotations

import copy
import functools
import itertools
import json
import random
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from fractions import Fraction
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

KUBERNETES_VERSION = "1.33"
SCHEMA_DIR = f"kubernetes-json-schema/v{KUBERNETES_VERSION}.0-local-strict"
ACTIVE_PHASES = ("Pending", "Running")
LABEL_JOB_NAME = "batch.kubernetes.io/job-name"
LABEL_CONTROLLER_UID = "batch.kubernetes.io/controller-uid"
LABEL_INDEX = "batch.kubernetes.io/job-completion-index"
#: The node lifecycle controller's taint on a node that stopped reporting.
UNREACHABLE_TAINT = "node.kubernetes.io/unreachable"
#: Exit code of a container stopped by SIGTERM (Python's default handler): what a deleted or
#: evicted pod's container reports in this fake.
SIGTERM_EXIT_CODE = 143
JOB_DELETE_WARNING = (
    '299 - "child pods are preserved by default when jobs are deleted; set '
    "propagationPolicy=Background to remove them or set propagationPolicy=Orphan "
    'to suppress this warning"'
)


@dataclass(frozen=True)
class Request:
    """One API request, named as RBAC names it ("" for the core group, "" for no subresource), and
    who made it (a kube_authz.UserInfo; not compared, so tests can list requests without it).
    ``name`` is the URL's, or on a create the new object's metadata.name ("" for generateName)."""

    verb: str
    api_group: str
    resource: str
    subresource: str
    namespace: str
    name: str
    user: object = field(default=None, compare=False)


@dataclass(frozen=True)
class Resource:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    schema_file: str | None = None  # strict validation of create/update/patch results
    definition: str | None = None  # OpenAPI definition: strategic-merge-patch directives
    field_labels: tuple[str, ...] = ("metadata.name", "metadata.namespace")

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def qualified(self) -> str:
        """How the apiserver names the resource in messages: pods, jobs.batch, nodeclaims.karpenter.sh."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def qualified_kind(self) -> str:
        return f"{self.kind}.{self.group}" if self.group else self.kind


_BASE_FIELDS = ("metadata.name", "metadata.namespace")
RESOURCES = {
    (r.group, r.plural): r
    for r in [
        Resource(
            "",
            "v1",
            "pods",
            "Pod",
            True,
            "pod-v1.json",
            "io.k8s.api.core.v1.Pod",
            _BASE_FIELDS
            + (
                "spec.nodeName",
                "spec.restartPolicy",
                "spec.schedulerName",
                "spec.serviceAccountName",
                "spec.hostNetwork",
                "status.phase",
                "status.podIP",
                "status.nominatedNodeName",
            ),
        ),
        Resource("", "v1", "services", "Service", True, "service-v1.json", "io.k8s.api.core.v1.Service"),
        Resource(
            "",
            "v1",
            "events",
            "Event",
            True,
            "event-v1.json",
            "io.k8s.api.core.v1.Event",
            _BASE_FIELDS
            + (
                "involvedObject.kind",
                "involvedObject.namespace",
                "involvedObject.name",
                "involvedObject.uid",
                "involvedObject.apiVersion",
                "involvedObject.resourceVersion",
                "involvedObject.fieldPath",
                "reason",
                "reportingComponent",
                "source",
                "type",
            ),
        ),
        Resource(
            "",
            "v1",
            "nodes",
            "Node",
            False,
            "node-v1.json",
            "io.k8s.api.core.v1.Node",
            ("metadata.name", "spec.unschedulable"),
        ),
        Resource(
            "",
            "v1",
            "namespaces",
            "Namespace",
            False,
            "namespace-v1.json",
            "io.k8s.api.core.v1.Namespace",
            field_labels=("metadata.name", "status.phase"),
        ),
        Resource(
            "batch",
            "v1",
            "jobs",
            "Job",
            True,
            "job-batch-v1.json",
            "io.k8s.api.batch.v1.Job",
            _BASE_FIELDS + ("status.successful",),
        ),
        Resource("karpenter.sh", "v1", "nodeclaims", "NodeClaim", False),
        # What a deploy kit holds (FakeKube.load) and what pods refer to.
        Resource(
            "",
            "v1",
            "serviceaccounts",
            "ServiceAccount",
            True,
            "serviceaccount-v1.json",
            "io.k8s.api.core.v1.ServiceAccount",
        ),
        Resource(
            "",
            "v1",
            "persistentvolumeclaims",
            "PersistentVolumeClaim",
            True,
            "persistentvolumeclaim-v1.json",
            "io.k8s.api.core.v1.PersistentVolumeClaim",
        ),
        Resource(
            "",
            "v1",
            "persistentvolumes",
            "PersistentVolume",
            False,
            "persistentvolume-v1.json",
            "io.k8s.api.core.v1.PersistentVolume",
        ),
        Resource("", "v1", "configmaps", "ConfigMap", True, "configmap-v1.json", "io.k8s.api.core.v1.ConfigMap"),
        Resource(
            "scheduling.k8s.io",
            "v1",
            "priorityclasses",
            "PriorityClass",
            False,
            "priorityclass-scheduling-v1.json",
            "io.k8s.api.scheduling.v1.PriorityClass",
        ),
        Resource(
            "networking.k8s.io",
            "v1",
            "networkpolicies",
            "NetworkPolicy",
            True,
            "networkpolicy-networking-v1.json",
            "io.k8s.api.networking.v1.NetworkPolicy",
        ),
        Resource(
            "rbac.authorization.k8s.io", "v1", "roles", "Role", True, "role-rbac-v1.json", "io.k8s.api.rbac.v1.Role"
        ),
        Resource(
            "rbac.authorization.k8s.io",
            "v1",
            "clusterroles",
            "ClusterRole",
            False,
            "clusterrole-rbac-v1.json",
            "io.k8s.api.rbac.v1.ClusterRole",
        ),
        Resource(
            "rbac.authorization.k8s.io",
            "v1",
            "rolebindings",
            "RoleBinding",
            True,
            "rolebinding-rbac-v1.json",
            "io.k8s.api.rbac.v1.RoleBinding",
        ),
        Resource(
            "rbac.authorization.k8s.io",
            "v1",
            "clusterrolebindings",
            "ClusterRoleBinding",
            False,
            "clusterrolebinding-rbac-v1.json",
            "io.k8s.api.rbac.v1.ClusterRoleBinding",
        ),
        Resource(
            "admissionregistration.k8s.io",
            "v1",
            "validatingadmissionpolicies",
            "ValidatingAdmissionPolicy",
            False,
            "validatingadmissionpolicy-admissionregistration-v1.json",
            "io.k8s.api.admissionregistration.v1.ValidatingAdmissionPolicy",
        ),
        Resource(
            "admissionregistration.k8s.io",
            "v1",
            "validatingadmissionpolicybindings",
            "ValidatingAdmissionPolicyBinding",
            False,
            "validatingadmissionpolicybinding-admissionregistration-v1.json",
            "io.k8s.api.admissionregistration.v1.ValidatingAdmissionPolicyBinding",
        ),
    ]
}
(
    POD,
    SERVICE,
    EVENT,
    NODE,
    NAMESPACE,
    JOB,
    NODECLAIM,
    SERVICEACCOUNT,
    PVC,
    PV,
    CONFIGMAP,
    PRIORITYCLASS,
    NETWORKPOLICY,
    ROLE,
    CLUSTERROLE,
    ROLEBINDING,
    CLUSTERROLEBINDING,
    VAP,
    VAP_BINDING,
) = RESOURCES.values()
KINDS = {(r.api_version, r.kind): r for r in RESOURCES.values()}
RBAC_RESOURCES = (ROLE, CLUSTERROLE, ROLEBINDING, CLUSTERROLEBINDING)
ADMISSION_RESOURCES = (VAP, VAP_BINDING)
#: Built in on every cluster (the scheduling.k8s.io bootstrap): name -> value.
SYSTEM_PRIORITY_CLASSES = {"system-cluster-critical": 2000000000, "system-node-critical": 2000001000}
EVICTION_SCHEMA = "eviction-policy-v1.json"


class ApiError(Exception):
    """An error answered as the apiserver shapes it: a v1 Status."""

    def __init__(self, code: int, reason: str, message: str, details: dict | None = None):
        super().__init__(message)
        self.code, self.reason, self.message, self.details = code, reason, message, details

    def status(self) -> dict:
        out = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details:
            out["details"] = self.details
        return out

    @classmethod
    def not_found(cls, res: Resource, name: str) -> ApiError:
        return cls(
            404,
            "NotFound",
            f'{res.qualified} "{name}" not found',
            {"name": name, "group": res.group, "kind": res.plural},
        )

    @classmethod
    def invalid(cls, res: Resource, name: str, problems: list[str]) -> ApiError:
        return cls(
            422,
            "Invalid",
            f'{res.qualified_kind} "{name}" is invalid: ' + "; ".join(problems),
            {
                "name": name,
                "group": res.group,
                "kind": res.kind,
                "causes": [{"reason": "FieldValueInvalid", "message": p} for p in problems],
            },
        )

    @classmethod
    def bad_request(cls, message: str) -> ApiError:
        return cls(400, "BadRequest", message)


_TIMESTAMP = re.compile(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)")


def normalize_times(value, key: str = ""):
    """metav1.Time fields as the apiserver stores them (it decodes and re-encodes them): RFC 3339
    in UTC with a Z, whole seconds. A client may send "+00:00" (the Python client does)."""
    if isinstance(value, dict):
        return {k: normalize_times(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [normalize_times(v, key) for v in value]
    if isinstance(value, str) and (
        key.endswith(("Time", "Timestamp")) or key in ("timeAdded", "startedAt", "finishedAt")
    ):
        m = _TIMESTAMP.fullmatch(value)
        if m:
            stamp = datetime.fromisoformat(m.group(1) + (m.group(3).replace("Z", "+00:00")))
            return stamp.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return value


def _authz():
    """kube_authz (RBAC and ValidatingAdmissionPolicy evaluation), imported when first needed: it
    needs cel-python, which tests that never load a kit do not."""
    import kube_authz

    return kube_authz


#: Seconds added to the wall clock for every timestamp the fake writes (``FakeKube.tick``).
_clock_offset = 0.0


def now() -> str:
    return datetime.fromtimestamp(time.time() + _clock_offset, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# ---------------------------------------------------------------------------------------------
# Strict schema validation (kubernetes_validate's bundled 1.33 schemas), cached: building the
# validator parses a 1.4 MB definitions file (~20 ms); a cached validator checks a Job in <1 ms.


@functools.cache
def _definitions() -> dict:
    from kubernetes_validate import utils

    return utils.schema_contents(f"{SCHEMA_DIR}/_definitions.json", KUBERNETES_VERSION)


@functools.cache
def _validator(schema_file: str):
    import jsonschema
    from kubernetes_validate import utils
    from referencing import Registry
    from referencing import Resource as SchemaResource

    schema = utils.schema_contents(f"{SCHEMA_DIR}/{schema_file}", KUBERNETES_VERSION)
    registry = SchemaResource.from_contents(_definitions()) @ (SchemaResource.from_contents(schema) @ Registry())
    return jsonschema.validators.Draft202012Validator(schema, registry=registry)


def _path(parts) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def schema_problems(obj: dict, schema_file: str) -> list[str]:
    """What the strict 1.33 schema rejects in obj; unknown fields named by their full path."""
    problems = []
    for error in sorted(_validator(schema_file).iter_errors(obj), key=lambda e: list(map(str, e.absolute_path))):
        where = _path(error.absolute_path)
        if error.validator == "additionalProperties" and isinstance(error.instance, dict):
            known = error.schema.get("properties", {})
            problems += [
                f'unknown field "{_path([*error.absolute_path, k])}"' for k in error.instance if k not in known
            ]
        else:
            problems.append(f"{where or '<root>'}: {error.message}")
    return problems


# ---------------------------------------------------------------------------------------------
# Patches: strategic merge (directives read from the OpenAPI schema, so lists such as pod
# conditions merge by key while atomic lists such as node taints are replaced, as on a real
# apiserver), JSON merge patch (RFC 7386) and JSON patch (RFC 6902).


def _resolve(schema) -> dict:
    while isinstance(schema, dict) and "$ref" in schema:
        schema = _definitions()["$defs"][schema["$ref"].rsplit("/", 1)[1]]
    return schema if isinstance(schema, dict) else {}


def strategic_merge(target, patch, schema: dict):
    schema = _resolve(schema)
    if not isinstance(patch, dict) or not isinstance(target, dict):
        return copy.deepcopy(patch)
    if patch.get("$patch") == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    out = dict(target)
    for key, value in patch.items():
        if key.startswith("$"):
            continue  # $retainKeys / $setElementOrder: ordering hints this fake does not need
        sub = schema.get("properties", {}).get(key) or schema.get("additionalProperties")
        sub = _resolve(sub)
        if value is None:
            out.pop(key, None)
        elif (
            isinstance(value, list)
            and isinstance(out.get(key), list)
            and "merge" in sub.get("x-kubernetes-patch-strategy", "")
        ):
            out[key] = _merge_list(out[key], value, sub)
        elif isinstance(value, dict):
            out[key] = strategic_merge(out.get(key) if isinstance(out.get(key), dict) else {}, value, sub)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _merge_list(current: list, patch: list, schema: dict) -> list:
    key, items = schema.get("x-kubernetes-patch-merge-key"), schema.get("items")
    if not key:
        return current + [copy.deepcopy(v) for v in patch if v not in current]
    out = [copy.deepcopy(c) for c in current]
    for item in patch:
        at = next((i for i, c in enumerate(out) if isinstance(c, dict) and c.get(key) == item.get(key)), None)
        if item.get("$patch") == "delete":
            if at is not None:
                out.pop(at)
        elif at is None:
            out.append(strategic_merge({}, item, items))
        else:
            out[at] = strategic_merge(out[at], item, items)
    return out


def merge_patch(target, patch):
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise ValueError(f"JSON pointer {path!r} must start with '/'")
    return [t.replace("~1", "/").replace("~0", "~") for t in path[1:].split("/")]


def _at(doc, token):
    return doc[int(token)] if isinstance(doc, list) else doc[token]


def json_patch(doc, operations: list):
    doc = copy.deepcopy(doc)

    def get(tokens):
        return functools.reduce(_at, tokens, doc)

    def remove(tokens):
        parent = get(tokens[:-1])
        if isinstance(parent, list):
            parent.pop(int(tokens[-1]))
        else:
            del parent[tokens[-1]]

    def add(tokens, value):
        nonlocal doc
        if not tokens:
            doc = value
            return
        parent = get(tokens[:-1])
        if isinstance(parent, list):
            parent.insert(len(parent) if tokens[-1] == "-" else int(tokens[-1]), value)
        else:
            parent[tokens[-1]] = value

    for op in operations:
        kind, tokens = op.get("op"), _pointer(op.get("path", ""))
        if kind == "test":
            if get(tokens) != op.get("value"):
                raise ValueError(f"testing value {op.get('path')} failed")
            continue
        if kind not in ("add", "remove", "replace", "move", "copy"):
            raise ValueError(f"unknown JSON patch operation {kind!r}")
        value = copy.deepcopy(get(_pointer(op["from"])) if kind in ("move", "copy") else op.get("value"))
        if kind == "move":
            remove(_pointer(op["from"]))
        if kind in ("remove", "replace") and tokens:
            remove(tokens)
        if kind != "remove":
            add(tokens, value)
    return doc


# ---------------------------------------------------------------------------------------------
# Selectors and quantities.

_REQUIREMENT = re.compile(
    r"^\s*(!?)\s*([A-Za-z0-9._/-]+)\s*"
    r"(?:(==|=|!=)\s*([A-Za-z0-9._-]*)|\s+(in|notin)\s*\(([^)]*)\))?\s*$"
)


def parse_label_selector(text: str):
    """`a=b`, `a==b`, `a!=b`, `a`, `!a`, `a in (x,y)`, `a notin (x,y)`, comma-separated (AND)."""
    checks = []
    for part in filter(str.strip, re.split(r",(?![^()]*\))", text or "")):
        m = _REQUIREMENT.match(part)
        if not m or (m.group(1) and (m.group(3) or m.group(5))):
            raise ApiError.bad_request(f"unable to parse requirement: {part.strip()!r}")
        neg, key, op, value, set_op, values = m.groups()
        if op in ("=", "=="):
            checks.append(lambda labels, k=key, v=value: labels.get(k) == v)
        elif op == "!=":
            checks.append(lambda labels, k=key, v=value: labels.get(k) != v)
        elif set_op:
            options = {v.strip() for v in values.split(",") if v.strip()}
            if set_op == "in":
                checks.append(lambda labels, k=key, o=options: labels.get(k) in o)
            else:
                checks.append(lambda labels, k=key, o=options: labels.get(k) not in o)
        else:
            checks.append(lambda labels, k=key, n=bool(neg): (k in labels) != n)
    return lambda labels: all(check(labels or {}) for check in checks)


def match_expressions(expressions: list[dict], labels: dict) -> bool:
    """metav1.LabelSelectorRequirement / NodeSelectorRequirement matching (In, NotIn, Exists, DoesNotExist, Gt, Lt)."""
    for req in expressions or []:
        key, op, values = req["key"], req["operator"], req.get("values") or []
        have = labels.get(key)
        ok = {
            "In": have in values,
            "NotIn": have not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }.get(op)
        if ok is None:  # Gt / Lt compare integers
            ok = (
                have is not None
                and have.lstrip("-").isdigit()
                and (int(have) > int(values[0]) if op == "Gt" else int(have) < int(values[0]))
            )
        if not ok:
            return False
    return True


def match_label_selector(selector: dict | None, labels: dict) -> bool:
    if selector is None:
        return False
    labels = labels or {}
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items()) and match_expressions(
        selector.get("matchExpressions"), labels
    )


def parse_field_selector(text: str, res: Resource):
    checks = []
    for part in filter(str.strip, (text or "").split(",")):
        m = re.match(r"^\s*([A-Za-z.]+)\s*(==|=|!=)\s*(.*?)\s*$", part)
        if not m:
            raise ApiError.bad_request(f"invalid field selector: {part!r}")
        path, op, value = m.groups()
        if path not in res.field_labels:
            raise ApiError.bad_request(f"field label not supported: {path}")
        checks.append((path, op == "!=", value))
    return lambda obj: all((_field_value(obj, p) == v) != neg for p, neg, v in checks)


def _field_value(obj: dict, path: str) -> str:
    value = obj
    for key in path.split("."):
        value = value.get(key) if isinstance(value, dict) else None
    if isinstance(value, bool):
        return str(value).lower()
    return "" if value is None else str(value)


_SUFFIXES = {
    "": 1,
    "m": Fraction(1, 1000),
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
}


def parse_quantity(quantity) -> Fraction:
    m = re.fullmatch(r"([+-]?[0-9.]+)(?:[eE]([+-]?[0-9]+))?([A-Za-z]*)", str(quantity).strip())
    if not m or m.group(3) not in _SUFFIXES:
        raise ValueError(f"invalid quantity {quantity!r}")
    return Fraction(m.group(1)) * Fraction(10) ** int(m.group(2) or 0) * _SUFFIXES[m.group(3)]


def pod_requests(pod: dict) -> dict[str, Fraction]:
    """Effective requests (limits stand in for missing requests), init containers by max; plus 1 pod."""

    def container(c):
        resources = c.get("resources") or {}
        return {
            k: parse_quantity(v)
            for k, v in {**(resources.get("limits") or {}), **(resources.get("requests") or {})}.items()
        }

    total: dict[str, Fraction] = {"pods": Fraction(1)}
    for c in pod["spec"].get("containers", []):
        for k, v in container(c).items():
            total[k] = total.get(k, 0) + v
    for c in pod["spec"].get("initContainers") or []:
        for k, v in container(c).items():
            total[k] = max(total.get(k, 0), v)
    return total


# ---------------------------------------------------------------------------------------------
# Names.

_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_SUBDOMAIN = re.compile(rf"^{_DNS_LABEL}(\.{_DNS_LABEL})*$")
_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_LABEL_PART = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")


def dns_label_problems(value: str, where: str) -> list[str]:
    """RFC 1123 label: what namespaces, pod hostnames and subdomains must be."""
    if len(value) > 63 or not re.fullmatch(_DNS_LABEL, value):
        return [
            f'{where}: Invalid value: "{value}": a lowercase RFC 1123 label must consist of lower case '
            "alphanumeric characters or '-', and must start and end with an alphanumeric character "
            "(at most 63 characters)"
        ]
    return []


def name_problems(res: Resource, name: str) -> list[str]:
    """The apiserver's name rule per kind: Services are DNS-1035 labels (they become DNS names and
    must start with a letter), Namespaces RFC 1123 labels, Jobs RFC 1123 subdomains of at most 63
    characters (the name becomes a label value on the Job's pods), the rest RFC 1123 subdomains."""
    if res is SERVICE:
        if len(name) > 63 or not _DNS_1035.match(name):
            return [
                f'metadata.name: Invalid value: "{name}": a DNS-1035 label must consist of lower case '
                "alphanumeric characters or '-', start with an alphabetic character, and end with an "
                "alphanumeric character (at most 63 characters)"
            ]
        return []
    if res is NAMESPACE:
        return dns_label_problems(name, "metadata.name")
    if len(name) > 253 or not _DNS_SUBDOMAIN.match(name):
        return [
            f'metadata.name: Invalid value: "{name}": a lowercase RFC 1123 subdomain must consist of lower '
            "case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character"
        ]
    if res is JOB and len(name) > 63:  # the name becomes a label value on the job's pods
        return [f'metadata.name: Invalid value: "{name}": must be no more than 63 characters']
    return []


def label_problems(labels: dict | None, where: str = "metadata.labels") -> list[str]:
    problems = []
    for key, value in (labels or {}).items():
        prefix, _, name = key.rpartition("/")
        if len(name) > 63 or not _LABEL_PART.match(name) or (prefix and not _DNS_SUBDOMAIN.match(prefix)):
            problems.append(
                f'{where}: Invalid value: "{key}": name part must consist of alphanumeric '
                "characters, '-', '_' or '.' (at most 63 characters)"
            )
        if not isinstance(value, str) or len(value) > 63 or (value and not _LABEL_PART.match(value)):
            problems.append(
                f'{where}: Invalid value: "{value}": a valid label must be an empty string or '
                "consist of alphanumeric characters, '-', '_' or '.' (at most 63 characters)"
            )
    return problems


# ---------------------------------------------------------------------------------------------
# Semantic validation: what the apiserver's validation code rejects beyond the OpenAPI schema.


def _is_native_resource(name: str) -> bool:
    return "/" not in name or "kubernetes.io/" in name


def _overcommit_allowed(name: str) -> bool:
    """cpu, memory, ephemeral-storage: a request may be below its limit. Extended resources
    (nvidia.com/gpu, vpc.amazonaws.com/efa) and huge pages: requests must equal limits."""
    return _is_native_resource(name) and not name.startswith("hugepages-")


def resource_problems(resources: dict | None, where: str) -> list[str]:
    resources = resources or {}
    limits = resources.get("limits") or {}
    # The apiserver defaults a missing request to its limit before it validates.
    requests = {**limits, **(resources.get("requests") or {})}
    problems = []
    for name, quantity in requests.items():
        try:
            amount, limit = parse_quantity(quantity), (parse_quantity(limits[name]) if name in limits else None)
        except ValueError as e:
            problems.append(f'{where}.requests[{name}]: Invalid value: "{quantity}": {e}')
            continue
        if limit is None:
            if not _overcommit_allowed(name):
                problems.append(
                    f"{where}.limits: Required value: Limit must be set for non overcommitable resources ({name})"
                )
        elif amount != limit and not _overcommit_allowed(name):
            problems.append(
                f'{where}.requests: Invalid value: "{quantity}": must be equal to {name} limit of {limits[name]}'
            )
        elif amount > limit:
            problems.append(
                f'{where}.requests: Invalid value: "{quantity}": must be less than or equal to '
                f"{name} limit of {limits[name]}"
            )
    named = set(requests) | set(limits)
    if any(n.startswith("hugepages-") for n in named) and not named & {"cpu", "memory"}:
        problems.append(f"{where}: Forbidden: HugePages require cpu or memory")
    return problems


def _containers(spec: dict) -> list[tuple[str, dict]]:
    """(field, container) for init, regular and ephemeral containers, in the pod spec's order."""
    return [
        (f"{kind}[{i}]", c)
        for kind in ("initContainers", "containers", "ephemeralContainers")
        for i, c in enumerate(spec.get(kind) or [])
    ]


def port_problems(value, where: str, allow_zero: bool = False) -> list[str]:
    """A port number (1-65535; 0 too where it means unset), or a named port (IANA_SVC_NAME)."""
    if isinstance(value, str):
        if not re.fullmatch(r"[a-z0-9]([a-z0-9-]{0,13}[a-z0-9])?", value) or "--" in value or value.isdigit():
            return [
                f'{where}: Invalid value: "{value}": must be a valid port name (IANA_SVC_NAME: at most 15 '
                "characters, lower case alphanumeric or '-', at least one letter)"
            ]
        return []
    if isinstance(value, int) and not (1 <= value <= 65535 or (allow_zero and value == 0)):
        return [f"{where}: Invalid value: {value}: must be between 1 and 65535, inclusive"]
    return []


def service_problems(spec: dict) -> list[str]:
    ports, problems, seen = spec.get("ports") or [], [], set()
    for i, port in enumerate(ports):
        at = f"spec.ports[{i}]"
        problems += port_problems(port.get("port"), f"{at}.port")
        problems += port_problems(port.get("targetPort"), f"{at}.targetPort", allow_zero=True)
        if len(ports) > 1 and not port.get("name"):
            problems.append(f"{at}.name: Required value")
        key = (port.get("port"), port.get("protocol", "TCP"))
        if key in seen:
            problems.append(f'{at}: Duplicate value: {{"port": {key[0]}, "protocol": "{key[1]}"}}')
        seen.add(key)
    return problems


def network_policy_problems(spec: dict) -> list[str]:
    problems = []
    for direction, peers in (("ingress", "from"), ("egress", "to")):
        for r, rule in enumerate(spec.get(direction) or []):
            for i, port in enumerate(rule.get("ports") or []):
                at = f"spec.{direction}[{r}].ports[{i}]"
                problems += port_problems(port.get("port"), f"{at}.port")
                if port.get("endPort") is not None and (
                    not isinstance(port.get("port"), int) or port["endPort"] < port["port"]
                ):
                    problems.append(
                        f"{at}.endPort: Invalid value: {port['endPort']}: must be greater than or equal to `port`"
                    )
            for i, peer in enumerate(rule.get(peers) or []):
                if not peer:
                    problems.append(f"spec.{direction}[{r}].{peers}[{i}]: Required value: must specify a peer")
    return problems


def pod_spec_problems(spec: dict, where: str = "spec") -> list[str]:
    problems, seen = [], set()
    for path, c in _containers(spec):
        name = c.get("name", "")
        if name in seen:
            problems.append(f'{where}.{path}.name: Duplicate value: "{name}"')
        seen.add(name)
        problems += resource_problems(c.get("resources"), f"{where}.{path}.resources")
        for i, port in enumerate(c.get("ports") or []):
            problems += port_problems(port.get("containerPort"), f"{where}.{path}.ports[{i}].containerPort")
            problems += port_problems(port.get("hostPort"), f"{where}.{path}.ports[{i}].hostPort", allow_zero=True)
    for key in ("hostname", "subdomain"):
        if spec.get(key):
            problems += dns_label_problems(spec[key], f"{where}.{key}")
    return problems


def pod_failure_policy_problems(spec: dict) -> list[str]:
    """A Job's podFailurePolicy as the apiserver checks it: exit code 0 is never a failure (not
    allowed with In), values unique and ordered, containerName must name a container of the
    template, exactly one of onExitCodes and onPodConditions per rule."""
    template = (spec.get("template") or {}).get("spec") or {}
    names = {c.get("name") for _, c in _containers(template)}
    problems = []
    for r, rule in enumerate((spec.get("podFailurePolicy") or {}).get("rules") or []):
        at = f"spec.podFailurePolicy.rules[{r}]"
        codes, conditions = rule.get("onExitCodes"), rule.get("onPodConditions")
        if codes is not None and conditions is not None:
            problems.append(f"{at}: Invalid value: specifying both OnExitCodes and OnPodConditions is not supported")
        elif codes is None and conditions is None:
            problems.append(f"{at}: Invalid value: specifying one of OnExitCodes and OnPodConditions is required")
        if codes is not None:
            container = codes.get("containerName")
            if container is not None and container not in names:
                problems.append(
                    f'{at}.onExitCodes.containerName: Invalid value: "{container}": must be one of the '
                    "container or initContainer names in the pod template"
                )
            values = codes.get("values") or []
            for i, value in enumerate(values):
                if value == 0 and codes.get("operator") == "In":
                    problems.append(
                        f"{at}.onExitCodes.values[{i}]: Invalid value: 0: must not be 0 for the In operator"
                    )
                if value in values[:i]:
                    problems.append(f"{at}.onExitCodes.values[{i}]: Duplicate value: {value}")
                elif i and values[i - 1] > value:
                    problems.append(f"{at}.onExitCodes.values[{i}]: Invalid value: {value}: must be ordered")
        for i, pattern in enumerate(conditions or []):
            if pattern.get("status") not in ("True", "False", "Unknown"):
                problems.append(
                    f'{at}.onPodConditions[{i}].status: Unsupported value: "{pattern.get("status")}": '
                    'supported values: "True", "False", "Unknown"'
                )
    return problems


#: Template fields a suspended Job that never started may still change (JobMutableNodeSchedulingDirectives).
_SCHEDULING_DIRECTIVES = ("nodeSelector", "tolerations", "affinity", "schedulingGates")


def _short(value) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return text if len(text) <= 200 else text[:197] + "..."


def job_update_problems(old: dict, new: dict) -> list[str]:
    """What the apiserver refuses to change on a Job: selector, completionMode, podFailurePolicy and
    the pod template (except the scheduling directives of a suspended Job that never started)."""
    before, after, problems = old.get("spec") or {}, new.get("spec") or {}, []
    for key in ("selector", "completionMode", "podFailurePolicy"):
        if before.get(key) != after.get(key):
            problems.append(f"spec.{key}: Invalid value: {_short(after.get(key))}: field is immutable")
    if before.get("template") != after.get("template"):

        def without_directives(template):
            template = copy.deepcopy(template or {})
            meta, spec = template.get("metadata") or {}, template.get("spec") or {}
            for key in ("labels", "annotations"):
                meta.pop(key, None)
            for key in _SCHEDULING_DIRECTIVES:
                spec.pop(key, None)
            return template

        never_started = before.get("suspend") and not (old.get("status") or {}).get("startTime")
        if not (
            never_started and without_directives(before.get("template")) == without_directives(after.get("template"))
        ):
            problems.append(f"spec.template: Invalid value: {_short(after.get('template'))}: field is immutable")
    return problems


POD_UPDATE_FORBIDDEN = (
    "spec: Forbidden: pod updates may not change fields other than `spec.containers[*].image`,"
    "`spec.initContainers[*].image`,`spec.activeDeadlineSeconds`,`spec.tolerations` (only "
    "additions to existing tolerations),`spec.terminationGracePeriodSeconds` (allow it to be set "
    "to 1 if it was previously negative)"
)


def pod_update_problems(old: dict, new: dict) -> list[str]:
    """A pod's spec is immutable but for images, activeDeadlineSeconds and added tolerations."""

    def mutable_removed(spec: dict) -> dict:
        spec = copy.deepcopy(spec or {})
        for kind in ("containers", "initContainers"):
            for c in spec.get(kind) or []:
                c.pop("image", None)
        for key in ("activeDeadlineSeconds", "tolerations", "terminationGracePeriodSeconds"):
            spec.pop(key, None)
        return spec

    before, after = old.get("spec") or {}, new.get("spec") or {}
    kept = all(t in (after.get("tolerations") or []) for t in before.get("tolerations") or [])
    return [] if kept and mutable_removed(before) == mutable_removed(after) else [POD_UPDATE_FORBIDDEN]


# ---------------------------------------------------------------------------------------------
# Pod Security admission (the built-in PodSecurity plugin): the baseline and restricted checks
# that apply to the fields a pod of this project could set, with the plugin's messages.

PSA_LEVELS = ("privileged", "baseline", "restricted")
BASELINE_CAPABILITIES = {
    "AUDIT_WRITE",
    "CHOWN",
    "DAC_OVERRIDE",
    "FOWNER",
    "FSETID",
    "KILL",
    "MKNOD",
    "NET_BIND_SERVICE",
    "SETFCAP",
    "SETGID",
    "SETPCAP",
    "SETUID",
    "SYS_CHROOT",
}
RESTRICTED_VOLUME_TYPES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}


def _who(containers: list[dict]) -> str:
    names = ", ".join(f'"{c.get("name", "")}"' for c in containers)
    return f"container {names}" if len(containers) == 1 else f"containers {names}"


def _quoted(values) -> str:
    return ", ".join(f'"{v}"' for v in values)


def pod_security_violations(spec: dict, level: str) -> list[str]:
    """The checks of PodSecurity level ``level`` (privileged, baseline, restricted) that ``spec``
    fails, as the plugin words them (joined by ", " after 'violates PodSecurity "<level>:latest": ')."""
    if level not in ("baseline", "restricted"):
        return []
    containers = [c for _, c in _containers(spec)]
    pod_sc = spec.get("securityContext") or {}

    def sc(c):
        return c.get("securityContext") or {}

    def caps(c, key):
        return list((sc(c).get("capabilities") or {}).get(key) or [])

    out = []
    host = [f"{k}=true" for k in ("hostNetwork", "hostPID", "hostIPC") if spec.get(k)]
    if host:
        out.append(f"host namespaces ({', '.join(host)})")
    privileged = [c for c in containers if sc(c).get("privileged")]
    if privileged:
        out.append(f"privileged ({_who(privileged)} must not set securityContext.privileged=true)")
    extra = [c for c in containers if set(caps(c, "add")) - BASELINE_CAPABILITIES]
    if extra:
        added = sorted({a for c in extra for a in caps(c, "add")} - BASELINE_CAPABILITIES)
        out.append(
            f"non-default capabilities ({_who(extra)} must not include {_quoted(added)} in "
            "securityContext.capabilities.add)"
        )
    host_paths = [v["name"] for v in spec.get("volumes") or [] if "hostPath" in v]
    if host_paths:
        out.append(f"hostPath {'volume' if len(host_paths) == 1 else 'volumes'} ({_quoted(host_paths)})")
    with_ports = [c for c in containers if any(p.get("hostPort") for p in c.get("ports") or [])]
    if with_ports:
        ports = [str(p["hostPort"]) for c in with_ports for p in c.get("ports") or [] if p.get("hostPort")]
        out.append(
            f"hostPort ({_who(with_ports)} {'uses' if len(with_ports) == 1 else 'use'} "
            f"{'hostPort' if len(ports) == 1 else 'hostPorts'} {', '.join(ports)})"
        )
    unconfined = ["pod"] * ((pod_sc.get("seccompProfile") or {}).get("type") == "Unconfined") + [
        _who([c]) for c in containers if (sc(c).get("seccompProfile") or {}).get("type") == "Unconfined"
    ]
    if unconfined:
        out.append(
            f"seccompProfile ({' and '.join(unconfined)} must not set securityContext.seccompProfile.type "
            'to "Unconfined")'
        )
    if level == "baseline":
        return out

    restricted_volumes = [
        (v["name"], t) for v in spec.get("volumes") or [] for t in v if t != "name" and t not in RESTRICTED_VOLUME_TYPES
    ]
    if restricted_volumes:
        names = _quoted(n for n, _ in restricted_volumes)
        types = _quoted(sorted({t for _, t in restricted_volumes}))
        one = len(restricted_volumes) == 1
        out.append(
            f"restricted volume types ({'volume' if one else 'volumes'} {names} "
            f"{'uses restricted volume type' if one else 'use restricted volume types'} {types})"
        )
    escalating = [c for c in containers if sc(c).get("allowPrivilegeEscalation") is not False]
    if escalating:
        out.append(
            f"allowPrivilegeEscalation != false ({_who(escalating)} must set "
            "securityContext.allowPrivilegeEscalation=false)"
        )
    no_drop = [c for c in containers if "ALL" not in caps(c, "drop")]
    adds = [c for c in containers if set(caps(c, "add")) - {"NET_BIND_SERVICE"}]
    if no_drop or adds:
        parts = [f'{_who(no_drop)} must set securityContext.capabilities.drop=["ALL"]'] if no_drop else []
        if adds:
            added = sorted({a for c in adds for a in caps(c, "add")} - {"NET_BIND_SERVICE"})
            parts.append(f"{_who(adds)} must not include {_quoted(added)} in securityContext.capabilities.add")
        out.append(f"unrestricted capabilities ({'; '.join(parts)})")
    explicit_false = [c for c in containers if sc(c).get("runAsNonRoot") is False]
    unset = [] if pod_sc.get("runAsNonRoot") is True else [c for c in containers if sc(c).get("runAsNonRoot") is None]
    if pod_sc.get("runAsNonRoot") is False or explicit_false or unset:
        parts = ["pod must not set securityContext.runAsNonRoot=false"] * (pod_sc.get("runAsNonRoot") is False)
        if explicit_false:
            parts.append(f"{_who(explicit_false)} must not set securityContext.runAsNonRoot=false")
        if unset:
            parts.append(f"pod or {_who(unset)} must set securityContext.runAsNonRoot=true")
        out.append(f"runAsNonRoot != true ({'; '.join(parts)})")
    root = ["pod"] * (pod_sc.get("runAsUser") == 0) + [_who([c]) for c in containers if sc(c).get("runAsUser") == 0]
    if root:
        out.append(f"runAsUser=0 ({' and '.join(root)} must not set runAsUser=0)")
    allowed = ("RuntimeDefault", "Localhost")
    pod_ok = (pod_sc.get("seccompProfile") or {}).get("type") in allowed
    bad = [
        c
        for c in containers
        if (sc(c).get("seccompProfile") or {}).get("type") not in allowed
        and not (pod_ok and not sc(c).get("seccompProfile"))
    ]
    if bad and not unconfined:
        out.append(
            f"seccompProfile (pod or {_who(bad)} must set securityContext.seccompProfile.type to "
            '"RuntimeDefault" or "Localhost")'
        )
    return out


def pod_security_levels(namespace_obj: dict | None) -> tuple[tuple[str, str], tuple[str, str]]:
    """((level, version) to enforce, (level, version) to warn at) from a namespace's
    pod-security.kubernetes.io labels: privileged and latest when unset."""
    labels = ((namespace_obj or {}).get("metadata") or {}).get("labels") or {}
    return tuple(
        (
            labels.get(f"pod-security.kubernetes.io/{mode}", "privileged"),
            labels.get(f"pod-security.kubernetes.io/{mode}-version", "latest"),
        )
        for mode in ("enforce", "warn")
    )


def _condition(type_: str, status: str, reason: str = "", message: str = "", probe: bool = False) -> dict:
    out = {"type": type_, "status": status, "lastTransitionTime": now()}
    if probe:
        out["lastProbeTime"] = out["lastTransitionTime"]
    if reason:
        out["reason"] = reason
    if message:
        out["message"] = message
    return out


def _set_condition(conditions: list, new: dict) -> None:
    for i, old in enumerate(conditions):
        if old["type"] == new["type"]:
            if old["status"] == new["status"]:
                new["lastTransitionTime"] = old.get("lastTransitionTime", new["lastTransitionTime"])
            conditions[i] = new
            return
    conditions.append(new)


def _has_condition(obj: dict, type_: str, status: str = "True") -> bool:
    return any(c["type"] == type_ and c["status"] == status for c in obj.get("status", {}).get("conditions") or [])


def tolerates(tolerations: list[dict], taint: dict) -> bool:
    for t in tolerations or []:
        if t.get("effect") and t["effect"] != taint["effect"]:
            continue
        if t.get("operator", "Equal") == "Exists":
            if not t.get("key") or t["key"] == taint["key"]:
                return True
        elif t.get("key") == taint["key"] and (t.get("value") or "") == (taint.get("value") or ""):
            return True
    return False


def compress_indexes(indexes) -> str:
    """{0,1,2,5} -> "0-2,5", as status.completedIndexes writes it."""
    runs = []
    for i in sorted(indexes):
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


@dataclass
class _JobState:
    """What the real controller keeps in status + pod finalizers: which pods were counted."""

    succeeded_indexes: set = field(default_factory=set)
    succeeded: int = 0
    failed: int = 0
    counted: set = field(default_factory=set)


# ---------------------------------------------------------------------------------------------
# The server.


class FakeKube:
    """An in-memory apiserver + job controller + scheduler behind http://127.0.0.1:<port>."""

    def __init__(self, *, seed: int = 0, start: bool = True):
        global _clock_offset
        _clock_offset = 0.0  # the wall clock, until a test ticks it
        self._lock = threading.RLock()
        self._store: dict[Resource, dict[tuple[str, str], dict]] = {r: {} for r in RESOURCES.values()}
        self._rv = itertools.count(1000)
        self._last_rv = 1000
        self._random = random.Random(seed)
        self._job_state: dict[str, _JobState] = {}
        self._scheduling_events: dict[str, str] = {}
        self._pod_ips = itertools.count(2)
        self._last_event_ns = 0
        self._created: dict[str, int] = {}  # uid -> creation order, for the scheduler's queue
        #: Every request, in order: verbs as RBAC names them (get, list, watch, create, ...).
        self.requests: list[Request] = []
        #: Container logs: `logs[(namespace, pod)]` or `logs[(namespace, pod, container)] = "text"`.
        self.logs: dict[tuple, str] = {}
        #: Handler crashes (answered 500): a test can assert this stays empty.
        self.errors: list[str] = []
        #: Whether pods' ServiceAccount, PriorityClass and PVC references must exist (set by load()).
        self.check_references = False
        #: Objects load() was given that this fake does not serve (kept for a test to look at).
        self.unserved: list[dict] = []
        self._tokens: dict[str, object] = {}  # bearer token -> kube_authz.UserInfo
        self._user = None  # who makes the request being served
        self._warnings: list[str] = []  # Warning headers of the request being served
        self._authorizer = None  # kube_authz.RbacAuthorizer once RBAC is loaded
        self._admission = None  # kube_authz.AdmissionPolicies once VAPs are loaded
        self._after_read: dict[str, list[dict]] = {}  # node name -> taints a "second controller" adds
        self._create_failures: dict[str, str] = {}  # job uid -> last FailedCreate message
        self._lost_nodes: set[str] = set()  # nodes whose kubelet is gone (lose_node)
        self._server: ThreadingHTTPServer | None = None
        if start:
            self.start()

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> FakeKube:
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._server.daemon_threads = True
        self._server.kube = self
        threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="fake-kube-apiserver", daemon=True
        ).start()
        return self

    def tick(self, seconds: float = 1.0) -> None:
        """Let time pass for every timestamp the fake writes from now on (creationTimestamp,
        startTime, conditions...). The apiserver writes whole seconds, and everything here is
        immediate, so a test that tells objects apart by when they were made (a pod the Job
        controller recreated later) ticks between the two. Undone by ``stop``."""
        global _clock_offset
        _clock_offset += seconds

    def stop(self) -> None:
        global _clock_offset
        _clock_offset = 0.0
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> FakeKube:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def token_for(self, user) -> str:
        """A bearer token that authenticates as ``user`` (a kube_authz.UserInfo) on this server."""
        token = "fake-" + uuid.uuid5(uuid.NAMESPACE_URL, f"{user.username}|{'|'.join(user.groups)}").hex
        self._tokens[token] = user
        return token

    def kubeconfig(self, path, namespace: str = "default", user=None) -> Path:
        """Write a kubeconfig (JSON is YAML) for this server with ``user``'s bearer token (default:
        kube_authz.ADMIN, in system:masters); returns its path."""
        path = Path(path)
        token = self.token_for(user or _authz().ADMIN)
        path.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "fake",
                    "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
                    "users": [{"name": "fake", "user": {"token": token}}],
                    "contexts": [
                        {"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": namespace}}
                    ],
                },
                indent=2,
            )
        )
        return path

    def airflow_connection(self, kubeconfig_path, namespace: str = "default") -> str:
        """A value for AIRFLOW_CONN_<ID> that points the cncf.kubernetes hooks at this server."""
        return json.dumps(
            {"conn_type": "kubernetes", "extra": {"kube_config_path": str(kubeconfig_path), "namespace": namespace}}
        )

    # -- test helpers: seeding and flipping state -------------------------------------------

    def load(self, objects) -> None:
        """Store a deploy kit's objects (as kubectl apply would, replacing what exists) and make the
        cluster as strict as the kit makes a real one: pods' ServiceAccount, PriorityClass and PVC
        references must exist from now on; RBAC objects switch on authorization (403) for every
        request; ValidatingAdmissionPolicies and their bindings switch on admission. Objects of a
        kind this fake does not serve are kept in ``unserved``."""
        with self._lock:
            for obj in objects:
                res = KINDS.get((obj.get("apiVersion"), obj.get("kind")))
                if res is None:
                    self.unserved.append(copy.deepcopy(obj))
                    continue
                obj = copy.deepcopy(obj)
                namespace = (obj.get("metadata") or {}).get("namespace") or ("default" if res.namespaced else "")
                self._validate(res, obj)
                self._store[res].pop((namespace if res.namespaced else "", obj["metadata"]["name"]), None)
                if res is PVC:
                    obj["status"] = {
                        "phase": "Bound",
                        "accessModes": obj["spec"].get("accessModes", []),
                        "capacity": (obj["spec"].get("resources") or {}).get("requests", {}),
                    }
                self._insert(res, obj, namespace)
            self.check_references = True
            self._refresh_policies()
            self._resync()

    def add_namespace(self, name: str, labels: dict | None = None) -> dict:
        """Store a Namespace (e.g. with pod-security.kubernetes.io/* labels); replaces one stored."""
        with self._lock:
            self._store[NAMESPACE].pop(("", name), None)
            namespace = {
                "metadata": {"name": name, "labels": {"kubernetes.io/metadata.name": name, **(labels or {})}},
                "spec": {"finalizers": ["kubernetes"]},
                "status": {"phase": "Active"},
            }
            self._insert(NAMESPACE, namespace, "")
            return copy.deepcopy(namespace)

    def add_node_taint(self, name: str, taint: dict) -> dict:
        """Another controller (the node lifecycle controller, Karpenter) adds a taint to a node now:
        its resourceVersion changes, so a write based on an older read conflicts."""
        with self._lock:
            node = self._get(NODE, "", name)
            taints = node["spec"].setdefault("taints", [])
            if not any((t["key"], t["effect"]) == (taint["key"], taint["effect"]) for t in taints):
                taints.append(
                    {**copy.deepcopy(taint), **({"timeAdded": now()} if taint["effect"] == "NoExecute" else {})}
                )
            self._touch(node)
            return copy.deepcopy(node)

    def taint_on_next_read(self, name: str, taint: dict) -> None:
        """Arm the race a real cluster has: right after the next client read (get or list) that
        returns node ``name``, a second controller adds ``taint`` to it (add_node_taint). A
        read-modify-write patch without the resourceVersion it read then drops that taint; one
        with it gets 409 Conflict and can read again."""
        with self._lock:
            self._after_read.setdefault(name, []).append(copy.deepcopy(taint))

    def add_node(
        self,
        name: str,
        *,
        ready: bool = True,
        labels: dict | None = None,
        taints: list | None = None,
        allocatable: dict | None = None,
        provider_id: str | None = None,
        conditions: list | None = None,
        unschedulable: bool = False,
    ) -> dict:
        """Seed a Ready (or NotReady) node; allocatable adds to cpu 96 / memory 1Ti / pods 110."""
        with self._lock:
            resources = {
                "cpu": "96",
                "memory": "1Ti",
                "pods": "110",
                "ephemeral-storage": "500Gi",
                **{k: str(v) for k, v in (allocatable or {}).items()},
            }
            instance = "i-" + uuid.uuid5(uuid.NAMESPACE_DNS, name).hex[:17]
            node = {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {
                    "name": name,
                    "labels": {
                        "kubernetes.io/hostname": name,
                        "kubernetes.io/os": "linux",
                        "kubernetes.io/arch": "amd64",
                        **(labels or {}),
                    },
                },
                "spec": {"providerID": provider_id or f"aws:///us-west-2a/{instance}"},
                "status": {
                    "capacity": dict(resources),
                    "allocatable": dict(resources),
                    "conditions": [
                        _condition(t, "False", f"Kubelet Has No {t}")
                        for t in ("MemoryPressure", "DiskPressure", "PIDPressure")
                    ]
                    + [
                        _condition(
                            "Ready",
                            "True" if ready else "False",
                            "KubeletReady" if ready else "KubeletNotReady",
                            "kubelet is posting ready status" if ready else "container runtime is down",
                        )
                    ],
                    "addresses": [
                        {"type": "InternalIP", "address": f"10.1.{len(self._store[NODE]) % 250}.10"},
                        {"type": "Hostname", "address": name},
                    ],
                    "nodeInfo": {
                        "architecture": "amd64",
                        "bootID": str(uuid.uuid4()),
                        "containerRuntimeVersion": "containerd://1.7.27",
                        "kernelVersion": "6.1.0",
                        "kubeProxyVersion": "",
                        "kubeletVersion": f"v{KUBERNETES_VERSION}.0-eks",
                        "machineID": instance,
                        "operatingSystem": "linux",
                        "osImage": "Amazon Linux 2023",
                        "systemUUID": instance,
                    },
                },
            }
            for c in conditions or []:
                _set_condition(
                    node["status"]["conditions"],
                    _condition(c["type"], c["status"], c.get("reason", ""), c.get("message", "")),
                )
            for key, value in (("taints", taints), ("unschedulable", unschedulable or None)):
                if value:
                    node["spec"][key] = copy.deepcopy(value)
            self._insert(NODE, node, "")
            self._retry_pending()
            return copy.deepcopy(node)

    def set_node_condition(self, name: str, type: str, status: str, reason: str = "", message: str = "") -> None:
        with self._lock:
            node = self._get(NODE, "", name)
            _set_condition(node["status"]["conditions"], _condition(type, status, reason, message))
            self._touch(node)
            self._retry_pending()

    def remove_node(self, name: str) -> None:
        """The node is gone (PodGC): its pods fail with a DisruptionTarget condition and are deleted."""
        with self._lock:
            self._remove_node(name, "DeletionByPodGC", "PodGC: node no longer exists")

    def lose_node(self, name: str, *, evict_pods: bool = True) -> None:
        """The node stops reporting (its instance died or lost its network). The node lifecycle
        controller marks it Ready=Unknown and taints it unreachable (NoSchedule and NoExecute).
        With ``evict_pods`` (the pods' tolerationSeconds, 300 by default, have passed: immediate
        here), its taint manager deletes the pods on it: each gets DisruptionTarget
        (DeletionByTaintManager) and a deletionTimestamp but stays Terminating with its phase
        unchanged, since no kubelet is left to end it. Under podReplacementPolicy Failed (the
        default with a podFailurePolicy) the Job controller replaces such a pod only once it is
        terminal: ``remove_node`` (PodGC, after the node object is deleted) marks it Failed."""
        with self._lock:
            node = self._get(NODE, "", name)
            self._lost_nodes.add(name)
            message = "Kubelet stopped posting node status."
            for type_ in ("Ready", "MemoryPressure", "DiskPressure", "PIDPressure"):
                _set_condition(node["status"]["conditions"], _condition(type_, "Unknown", "NodeStatusUnknown", message))
            taints = node["spec"].setdefault("taints", [])
            for effect in ("NoSchedule", "NoExecute"):
                if not any(t.get("key") == UNREACHABLE_TAINT and t.get("effect") == effect for t in taints):
                    taints.append(
                        {
                            "key": UNREACHABLE_TAINT,
                            "effect": effect,
                            **({"timeAdded": now()} if effect == "NoExecute" else {}),
                        }
                    )
            self._touch(node)
            for pod in [
                p
                for p in self._store[POD].values()
                if p["spec"].get("nodeName") == name
                and p["status"]["phase"] in ACTIVE_PHASES
                and not p["metadata"].get("deletionTimestamp")
            ]:
                conditions = pod["status"].setdefault("conditions", [])
                for type_ in ("Ready", "ContainersReady"):
                    _set_condition(conditions, _condition(type_, "False", "NodeLost", message))
                if evict_pods:
                    _set_condition(
                        conditions,
                        _condition(
                            "DisruptionTarget",
                            "True",
                            "DeletionByTaintManager",
                            "Taint manager: deleting due to NoExecute taint",
                        ),
                    )
                    pod["metadata"].update(
                        deletionTimestamp=now(),
                        deletionGracePeriodSeconds=int(pod["spec"].get("terminationGracePeriodSeconds", 30)),
                    )
                self._touch(pod)
                job = self._owner_job(pod)
                if job is not None and not self._finished(job):
                    self._sync_job(job)

    def add_nodeclaim(self, name: str, node_name: str, *, nodepool: str = "default") -> dict:
        with self._lock:
            node = self._store[NODE].get(("", node_name))
            claim = {
                "apiVersion": "karpenter.sh/v1",
                "kind": "NodeClaim",
                "metadata": {
                    "name": name,
                    "labels": {"karpenter.sh/nodepool": nodepool},
                    "finalizers": ["karpenter.sh/termination"],
                },
                "spec": {
                    "nodeClassRef": {"group": "karpenter.k8s.aws", "kind": "EC2NodeClass", "name": "default"},
                    "requirements": [],
                },
                "status": {
                    "nodeName": node_name,
                    "providerID": node["spec"]["providerID"] if node else "",
                    "conditions": [_condition(t, "True") for t in ("Launched", "Registered", "Initialized", "Ready")],
                },
            }
            self._insert(NODECLAIM, claim, "")
            return copy.deepcopy(claim)

    def terminate_pod(
        self,
        namespace: str,
        name: str,
        exit_code: int,
        reason: str | None = None,
        message: str = "",
        container: str | None = None,
    ) -> None:
        """The pod's container (default: the first) exits: phase Succeeded on 0, else Failed."""
        with self._lock:
            pod = self._get(POD, namespace, name)
            self._mark_terminal(pod, exit_code, reason, message, container)
            self._after_pod_change(pod)

    def succeed_pods(self, namespace: str, job_name: str) -> None:
        with self._lock:
            for pod in self._owned_pods(self._get(JOB, namespace, job_name)):
                if pod["status"]["phase"] in ACTIVE_PHASES:
                    self._mark_terminal(pod, 0)
                    self._after_pod_change(pod)

    def set_pod_log(self, namespace: str, name: str, text: str, container: str | None = None) -> None:
        self.logs[(namespace, name, container) if container else (namespace, name)] = text

    def pods(self, namespace: str, job_name: str | None = None) -> list[dict]:
        with self._lock:
            return [
                copy.deepcopy(p)
                for (ns, _), p in sorted(self._store[POD].items())
                if ns == namespace
                and (job_name is None or p["metadata"].get("labels", {}).get(LABEL_JOB_NAME) == job_name)
            ]

    def pod(self, namespace: str, name: str) -> dict:
        with self._lock:
            return copy.deepcopy(self._get(POD, namespace, name))

    def node(self, name: str) -> dict:
        with self._lock:
            return copy.deepcopy(self._get(NODE, "", name))

    def nodes(self) -> list[dict]:
        with self._lock:
            return [copy.deepcopy(n) for _, n in sorted(self._store[NODE].items())]

    def job(self, namespace: str, name: str) -> dict:
        with self._lock:
            return copy.deepcopy(self._get(JOB, namespace, name))

    def nodeclaim(self, name: str) -> dict:
        with self._lock:
            return copy.deepcopy(self._get(NODECLAIM, "", name))

    def events(self, namespace: str, involved_name: str | None = None) -> list[dict]:
        with self._lock:
            events = sorted(self._store[EVENT].values(), key=lambda e: int(e["metadata"]["resourceVersion"]))
            return [
                copy.deepcopy(e)
                for e in events
                if e["metadata"]["namespace"] == namespace and involved_name in (None, e["involvedObject"].get("name"))
            ]

    def rbac_usage(self) -> set[tuple[str, str, str]]:
        """(api_group, resource[/subresource], verb) for every request so far: what a Role must grant."""
        return {
            (r.api_group, f"{r.resource}/{r.subresource}" if r.subresource else r.resource, r.verb)
            for r in self.requests
        }

    def clear_requests(self) -> None:
        self.requests.clear()

    # -- authorization and admission -----------------------------------------------------------

    def _refresh_policies(self) -> None:
        """Rebuild the authorizer and the admission policies from the stored objects."""
        rbac = [o for r in RBAC_RESOURCES for o in self._store[r].values()]
        admission = [o for r in ADMISSION_RESOURCES for o in self._store[r].values()]
        self._authorizer = _authz().RbacAuthorizer(copy.deepcopy(rbac)) if rbac else None
        self._admission = _authz().AdmissionPolicies(copy.deepcopy(admission)) if admission else None

    def _resync(self) -> None:
        """After a referenced object appears: jobs retry their pods, pending pods the scheduler."""
        for job in list(self._store[JOB].values()):
            if job["metadata"]["uid"] in self._job_state and not self._finished(job):
                self._sync_job(job)
        self._retry_pending()

    def _namespace(self, name: str) -> dict:
        stored = self._store[NAMESPACE].get(("", name))
        return stored or {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": name, "labels": {"kubernetes.io/metadata.name": name}},
            "spec": {"finalizers": ["kubernetes"]},
            "status": {"phase": "Active"},
        }

    def _admit(
        self, operation: str, res: Resource, sub: str, namespace: str, name: str, obj: dict | None, old: dict | None
    ) -> None:
        """ValidatingAdmissionPolicies for a client's (or the job controller's) write; the fake's
        own writes (events, status) are not admitted."""
        if self._admission is None or self._user is None:
            return
        denied = self._admission.admit(
            self._user,
            operation,
            res.group,
            res.version,
            res.plural,
            sub,
            namespace if res.namespaced else "",
            name,
            copy.deepcopy(obj),
            copy.deepcopy(old),
            copy.deepcopy(self._namespace(namespace)) if res.namespaced else None,
        )
        for policy, binding, message in getattr(self._admission, "warnings", None) or []:
            self._warnings.append(
                f"Validation failed for ValidatingAdmissionPolicy '{policy}' with binding '{binding}': {message}"
            )
        if denied:
            code, message = denied
            raise ApiError(
                code,
                {401: "Unauthorized", 403: "Forbidden", 422: "Invalid"}.get(code, "BadRequest"),
                message,
                {"name": name, "group": res.group, "kind": res.plural},
            )

    def _pod_admission(self, pod: dict, namespace: str) -> None:
        """Mutating admission (ServiceAccount, Priority) and PodSecurity for a new pod."""
        meta, spec = pod["metadata"], pod["spec"]
        name = meta.get("name") or meta.get("generateName", "")

        def forbidden(why: str) -> ApiError:
            return ApiError(403, "Forbidden", f'pods "{name}" is forbidden: {why}', {"name": name, "kind": "pods"})

        account = spec.get("serviceAccountName", "default")
        if self.check_references and account != "default" and (namespace, account) not in self._store[SERVICEACCOUNT]:
            raise forbidden(
                f'error looking up service account {namespace}/{account}: serviceaccount "{account}" not found'
            )
        if spec.get("priorityClassName"):
            priority_class = self._store[PRIORITYCLASS].get(("", spec["priorityClassName"]))
            value = (priority_class or {}).get("value", SYSTEM_PRIORITY_CLASSES.get(spec["priorityClassName"]))
            if value is None and self.check_references:
                raise forbidden(f"no PriorityClass with name {spec['priorityClassName']} was found")
            if value is not None:
                spec["priority"] = value
        (enforce, version), warn = pod_security_levels(self._namespace(namespace))
        violations = pod_security_violations(spec, enforce)
        if violations:
            raise forbidden(f'violates PodSecurity "{enforce}:{version}": ' + ", ".join(violations))
        self._warn_pod_security(spec, warn)

    def _warn_pod_security(self, spec: dict, *levels: tuple[str, str]) -> None:
        for level, version in dict.fromkeys(levels):
            violations = pod_security_violations(spec, level)
            if violations:
                self._warnings.append(f'would violate PodSecurity "{level}:{version}": ' + ", ".join(violations))

    # -- store ------------------------------------------------------------------------------

    def _next_rv(self) -> str:
        self._last_rv = next(self._rv)
        return str(self._last_rv)

    def _touch(self, obj: dict) -> None:
        obj["metadata"]["resourceVersion"] = self._next_rv()

    def _get(self, res: Resource, namespace: str, name: str) -> dict:
        obj = self._store[res].get((namespace if res.namespaced else "", name))
        if obj is None:
            raise ApiError.not_found(res, name)
        return obj

    def _random_suffix(self) -> str:
        return "".join(self._random.choice("bcdfghjklmnpqrstvwxz2456789") for _ in range(5))

    def _insert(self, res: Resource, obj: dict, namespace: str, dry_run: bool = False) -> dict:
        """Fill server-set metadata, check names, store (unless dry_run); 409 on a duplicate."""
        meta = obj.setdefault("metadata", {})
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise ApiError.invalid(res, "", ["metadata.name: Required value: name or generateName is required"])
            meta["name"] = meta["generateName"][:58] + self._random_suffix()
        name = meta["name"]
        if res.namespaced:
            if meta.get("namespace") not in (None, "", namespace):
                raise ApiError.bad_request(
                    "the namespace of the provided object does not match the namespace sent on the request"
                )
            meta["namespace"] = namespace
        else:
            meta.pop("namespace", None)
        if res is NAMESPACE:  # the apiserver labels every namespace with its name, and it is Active
            meta["labels"] = {**(meta.get("labels") or {}), "kubernetes.io/metadata.name": name}
            obj.setdefault("spec", {"finalizers": ["kubernetes"]})
            obj.setdefault("status", {"phase": "Active"})
        problems = name_problems(res, name) + label_problems(meta.get("labels"))
        if problems:
            raise ApiError.invalid(res, name, problems)
        key = (namespace if res.namespaced else "", name)
        if key in self._store[res]:
            raise ApiError(
                409,
                "AlreadyExists",
                f'{res.qualified} "{name}" already exists',
                {"name": name, "group": res.group, "kind": res.plural},
            )
        meta.update(uid=str(uuid.uuid4()), resourceVersion=self._next_rv(), creationTimestamp=now(), generation=1)
        self._created[meta["uid"]] = self._last_rv
        obj["apiVersion"], obj["kind"] = res.api_version, res.kind
        if not dry_run:
            self._store[res][key] = obj
        return obj

    def _remove(self, res: Resource, obj: dict) -> None:
        self._store[res].pop((obj["metadata"].get("namespace", ""), obj["metadata"]["name"]), None)

    def _validate(self, res: Resource, obj: dict, schema_file: str | None = None) -> None:
        schema_file = schema_file or res.schema_file
        if schema_file:
            problems = schema_problems(obj, schema_file)
            if problems:
                raise ApiError.invalid(res, (obj.get("metadata") or {}).get("name", ""), problems)

    def _event_clock(self) -> int:
        self._last_event_ns = max(time.time_ns(), self._last_event_ns + 1)
        return self._last_event_ns

    def _emit(self, involved: dict, reason: str, message: str, component: str, type_: str = "Normal") -> None:
        meta = involved["metadata"]
        ns = meta.get("namespace") or "default"
        stamp = now()
        self._insert(
            EVENT,
            {
                # Named like the real recorder (<object>.<hex UnixNano>): lists sort oldest first.
                "metadata": {"name": f"{meta['name']}.{self._event_clock():x}"},
                "involvedObject": {
                    "kind": involved["kind"],
                    "namespace": meta.get("namespace", ""),
                    "name": meta["name"],
                    "uid": meta["uid"],
                    "apiVersion": involved["apiVersion"],
                    "resourceVersion": meta["resourceVersion"],
                },
                "reason": reason,
                "message": message,
                "type": type_,
                "source": {"component": component},
                "firstTimestamp": stamp,
                "lastTimestamp": stamp,
                "count": 1,
                "reportingComponent": component,
                "reportingInstance": "",
            },
            ns,
        )

    # -- pods -------------------------------------------------------------------------------

    def _create_pod(self, pod: dict, namespace: str, dry_run: bool = False) -> dict:
        spec = pod["spec"]
        for key, default in (
            ("restartPolicy", "Always"),
            ("schedulerName", "default-scheduler"),
            ("dnsPolicy", "ClusterFirst"),
            ("terminationGracePeriodSeconds", 30),
            ("serviceAccountName", "default"),
            ("priority", 0),
        ):
            spec.setdefault(key, default)
        # DefaultTolerationSeconds admission: ride out short not-ready/unreachable spells.
        tolerations = spec.setdefault("tolerations", [])
        for key in ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"):
            if not any(t.get("key") == key and t.get("effect") in (None, "NoExecute") for t in tolerations):
                tolerations.append({"key": key, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300})
        pod["status"] = {"phase": "Pending", "qosClass": "BestEffort"}
        problems = pod_spec_problems(spec)
        if problems:
            raise ApiError.invalid(
                POD, pod["metadata"].get("name") or pod["metadata"].get("generateName", ""), problems
            )
        self._pod_admission(pod, namespace)
        self._admit("CREATE", POD, "", namespace, pod["metadata"].get("name", ""), pod, None)
        self._insert(POD, pod, namespace, dry_run)
        if not dry_run:
            self._schedule(pod)
        return pod

    def _nodes_fit(self, pod: dict) -> tuple[dict | None, str]:
        """The node the pod goes to (least loaded, then name), or None and the scheduler's message."""
        nodes = [n for _, n in sorted(self._store[NODE].items())]
        preemption = (
            f"preemption: 0/{len(nodes)} nodes are available: {len(nodes)} Preemption is not helpful for scheduling."
        )
        for volume in pod["spec"].get("volumes") or [] if self.check_references else []:
            claim = (volume.get("persistentVolumeClaim") or {}).get("claimName")
            if claim and (pod["metadata"]["namespace"], claim) not in self._store[PVC]:
                return None, (
                    f'0/{len(nodes)} nodes are available: persistentvolumeclaim "{claim}" not found. {preemption}'
                )
        bound = [
            p for p in self._store[POD].values() if p["spec"].get("nodeName") and p["status"]["phase"] in ACTIVE_PHASES
        ]
        reasons: dict[str, int] = {}
        fits = []
        for node in nodes:
            reason = self._unfit_reason(pod, node, bound)
            if reason:
                reasons[reason] = reasons.get(reason, 0) + 1
            else:
                name = node["metadata"]["name"]
                fits.append((sum(p["spec"]["nodeName"] == name for p in bound), name, node))
        if fits:
            return min(fits, key=lambda f: f[:2])[2], ""
        if not nodes:
            return None, "no nodes available to schedule pods"
        detail = ", ".join(f"{n} {r}" for r, n in sorted(reasons.items()))
        return None, f"0/{len(nodes)} nodes are available: {detail}. {preemption}"

    def _unfit_reason(self, pod: dict, node: dict, bound: list[dict]) -> str | None:
        spec, labels, name = pod["spec"], node["metadata"].get("labels") or {}, node["metadata"]["name"]
        tolerations = spec.get("tolerations")
        if node["spec"].get("unschedulable") and not tolerates(
            tolerations, {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}
        ):
            return "node(s) were unschedulable"
        taints = list(node["spec"].get("taints") or [])
        if not _has_condition(node, "Ready"):
            taints.append({"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"})
        for taint in taints:
            if taint["effect"] in ("NoSchedule", "NoExecute") and not tolerates(tolerations, taint):
                return f"node(s) had untolerated taint {{{taint['key']}: {taint.get('value', '')}}}"
        affinity = spec.get("affinity") or {}
        required = (affinity.get("nodeAffinity") or {}).get("requiredDuringSchedulingIgnoredDuringExecution") or {}
        terms = required.get("nodeSelectorTerms")
        if any(labels.get(k) != v for k, v in (spec.get("nodeSelector") or {}).items()) or (
            terms and not any(match_expressions(t.get("matchExpressions"), labels) for t in terms)
        ):
            return "node(s) didn't match Pod's node affinity/selector"
        used: dict[str, Fraction] = {}
        for other in bound:
            if other["spec"]["nodeName"] == name:
                for k, v in pod_requests(other).items():
                    used[k] = used.get(k, 0) + v
        allocatable = node["status"].get("allocatable") or {}
        for resource, amount in sorted(pod_requests(pod).items()):
            basic = resource in ("cpu", "memory", "ephemeral-storage", "pods") or resource.startswith("hugepages-")
            if amount <= 0 or (basic and resource not in allocatable):
                continue  # a node need not list the basics; an extended resource it lacks is 0
            if parse_quantity(allocatable.get(resource, "0")) - used.get(resource, 0) < amount:
                return "Too many pods" if resource == "pods" else f"Insufficient {resource}"
        if not self._anti_affinity_ok(pod, node, bound):
            return "node(s) didn't match pod anti-affinity rules"
        return None

    def _anti_affinity_ok(self, pod: dict, node: dict, bound: list[dict]) -> bool:
        def terms(p):
            anti = (p["spec"].get("affinity") or {}).get("podAntiAffinity") or {}
            return anti.get("requiredDuringSchedulingIgnoredDuringExecution") or []

        def conflicts(owner, term, other, owner_node, other_node):
            key = term["topologyKey"]
            namespaces = term.get("namespaces") or [owner["metadata"]["namespace"]]
            value = (owner_node["metadata"].get("labels") or {}).get(key)
            return (
                value is not None
                and (other_node["metadata"].get("labels") or {}).get(key) == value
                and other["metadata"]["namespace"] in namespaces
                and match_label_selector(term.get("labelSelector"), other["metadata"].get("labels"))
            )

        for other in bound:
            other_node = self._store[NODE].get(("", other["spec"]["nodeName"]))
            if other_node is None or other is pod:
                continue
            if any(conflicts(pod, t, other, node, other_node) for t in terms(pod)) or any(
                conflicts(other, t, pod, other_node, node) for t in terms(other)
            ):
                return False
        return True

    def _schedule(self, pod: dict) -> None:
        node, message = self._nodes_fit(pod)
        name = pod["metadata"]["name"]
        conditions = pod["status"].setdefault("conditions", [])
        if node is None:
            pod["status"]["phase"] = "Pending"
            _set_condition(conditions, _condition("PodScheduled", "False", "Unschedulable", message, probe=True))
            self._touch(pod)
            if self._scheduling_events.get(pod["metadata"]["uid"]) != message:
                self._scheduling_events[pod["metadata"]["uid"]] = message
                self._emit(pod, "FailedScheduling", message, "default-scheduler", "Warning")
            return
        stamp, node_name = now(), node["metadata"]["name"]
        ip = next(self._pod_ips)
        pod["spec"]["nodeName"] = node_name
        host_ip = next(a["address"] for a in node["status"]["addresses"] if a["type"] == "InternalIP")
        pod["status"].update(
            phase="Running",
            hostIP=host_ip,
            hostIPs=[{"ip": host_ip}],
            podIP=f"10.0.{ip // 250}.{ip % 250}",
            podIPs=[{"ip": f"10.0.{ip // 250}.{ip % 250}"}],
            startTime=stamp,
            containerStatuses=[
                {
                    "name": c["name"],
                    "image": c.get("image", ""),
                    "imageID": f"{c.get('image', '')}@sha256:{'0' * 64}",
                    "containerID": f"containerd://{uuid.uuid4().hex}",
                    "ready": True,
                    "started": True,
                    "restartCount": 0,
                    "state": {"running": {"startedAt": stamp}},
                }
                for c in pod["spec"]["containers"]
            ],
        )
        for type_ in ("PodScheduled", "Initialized", "PodReadyToStartContainers", "ContainersReady", "Ready"):
            _set_condition(conditions, _condition(type_, "True"))
        self._touch(pod)
        self._emit(
            pod,
            "Scheduled",
            f"Successfully assigned {pod['metadata']['namespace']}/{name} to {node_name}",
            "default-scheduler",
        )

    def _retry_pending(self) -> None:
        """The scheduler's retry: after nodes change or pods leave, pending pods try again (oldest first)."""
        pending = sorted(
            (
                p
                for p in self._store[POD].values()
                if p["status"]["phase"] == "Pending" and not p["spec"].get("nodeName")
            ),
            key=lambda p: self._created[p["metadata"]["uid"]],
        )
        for pod in pending:
            self._schedule(pod)
            if pod["status"]["phase"] == "Running" and (job := self._owner_job(pod)):
                self._refresh_job_status(job)

    def _mark_terminal(
        self,
        pod: dict,
        exit_code: int,
        reason: str | None = None,
        message: str = "",
        container: str | None = None,
        disruption: tuple[str, str] | None = None,
        killed: bool = False,
    ) -> None:
        """Containers exit (the named or first one with exit_code); the pod reaches Succeeded/Failed.
        killed: stopped from outside (deletion); containers that never started report no exit code."""
        stamp = now()
        ran = pod["status"]["phase"] == "Running"
        statuses = {s["name"]: s for s in pod["status"].get("containerStatuses") or []}
        target = container or pod["spec"]["containers"][0]["name"]
        new = []
        for c in pod["spec"]["containers"]:
            status = statuses.get(c["name"]) or {
                "name": c["name"],
                "image": c.get("image", ""),
                "imageID": "",
                "restartCount": 0,
            }
            code = exit_code if c["name"] == target else (0 if exit_code == 0 else SIGTERM_EXIT_CODE)
            terminated = {
                "exitCode": code,
                "reason": (reason if c["name"] == target and reason else ("Completed" if code == 0 else "Error")),
                "startedAt": (status.get("state", {}).get("running") or {}).get("startedAt", stamp),
                "finishedAt": stamp,
            }
            if message and c["name"] == target:
                terminated["message"] = message
            if ran or not killed:
                status["state"] = {"terminated": terminated}
            status.update(ready=False, started=False)
            new.append(status)
        pod["status"].update(phase="Succeeded" if exit_code == 0 else "Failed", containerStatuses=new)
        conditions = pod["status"].setdefault("conditions", [])
        if disruption and not _has_condition(pod, "DisruptionTarget"):
            _set_condition(conditions, _condition("DisruptionTarget", "True", *disruption))
        for type_ in ("Ready", "ContainersReady"):
            if any(c["type"] == type_ for c in conditions):
                _set_condition(
                    conditions, _condition(type_, "False", "PodCompleted" if exit_code == 0 else "PodFailed")
                )
        self._touch(pod)

    def _delete_pod(self, pod: dict, disruption: tuple[str, str] | None = None, force: bool = False) -> dict:
        """Delete a pod with no grace period: a live pod's containers get SIGTERM first. On a node
        lost with ``lose_node`` no kubelet is left to end it: unless forced (gracePeriodSeconds=0,
        PodGC), it only gets its deletionTimestamp (and DisruptionTarget) and stays Terminating."""
        if pod["spec"].get("nodeName") in self._lost_nodes and not force and pod["status"]["phase"] in ACTIVE_PHASES:
            if disruption and not _has_condition(pod, "DisruptionTarget"):
                _set_condition(
                    pod["status"].setdefault("conditions", []), _condition("DisruptionTarget", "True", *disruption)
                )
            pod["metadata"].setdefault("deletionTimestamp", now())
            pod["metadata"].setdefault(
                "deletionGracePeriodSeconds", int(pod["spec"].get("terminationGracePeriodSeconds", 30))
            )
            self._touch(pod)
            job = self._owner_job(pod)
            if job is not None and not self._finished(job):
                self._sync_job(job)
            return pod
        if pod["status"]["phase"] in ACTIVE_PHASES:
            self._mark_terminal(pod, SIGTERM_EXIT_CODE, disruption=disruption, killed=True)
        pod["metadata"].update(deletionTimestamp=now(), deletionGracePeriodSeconds=0)
        self._remove(POD, pod)
        self._after_pod_change(pod)
        return pod

    def _after_pod_change(self, pod: dict) -> None:
        job = self._owner_job(pod)
        if job is not None:
            if pod["status"]["phase"] in ("Succeeded", "Failed"):
                self._account(job, pod)
            self._sync_job(job)
        self._retry_pending()

    def _remove_node(self, name: str, reason: str, message: str) -> dict:
        node = self._get(NODE, "", name)
        self._remove(NODE, node)
        for pod in [p for p in self._store[POD].values() if p["spec"].get("nodeName") == name]:
            self._delete_pod(pod, disruption=(reason, message), force=True)
        self._lost_nodes.discard(name)
        return node

    # -- jobs -------------------------------------------------------------------------------

    def _create_job(self, job: dict, namespace: str, dry_run: bool = False) -> dict:
        spec, name = job["spec"], (job.get("metadata") or {}).get("name", "")
        template_spec = spec["template"].setdefault("spec", {})
        problems = []
        if template_spec.get("restartPolicy") not in ("Never", "OnFailure"):
            problems.append('spec.template.spec.restartPolicy: Required value: valid values: "OnFailure", "Never"')
        if spec.get("podFailurePolicy") and template_spec.get("restartPolicy") != "Never":
            problems.append(
                'spec.template.spec.restartPolicy: Invalid value: only "Never" is supported '
                "when podFailurePolicy is specified"
            )
        if spec.get("completionMode") == "Indexed" and spec.get("completions") is None:
            problems.append("spec.completions: Required value: when completion mode is Indexed")
        problems += label_problems(
            (spec["template"].get("metadata") or {}).get("labels"), "spec.template.metadata.labels"
        )
        problems += pod_failure_policy_problems(spec) + pod_spec_problems(template_spec, "spec.template.spec")
        if problems:
            raise ApiError.invalid(JOB, name, problems)
        # PodSecurity only warns about a workload's template (the job controller's pods are enforced).
        self._warn_pod_security(template_spec, *pod_security_levels(self._namespace(namespace)))
        self._admit("CREATE", JOB, "", namespace, name, job, None)
        replacement = "Failed" if spec.get("podFailurePolicy") else "TerminatingOrFailed"
        for key, default in (
            ("completions", 1),
            ("parallelism", 1),
            ("backoffLimit", 6),
            ("completionMode", "NonIndexed"),
            ("suspend", False),
            ("podReplacementPolicy", replacement),
        ):
            spec.setdefault(key, default)
        job["status"] = {}
        self._insert(JOB, job, namespace, dry_run)
        uid, name = job["metadata"]["uid"], job["metadata"]["name"]
        selector_labels = {LABEL_CONTROLLER_UID: uid}
        spec.setdefault("selector", {"matchLabels": selector_labels})
        template_meta = spec["template"].setdefault("metadata", {})
        template_meta["labels"] = {
            **(template_meta.get("labels") or {}),
            LABEL_CONTROLLER_UID: uid,
            LABEL_JOB_NAME: name,
            "controller-uid": uid,
            "job-name": name,
        }
        if not dry_run:
            self._job_state[uid] = _JobState()
            self._sync_job(job)
        return job

    def _owner_job(self, pod: dict) -> dict | None:
        for ref in pod["metadata"].get("ownerReferences") or []:
            if ref.get("kind") == "Job" and ref.get("controller"):
                job = self._store[JOB].get((pod["metadata"]["namespace"], ref["name"]))
                if job is not None and job["metadata"]["uid"] == ref["uid"]:
                    return job
        return None

    def _owned_pods(self, job: dict) -> list[dict]:
        uid = job["metadata"]["uid"]
        return [
            p
            for _, p in sorted(self._store[POD].items())
            if any(r.get("uid") == uid for r in p["metadata"].get("ownerReferences") or [])
        ]

    @staticmethod
    def _index(pod: dict) -> int | None:
        value = (pod["metadata"].get("annotations") or {}).get(LABEL_INDEX)
        return int(value) if value is not None else None

    @staticmethod
    def _terminating(pod: dict) -> bool:
        """Deleted but not yet terminal: only a pod on a lost node stays so here (no kubelet)."""
        return pod["status"]["phase"] in ACTIVE_PHASES and bool(pod["metadata"].get("deletionTimestamp"))

    def _active_and_terminating(self, job: dict) -> tuple[list[dict], list[dict]]:
        """The job's active pods (not being deleted) and its terminating ones, as the controller
        counts them (status.active, status.terminating)."""
        live = [p for p in self._owned_pods(job) if p["status"]["phase"] in ACTIVE_PHASES]
        return [p for p in live if not self._terminating(p)], [p for p in live if self._terminating(p)]

    @staticmethod
    def _finished(job: dict) -> bool:
        return _has_condition(job, "Complete") or _has_condition(job, "Failed") or _has_condition(job, "FailureTarget")

    def _failure_policy_action(self, job: dict, pod: dict) -> tuple[str, str]:
        """The first podFailurePolicy rule the failed pod matches: (action, message); ("Count", "") if none."""
        index = self._index(pod)
        where = f"pod {pod['metadata']['namespace']}/{pod['metadata']['name']}"
        statuses = (pod["status"].get("initContainerStatuses") or []) + (pod["status"].get("containerStatuses") or [])
        for rule in (job["spec"].get("podFailurePolicy") or {}).get("rules") or []:
            on_codes, on_conditions = rule.get("onExitCodes"), rule.get("onPodConditions")
            if on_codes:
                for status in statuses:
                    code = ((status.get("state") or {}).get("terminated") or {}).get("exitCode")
                    if code in (None, 0) or on_codes.get("containerName") not in (None, status["name"]):
                        continue
                    if (code in on_codes["values"]) == (on_codes["operator"] == "In"):
                        return rule["action"], (
                            f"Container {status['name']} for {where} failed with exit code "
                            f"{code} matching {rule['action']} rule at index {index}"
                        )
            for pattern in on_conditions or []:
                if _has_condition(pod, pattern["type"], pattern.get("status", "True")):
                    return rule["action"], (
                        f"Pod {pod['metadata']['namespace']}/{pod['metadata']['name']} has "
                        f"condition {pattern['type']} matching {rule['action']} rule "
                        f"at index {index}"
                    )
        return "Count", ""

    def _account(self, job: dict, pod: dict) -> None:
        """Count a terminal pod once, applying podFailurePolicy and backoffLimit."""
        state = self._job_state[job["metadata"]["uid"]]
        if pod["metadata"]["uid"] in state.counted:
            return
        state.counted.add(pod["metadata"]["uid"])
        if pod["status"]["phase"] == "Succeeded":
            state.succeeded += 1
            if self._index(pod) is not None and not self._finished(job):
                state.succeeded_indexes.add(self._index(pod))
            return
        action, message = ("Count", "") if self._finished(job) else self._failure_policy_action(job, pod)
        if action == "Ignore":
            return
        state.failed += 1
        if self._finished(job):
            return
        if action == "FailJob":
            self._fail_job(job, "PodFailurePolicy", message)
        elif state.failed > job["spec"]["backoffLimit"]:
            self._fail_job(job, "BackoffLimitExceeded", "Job has reached the specified backoff limit")

    def _fail_job(self, job: dict, reason: str, message: str) -> None:
        conditions = job["status"].setdefault("conditions", [])
        for type_ in ("FailureTarget", "Failed"):
            _set_condition(conditions, _condition(type_, "True", reason, message, probe=True))
        self._emit(job, reason, message, "job-controller", "Warning")
        for pod in self._owned_pods(job):
            if pod["status"]["phase"] in ACTIVE_PHASES and not self._terminating(pod):
                self._mark_terminal(pod, SIGTERM_EXIT_CODE, killed=True)
                pod["metadata"]["deletionTimestamp"] = now()
                self._remove(POD, pod)
                self._account(job, pod)
                self._emit(job, "SuccessfulDelete", f"Deleted pod: {pod['metadata']['name']}", "job-controller")

    def _sync_job(self, job: dict) -> None:
        """The job controller's sync: create the missing pods, then complete the job or refresh status."""
        spec, state = job["spec"], self._job_state[job["metadata"]["uid"]]
        if spec.get("suspend") and not self._finished(job):
            self._suspend(job)
        if not self._finished(job) and not spec.get("suspend"):
            job["status"].setdefault("startTime", now())
            active, terminating = self._active_and_terminating(job)
            # podReplacementPolicy Failed: a pod being deleted (Terminating) keeps its place, and
            # its index, until it is terminal; TerminatingOrFailed replaces it at once.
            waiting = terminating if spec["podReplacementPolicy"] == "Failed" else []
            room = spec["parallelism"] - len(active) - len(waiting)
            if spec["completionMode"] == "Indexed":
                busy = state.succeeded_indexes | {self._index(p) for p in active + waiting}
                for index in [i for i in range(spec["completions"]) if i not in busy][: max(room, 0)]:
                    if not self._create_job_pod(job, index):
                        break
                done = len(state.succeeded_indexes) >= spec["completions"]
            else:
                for _ in range(max(0, min(room, spec["completions"] - state.succeeded - len(active) - len(waiting)))):
                    if not self._create_job_pod(job, None):
                        break
                done = state.succeeded >= spec["completions"]
            if done:
                conditions = job["status"].setdefault("conditions", [])
                for type_ in ("SuccessCriteriaMet", "Complete"):
                    _set_condition(
                        conditions,
                        _condition(
                            type_, "True", "CompletionsReached", "Reached expected number of succeeded pods", probe=True
                        ),
                    )
                job["status"]["completionTime"] = now()
                self._emit(job, "Completed", "Job completed", "job-controller")
        self._refresh_job_status(job)

    def _suspend(self, job: dict) -> None:
        """A suspended Job: the controller deletes its active pods (their ends do not count against
        backoffLimit) and says so in a Suspended condition; the Job and its finished pods stay."""
        conditions = job["status"].setdefault("conditions", [])
        if not _has_condition(job, "Suspended"):
            _set_condition(conditions, _condition("Suspended", "True", "JobSuspended", "Job suspended", probe=True))
            self._emit(job, "Suspended", "Job suspended", "job-controller")
        state = self._job_state[job["metadata"]["uid"]]
        for pod in self._owned_pods(job):
            if self._terminating(pod):  # deleted already, on a lost node: it stays until PodGC
                state.counted.add(pod["metadata"]["uid"])
            elif pod["status"]["phase"] in ACTIVE_PHASES:
                self._mark_terminal(pod, SIGTERM_EXIT_CODE, killed=True)
                pod["metadata"]["deletionTimestamp"] = now()
                state.counted.add(pod["metadata"]["uid"])  # not a failure: the job was suspended
                self._remove(POD, pod)
                self._emit(job, "SuccessfulDelete", f"Deleted pod: {pod['metadata']['name']}", "job-controller")

    def _refresh_job_status(self, job: dict) -> None:
        state, status = self._job_state[job["metadata"]["uid"]], job["status"]
        active, terminating = self._active_and_terminating(job)
        # active/succeeded/failed are omitempty in the real API; ready/terminating are pointers (always there).
        for key, value in (("active", len(active)), ("succeeded", state.succeeded), ("failed", state.failed)):
            if value:
                status[key] = value
            else:
                status.pop(key, None)
        status["ready"] = sum(_has_condition(p, "Ready") for p in active)
        status["terminating"] = len(terminating)
        status["uncountedTerminatedPods"] = {}
        if job["spec"]["completionMode"] == "Indexed" and state.succeeded_indexes:
            status["completedIndexes"] = compress_indexes(state.succeeded_indexes)
        self._touch(job)

    def _create_job_pod(self, job: dict, index: int | None) -> dict | None:
        """Create one pod of the job as the job controller does (its ServiceAccount, through
        admission); a refused pod is a FailedCreate Warning event on the job (once per message)."""
        user, warnings = self._user, self._warnings  # the controller's own request: not the client's
        self._user, self._warnings = self._job_controller_user(), []
        try:
            pod = self._build_job_pod(job, index)
        except ApiError as e:
            uid = job["metadata"]["uid"]
            if self._create_failures.get(uid) != e.message:
                self._create_failures[uid] = e.message
                self._emit(job, "FailedCreate", f"Error creating: {e.message}", "job-controller", "Warning")
            return None
        finally:
            self._user, self._warnings = user, warnings
        self._create_failures.pop(job["metadata"]["uid"], None)
        self._emit(job, "SuccessfulCreate", f"Created pod: {pod['metadata']['name']}", "job-controller")
        return pod

    def _job_controller_user(self):
        return _authz().service_account_user("kube-system", "job-controller") if self._admission else None

    def _build_job_pod(self, job: dict, index: int | None) -> dict:
        name, template = job["metadata"]["name"], copy.deepcopy(job["spec"]["template"])
        meta, spec = template.get("metadata") or {}, template["spec"]
        suffix = f"-{index}-" if index is not None else "-"
        meta.pop("name", None)
        meta["generateName"] = name[: 58 - len(suffix)] + suffix
        meta["ownerReferences"] = [
            {
                "apiVersion": "batch/v1",
                "kind": "Job",
                "name": name,
                "uid": job["metadata"]["uid"],
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
        if index is not None:
            meta["labels"][LABEL_INDEX] = str(index)
            meta["annotations"] = {**(meta.get("annotations") or {}), LABEL_INDEX: str(index)}
            spec["hostname"] = f"{name}-{index}"
            for c in spec.get("containers", []) + (spec.get("initContainers") or []):
                c["env"] = [
                    *(c.get("env") or []),
                    {
                        "name": "JOB_COMPLETION_INDEX",
                        "valueFrom": {
                            "fieldRef": {"apiVersion": "v1", "fieldPath": f"metadata.annotations['{LABEL_INDEX}']"}
                        },
                    },
                ]
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}
        self._create_pod(pod, job["metadata"]["namespace"])
        return pod

    def _delete_job(self, job: dict, policy: str) -> None:
        pods = self._owned_pods(job)
        self._remove(JOB, job)  # first, so that deleted pods are not replaced
        for pod in pods:
            if policy == "Orphan":
                pod["metadata"]["ownerReferences"] = [
                    r for r in pod["metadata"]["ownerReferences"] if r.get("uid") != job["metadata"]["uid"]
                ]
                self._touch(pod)
            else:
                self._delete_pod(pod)
        # The garbage collector: what else the Job owns (its Service, NetworkPolicy) goes with it,
        # or loses its owner reference when orphaned.
        uid = job["metadata"]["uid"]
        for res in (SERVICE, NETWORKPOLICY, CONFIGMAP):
            for obj in [
                o
                for o in self._store[res].values()
                if any(r.get("uid") == uid for r in o["metadata"].get("ownerReferences") or [])
            ]:
                if policy == "Orphan":
                    obj["metadata"]["ownerReferences"] = [
                        r for r in obj["metadata"]["ownerReferences"] if r.get("uid") != uid
                    ]
                    self._touch(obj)
                else:
                    self._remove(res, obj)
        self._job_state.pop(uid, None)

    # -- HTTP dispatch ----------------------------------------------------------------------

    def _authenticate(self, authorization: str):
        """The request's user: its bearer token's, system:anonymous without one, 401 for a token
        this server never issued."""
        if not authorization:
            enforcing = self._authorizer is not None or self._admission is not None
            return _authz().UserInfo("system:anonymous", ("system:unauthenticated",)) if enforcing else None
        scheme, _, token = authorization.partition(" ")
        user = self._tokens.get(token.strip()) if scheme.lower() == "bearer" else None
        if user is None:
            raise ApiError(401, "Unauthorized", "Unauthorized")
        return user

    def _dispatch(self, method: str, path: str, query: dict, content_type: str, raw: bytes, authorization: str = ""):
        """Route one request: (status code, JSON-able or text payload, extra headers)."""
        with self._lock:
            user = self._authenticate(authorization)
            self._user, self._warnings = user, []
            try:
                code, payload, headers = self._route(method, path, query, content_type, raw)
            finally:
                self._user = None
            if self._warnings:
                headers = {
                    **headers,
                    "Warning": [f'299 - "{w}"' for w in self._warnings]
                    + ([headers["Warning"]] if "Warning" in headers else []),
                }
            return code, payload, headers

    def _route(self, method: str, path: str, query: dict, content_type: str, raw: bytes):
        parts = [p for p in path.split("/") if p]
        if parts in (["version"],):
            return (
                200,
                {
                    "major": "1",
                    "minor": KUBERNETES_VERSION.split(".")[1],
                    "emulationMajor": "1",
                    "emulationMinor": KUBERNETES_VERSION.split(".")[1],
                    "minCompatibilityMajor": "1",
                    "minCompatibilityMinor": str(int(KUBERNETES_VERSION.split(".")[1]) - 1),
                    "gitVersion": f"v{KUBERNETES_VERSION}.0-eks-fake",
                    "gitCommit": "0" * 40,
                    "gitTreeState": "clean",
                    "buildDate": "2025-04-23T00:00:00Z",
                    "goVersion": "go1.24.2",
                    "compiler": "gc",
                    "platform": "linux/amd64",
                },
                {},
            )
        if parts == ["api"]:
            return (
                200,
                {
                    "kind": "APIVersions",
                    "versions": ["v1"],
                    "serverAddressByClientCIDRs": [
                        {"clientCIDR": "0.0.0.0/0", "serverAddress": f"127.0.0.1:{self.port}"}
                    ],
                },
                {},
            )
        if parts == ["apis"]:
            groups = sorted({(r.group, r.version) for r in RESOURCES.values() if r.group})
            return (
                200,
                {
                    "kind": "APIGroupList",
                    "apiVersion": "v1",
                    "groups": [
                        {
                            "name": g,
                            "versions": [{"groupVersion": f"{g}/{v}", "version": v}],
                            "preferredVersion": {"groupVersion": f"{g}/{v}", "version": v},
                        }
                        for g, v in groups
                    ],
                },
                {},
            )
        if len(parts) >= 2 and parts[0] == "api":
            group, version, rest = "", parts[1], parts[2:]
        elif len(parts) >= 3 and parts[0] == "apis":
            group, version, rest = parts[1], parts[2], parts[3:]
        else:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        if not rest:
            resources = [r for r in RESOURCES.values() if (r.group, r.version) == (group, version)]
            if not resources:
                raise ApiError(404, "NotFound", "the server could not find the requested resource")
            return (
                200,
                {
                    "kind": "APIResourceList",
                    "apiVersion": "v1",
                    "groupVersion": resources[0].api_version,
                    "resources": [
                        {
                            "name": r.plural,
                            "singularName": r.kind.lower(),
                            "namespaced": r.namespaced,
                            "kind": r.kind,
                            "verbs": ["create", "delete", "deletecollection", "get", "list", "patch", "update"],
                        }
                        for r in resources
                    ],
                },
                {},
            )
        namespace = ""
        if rest[0] == "namespaces" and len(rest) >= 3:
            namespace, rest = rest[1], rest[2:]
        if len(rest) > 3:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        plural, name, sub = rest[0], rest[1] if len(rest) > 1 else "", rest[2] if len(rest) > 2 else ""
        res = RESOURCES.get((group, plural))
        verb = {
            "GET": "get" if name else ("watch" if query.get("watch") in ("true", "1") else "list"),
            "POST": "create",
            "PUT": "update",
            "PATCH": "patch",
            "DELETE": "delete" if name else "deletecollection",
        }.get(method, method.lower())
        with self._lock:
            body, bad_body = None, None
            if raw:
                try:
                    body = json.loads(raw)
                except ValueError as e:
                    bad_body = ApiError.bad_request(f"the request body is not JSON: {e}")
            # RBAC sees no name on a create (the URL has none); the record names the object made.
            named = name or (
                ((body.get("metadata") or {}).get("name") or "")
                if verb == "create" and not sub and isinstance(body, dict) and isinstance(body.get("metadata"), dict)
                else ""
            )
            self.requests.append(Request(verb, group, plural, sub, namespace, named, self._user))
            if self._authorizer is not None:
                denied = self._authorizer.authorize(self._user, verb, group, plural, sub, namespace, name)
                if denied:
                    raise ApiError(403, "Forbidden", denied, {"name": name, "group": group, "kind": plural})
            if res is None or res.version != version or (namespace and not res.namespaced):
                raise ApiError(404, "NotFound", "the server could not find the requested resource")
            if bad_body:
                raise bad_body
            return self._serve(res, verb, method, namespace, name, sub, query, content_type, body)

    def _serve(
        self,
        res: Resource,
        verb: str,
        method: str,
        namespace: str,
        name: str,
        sub: str,
        query: dict,
        content_type: str,
        body,
    ):
        allowed_sub = {POD: {"", "log", "eviction", "status"}, JOB: {"", "status"}}.get(res, {""})
        # Subresources: pods/log (get), pods/eviction (create), */status (get, update, patch).
        if (
            sub not in allowed_sub
            or (sub == "eviction") != (verb == "create" and bool(name))
            or (sub == "log" and verb != "get")
        ):
            raise ApiError(
                405,
                "MethodNotAllowed",
                f"{method} is not supported on {res.qualified}{'/' + sub if sub else ''} by this fake apiserver",
            )
        if verb == "watch":
            raise ApiError.bad_request("watch is not supported by the fake apiserver; poll with list")
        if res is NAMESPACE and verb in ("get", "list"):
            return self._serve_namespace(verb, name)
        if verb == "list":
            listing = self._list(res, namespace, query)
            if res is NODE:
                self._after_node_read([n["metadata"]["name"] for n in listing["items"]])
            return 200, listing, {}
        if verb == "get" and sub == "log":
            return 200, self._log(namespace, name, query), {"Content-Type": "text/plain"}
        if verb == "get":
            obj = copy.deepcopy(self._get(res, namespace, name))
            if res is NODE:
                self._after_node_read([name])
            return 200, obj, {}
        if verb in ("create", "update", "patch") and not isinstance(
            body, list if "json-patch" in content_type else dict
        ):
            raise ApiError.bad_request(
                f"{verb} needs a JSON {'list' if 'json-patch' in content_type else 'object'} body"
            )
        options = body if verb in ("delete", "deletecollection") and isinstance(body, dict) else {}
        if verb == "create" and sub == "eviction":
            return self._evict(namespace, name, body)
        if verb == "create":
            return 201, copy.deepcopy(self._create(res, namespace, body, query.get("dryRun") == "All")), {}
        if verb in ("update", "patch"):
            return 200, copy.deepcopy(self._modify(res, namespace, name, sub, verb, content_type, body)), {}
        if verb == "delete":
            return self._delete(res, self._get(res, namespace, name), query, options)
        if verb == "deletecollection":
            selected = self._select(res, namespace, query)
            for obj in selected:
                self._delete(res, obj, query, options)
            return 200, self._list_body(res, selected), {}
        raise ApiError(405, "MethodNotAllowed", f"{method} is not supported")

    def _serve_namespace(self, verb: str, name: str):
        """Stored namespaces (load, add_namespace, create) and, as if created on first use, those
        that hold objects, plus default and kube-system."""
        names = sorted(
            {"default", "kube-system"}
            | {n for _, n in self._store[NAMESPACE]}
            | {ns for r in RESOURCES.values() if r.namespaced for ns, _ in self._store[r]}
        )
        if verb == "get":
            return 200, copy.deepcopy(self._namespace(name)), {}
        return (
            200,
            {
                "kind": "NamespaceList",
                "apiVersion": "v1",
                "metadata": {"resourceVersion": str(self._last_rv)},
                "items": [
                    {k: v for k, v in copy.deepcopy(self._namespace(n)).items() if k not in ("kind", "apiVersion")}
                    for n in names
                ],
            },
            {},
        )

    def _after_node_read(self, names: list[str]) -> None:
        """The second controller armed by taint_on_next_read acts right after the read."""
        for name in names:
            for taint in self._after_read.pop(name, []):
                if ("", name) in self._store[NODE]:
                    self.add_node_taint(name, taint)

    def _select(self, res: Resource, namespace: str, query: dict) -> list[dict]:
        labels = parse_label_selector(query.get("labelSelector", ""))
        fields = parse_field_selector(query.get("fieldSelector", ""), res)
        return [
            obj
            for (ns, _), obj in sorted(self._store[res].items())
            if (not namespace or ns == namespace) and labels(obj["metadata"].get("labels")) and fields(obj)
        ]

    def _list_body(self, res: Resource, items: list[dict], cont: str = "") -> dict:
        metadata = {"resourceVersion": str(self._last_rv)}
        if cont:
            metadata["continue"] = cont
        # Built-in lists carry no kind/apiVersion per item; custom resources do.
        items = [
            copy.deepcopy(o)
            if res.group == "karpenter.sh"
            else {k: copy.deepcopy(v) for k, v in o.items() if k not in ("kind", "apiVersion")}
            for o in items
        ]
        return {"kind": f"{res.kind}List", "apiVersion": res.api_version, "metadata": metadata, "items": items}

    def _list(self, res: Resource, namespace: str, query: dict) -> dict:
        items = self._select(res, namespace, query)
        start = int(query.get("continue") or 0)
        limit = int(query.get("limit") or 0)
        if limit and start + limit < len(items):
            return self._list_body(res, items[start : start + limit], str(start + limit))
        return self._list_body(res, items[start:])

    def _log(self, namespace: str, name: str, query: dict) -> str:
        pod = self._get(POD, namespace, name)
        containers = [c["name"] for c in pod["spec"]["containers"]]
        container = query.get("container")
        if container is None and len(containers) > 1:
            raise ApiError.bad_request(
                f"a container name must be specified for pod {name}, choose one of: [{' '.join(containers)}]"
            )
        container = container or containers[0]
        if container not in containers:
            raise ApiError.bad_request(f"container {container} is not valid for pod {name}")
        if not pod["spec"].get("nodeName"):
            raise ApiError.bad_request(
                f'container "{container}" in pod "{name}" is waiting to start: ContainerCreating'
            )
        text = self.logs.get((namespace, name, container), self.logs.get((namespace, name), ""))
        if query.get("tailLines") is not None:
            lines = text.splitlines(keepends=True)
            tail = int(query["tailLines"])
            text = "".join(lines[-tail:]) if tail > 0 else ""
        if query.get("limitBytes"):
            text = text.encode()[: int(query["limitBytes"])].decode(errors="ignore")
        return text

    def _create(self, res: Resource, namespace: str, body: dict, dry_run: bool) -> dict:
        obj = normalize_times(copy.deepcopy(body))
        obj.setdefault("apiVersion", res.api_version)
        obj.setdefault("kind", res.kind)
        if (obj["apiVersion"], obj["kind"]) != (res.api_version, res.kind):
            raise ApiError.bad_request(
                f"the body is a {obj['apiVersion']} {obj['kind']}, but the request is for {res.api_version} {res.kind}"
            )
        self._validate(res, obj)
        if res is POD:
            return self._create_pod(obj, namespace, dry_run)
        if res is JOB:
            return self._create_job(obj, namespace, dry_run)
        problems = {SERVICE: service_problems, NETWORKPOLICY: network_policy_problems}.get(res, lambda _: [])(
            obj.get("spec") or {}
        )
        if problems:
            raise ApiError.invalid(res, (obj.get("metadata") or {}).get("name", ""), problems)
        if res is SERVICE:
            spec = obj.setdefault("spec", {})
            spec.setdefault("type", "ClusterIP")
            spec.setdefault("clusterIP", f"172.20.{self._random.randrange(256)}.{self._random.randrange(1, 255)}")
            spec.setdefault("sessionAffinity", "None")
            for port in spec.get("ports") or []:
                port.setdefault("protocol", "TCP")
                port.setdefault("targetPort", port.get("port"))
            obj["status"] = {"loadBalancer": {}}
        meta = obj.get("metadata") or {}
        self._admit("CREATE", res, "", namespace, meta.get("name") or meta.get("generateName", ""), obj, None)
        self._insert(res, obj, namespace, dry_run)
        if not dry_run:
            self._after_write(res)
        return obj

    def _after_write(self, res: Resource) -> None:
        """What a stored object's change sets off: policies rebuilt, jobs and pods retried."""
        if res in RBAC_RESOURCES or res in ADMISSION_RESOURCES:
            self._refresh_policies()
        if res in (SERVICEACCOUNT, PRIORITYCLASS, PVC, NAMESPACE):
            self._resync()
        elif res is NODE:
            self._retry_pending()

    def _modify(self, res: Resource, namespace: str, name: str, sub: str, verb: str, content_type: str, body) -> dict:
        current = self._get(res, namespace, name)
        kind = content_type.split(";")[0].strip().lower()
        try:
            if verb == "update":
                new = copy.deepcopy(body)
            elif kind == "application/json-patch+json":
                new = json_patch(current, body)
            elif kind == "application/merge-patch+json":
                new = merge_patch(current, body)
            elif kind == "application/strategic-merge-patch+json":
                if not res.definition:
                    raise ApiError(
                        415,
                        "UnsupportedMediaType",
                        "the body of the request was in an unknown "
                        "format - accepted media types include: application/json-patch+json, "
                        "application/merge-patch+json, application/apply-patch+yaml",
                    )
                new = strategic_merge(current, body, {"$ref": f"#/$defs/{res.definition}"})
            else:
                raise ApiError(
                    415,
                    "UnsupportedMediaType",
                    f"the body of the request was in an unknown format - "
                    f"{kind or 'no Content-Type'} is not supported by this fake apiserver",
                )
        except (KeyError, IndexError, ValueError, TypeError) as e:
            raise ApiError(422, "Invalid", f"the server rejected the patch: {e}") from None
        if not isinstance(new, dict):
            raise ApiError.bad_request("the patched object is not a JSON object")
        new = normalize_times(new)
        # Optimistic concurrency: a body (or patch) that carries a resourceVersion must carry the
        # stored one; without one an update or patch applies to whatever is stored.
        want = (new.get("metadata") or {}).get("resourceVersion") if isinstance(new.get("metadata"), dict) else None
        if want and want != current["metadata"]["resourceVersion"]:
            raise ApiError(
                409,
                "Conflict",
                f'Operation cannot be fulfilled on {res.qualified} "{name}": '
                "the object has been modified; please apply your changes to the latest "
                "version and try again",
                {"name": name, "group": res.group, "kind": res.plural},
            )
        # The main resource ignores status changes, the status subresource everything else.
        kept = current if sub == "status" else new
        status = new.get("status") if sub == "status" else current.get("status")
        new = {**copy.deepcopy(kept), "status": copy.deepcopy(status)}
        if new["status"] is None:
            new.pop("status")
        new["metadata"] = {
            **(new.get("metadata") or {}),
            **{
                k: current["metadata"][k]
                for k in ("name", "namespace", "uid", "creationTimestamp", "generation")
                if k in current["metadata"]
            },
        }
        new["apiVersion"], new["kind"] = res.api_version, res.kind
        self._validate(res, new)
        problems = label_problems(new["metadata"].get("labels"))
        if res is JOB:
            problems += job_update_problems(current, new) + pod_failure_policy_problems(new["spec"])
        if res is POD and sub != "status":
            problems += pod_update_problems(current, new)
        if res in (SERVICE, NETWORKPOLICY):
            problems += (service_problems if res is SERVICE else network_policy_problems)(new.get("spec") or {})
        if problems:
            raise ApiError.invalid(res, name, problems)
        self._admit("UPDATE", res, sub, namespace, name, new, current)
        current.clear()
        current.update(new)
        self._touch(current)
        if res is JOB and sub != "status":
            self._sync_job(current)  # e.g. a raised parallelism gets its pods
        if res in (NODE, POD):
            self._retry_pending()
        else:
            self._after_write(res)
        return current

    def _evict(self, namespace: str, name: str, body: dict):
        eviction = copy.deepcopy(body)
        eviction.setdefault("apiVersion", "policy/v1")
        eviction.setdefault("kind", "Eviction")
        problems = schema_problems(eviction, EVICTION_SCHEMA)
        if problems:
            raise ApiError(422, "Invalid", f'Eviction.policy "{name}" is invalid: ' + "; ".join(problems))
        if (eviction.get("metadata") or {}).get("name") not in (None, name):
            raise ApiError.bad_request("name in URL does not match name in Eviction object")
        pod = self._get(POD, namespace, name)
        self._admit("CREATE", POD, "eviction", namespace, name, eviction, None)
        self._delete_pod(pod, disruption=("EvictionByEvictionAPI", "Eviction API: evicting"))
        return 201, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}, {}

    def _delete(self, res: Resource, obj: dict, query: dict, options: dict):
        details = {
            "name": obj["metadata"]["name"],
            "group": res.group,
            "kind": res.plural,
            "uid": obj["metadata"]["uid"],
        }
        success = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "details": details}
        self._admit("DELETE", res, "", obj["metadata"].get("namespace", ""), obj["metadata"]["name"], None, obj)
        if res is POD:
            grace = query.get("gracePeriodSeconds", options.get("gracePeriodSeconds"))
            return 200, copy.deepcopy(self._delete_pod(obj, force=str(grace) == "0")), {}
        if res is JOB:
            policy = query.get("propagationPolicy") or options.get("propagationPolicy")
            if options.get("orphanDependents") is not None and not policy:
                policy = "Orphan" if options["orphanDependents"] else "Background"
            self._delete_job(obj, policy or "Orphan")
            return 200, success, ({} if policy else {"Warning": JOB_DELETE_WARNING})
        if res is NODE:
            self._remove_node(obj["metadata"]["name"], "DeletionByPodGC", "PodGC: node no longer exists")
            return 200, success, {}
        if res is NODECLAIM:
            # Karpenter's termination finalizer: drain (evict) the node's pods, then the node goes.
            node = obj.get("status", {}).get("nodeName")
            if node and ("", node) in self._store[NODE]:
                self._remove_node(node, "EvictionByEvictionAPI", "Eviction API: evicting")
            obj["metadata"]["deletionTimestamp"] = now()
            self._remove(res, obj)
            return 200, copy.deepcopy(obj), {}
        self._remove(res, obj)
        self._after_write(res)
        return 200, success, {}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as urllib3 and aiohttp expect
    disable_nagle_algorithm = True  # headers and body are two writes: without this, +40 ms per request

    def log_message(self, format, *args):  # noqa: A002 - quiet: no stderr line per request
        pass

    def _handle(self, method: str) -> None:
        kube: FakeKube = self.server.kube
        url = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        headers: dict = {}
        try:
            code, payload, headers = kube._dispatch(
                method,
                url.path,
                query,
                self.headers.get("Content-Type", ""),
                raw,
                self.headers.get("Authorization", ""),
            )
        except ApiError as e:
            code, payload = e.code, e.status()
        except Exception as e:  # a bug in the fake: answer 500 and keep it for the test to see
            kube.errors.append(f"{method} {self.path}: {e!r}")
            code, payload = 500, ApiError(500, "InternalError", f"fake apiserver crashed: {e!r}").status()
        data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", headers.pop("Content-Type", "application/json"))
        for key, values in headers.items():
            for value in values if isinstance(values, list) else [values]:
                self.send_header(key, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._handle("GET")

    def do_POST(self):
        self._handle("POST")

    def do_PUT(self):
        self._handle("PUT")

    def do_PATCH(self):
        self._handle("PATCH")

    def do_DELETE(self):
        self._handle("DELETE")


@pytest.fixture
def fake_kube():
    """A running FakeKube, stopped after the test. Import it into a test module to use it."""
    with FakeKube() as kube:
        yield kube
