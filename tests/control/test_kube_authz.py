"""The fake apiserver's authorization and admission (tests/control/kube_authz.py), and the kit's
ValidatingAdmissionPolicies read from deploy/ as they are.

RBAC is checked against small inline objects for its rules (resourceNames, subresources,
RoleBinding to a ClusterRole, group subjects) and against the kit's deploy/base/rbac.yaml for the
identities the EKS backend runs as. The admission policies' CEL is evaluated by cel-python
(``celpy``), not by a real apiserver: the policies keep to CEL that cel-go accepts too (see
kube_authz.py), and the YAML validates strictly against the Kubernetes 1.30 and 1.33 schemas.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from control.kube_authz import ADMIN, AdmissionPolicies, RbacAuthorizer, UserInfo, service_account_user

REPO = Path(__file__).resolve().parents[2]

NODE_POLICY = REPO / "deploy/base/node-admission-policy.yaml"
POD_POLICY = REPO / "deploy/base/pod-security-policy.yaml"
NODECLAIM_POLICY = REPO / "deploy/components/karpenter/nodeclaim-admission-policy.yaml"
KIT_RBAC = (REPO / "deploy/base/rbac.yaml", REPO / "deploy/components/karpenter/rbac.yaml")

WORKER = service_account_user("airflow", "airflow-worker")
TRIGGERER = service_account_user("airflow", "airflow-triggerer")
#: Airflow outside the cluster: an IAM role mapped by an EKS access entry to the worker's group.
WORKER_IAM = UserInfo(
    "arn:aws:sts::123456789012:assumed-role/airflow-worker/i-0abc", ("fsdp-airflow-worker", "system:authenticated")
)
QUARANTINE_TAINT = "fsdp-resilience/quarantined"
REASON_ANNOTATION = "fsdp-resilience/quarantine-reason"
TRAINING_NS = "fsdp-training"


def load(*paths: Path) -> list[dict]:
    return [doc for path in paths for doc in yaml.safe_load_all(path.read_text()) if doc]


# --------------------------------------------------------------------------------------------
# Identities and RBAC semantics (inline objects)
# --------------------------------------------------------------------------------------------


def test_service_account_user_is_what_a_token_authenticates_as():
    assert WORKER.username == "system:serviceaccount:airflow:airflow-worker"
    assert set(WORKER.groups) == {"system:serviceaccounts", "system:serviceaccounts:airflow", "system:authenticated"}
    assert "system:masters" in ADMIN.groups and ADMIN.username == "kubernetes-admin"


def _rbac(kind, name, rules=None, namespace=None, role_ref=None, subjects=None):
    meta = {"name": name, **({"namespace": namespace} if namespace else {})}
    obj = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": kind, "metadata": meta}
    if rules is not None:
        obj["rules"] = rules
    if role_ref:
        obj["roleRef"] = {"apiGroup": "rbac.authorization.k8s.io", "kind": role_ref[0], "name": role_ref[1]}
        obj["subjects"] = subjects
    return obj


SA_SUBJECT = {"kind": "ServiceAccount", "name": "airflow-worker", "namespace": "airflow"}
GROUP_SUBJECT = {"kind": "Group", "apiGroup": "rbac.authorization.k8s.io", "name": "fsdp-airflow-worker"}

INLINE_RBAC = [
    _rbac(
        "Role",
        "launcher",
        namespace="train",
        rules=[
            {"apiGroups": ["batch"], "resources": ["jobs"], "verbs": ["create", "get", "list"]},
            {"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]},
            {
                "apiGroups": [""],
                "resources": ["configmaps"],
                "verbs": ["get", "update"],
                "resourceNames": ["run-state"],
            },
            {"apiGroups": ["apps"], "resources": ["*/scale"], "verbs": ["patch"]},
        ],
    ),
    _rbac(
        "RoleBinding",
        "launcher",
        namespace="train",
        role_ref=("Role", "launcher"),
        subjects=[SA_SUBJECT, GROUP_SUBJECT],
    ),
    _rbac(
        "ClusterRole",
        "pod-reader",
        rules=[
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]},
            {"nonResourceURLs": ["/healthz"], "verbs": ["get"]},
        ],
    ),
    # A ClusterRole bound by a RoleBinding grants only in the binding's namespace.
    _rbac(
        "RoleBinding", "pod-reader", namespace="train", role_ref=("ClusterRole", "pod-reader"), subjects=[GROUP_SUBJECT]
    ),
    _rbac(
        "ClusterRole",
        "node-reader",
        rules=[
            {"apiGroups": [""], "resources": ["nodes"], "verbs": ["*"]},
        ],
    ),
    _rbac(
        "ClusterRoleBinding",
        "node-reader",
        role_ref=("ClusterRole", "node-reader"),
        subjects=[{"kind": "User", "apiGroup": "rbac.authorization.k8s.io", "name": "alice"}],
    ),
    {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "ignored", "namespace": "train"}},
]


@pytest.mark.parametrize(
    "user, verb, group, resource, sub, ns, name",
    [
        (WORKER, "create", "batch", "jobs", "", "train", ""),
        (WORKER_IAM, "get", "batch", "jobs", "", "train", "job-a"),
        (WORKER, "get", "", "pods", "log", "train", "pod-0"),
        (WORKER, "get", "", "configmaps", "", "train", "run-state"),
        (WORKER, "update", "", "configmaps", "", "train", "run-state"),
        (WORKER, "patch", "apps", "deployments", "scale", "train", "web"),
        (WORKER_IAM, "list", "", "pods", "", "train", ""),
        (UserInfo("alice"), "delete", "", "nodes", "", "", "node-1"),
        (ADMIN, "delete", "", "namespaces", "", "", "kube-system"),
    ],
)
def test_rbac_allows(user, verb, group, resource, sub, ns, name):
    assert RbacAuthorizer(INLINE_RBAC).authorize(user, verb, group, resource, sub, ns, name) is None


@pytest.mark.parametrize(
    "user, verb, group, resource, sub, ns, name, message",
    [
        # No rule for the verb; a name shows in the message.
        (
            WORKER,
            "delete",
            "batch",
            "jobs",
            "",
            "train",
            "job-a",
            'jobs.batch "job-a" is forbidden: User "system:serviceaccount:airflow:airflow-worker" cannot '
            'delete resource "jobs" in API group "batch" in the namespace "train"',
        ),
        # A Role grants only in its namespace.
        (
            WORKER,
            "create",
            "batch",
            "jobs",
            "",
            "other",
            "",
            'jobs.batch is forbidden: User "system:serviceaccount:airflow:airflow-worker" cannot create '
            'resource "jobs" in API group "batch" in the namespace "other"',
        ),
        # pods/log is granted, pods is not (for the SA; the group has list through the ClusterRole).
        (
            WORKER,
            "get",
            "",
            "pods",
            "",
            "train",
            "pod-0",
            'pods "pod-0" is forbidden: User "system:serviceaccount:airflow:airflow-worker" cannot get '
            'resource "pods" in API group "" in the namespace "train"',
        ),
        (
            WORKER,
            "get",
            "",
            "pods",
            "exec",
            "train",
            "pod-0",
            'pods "pod-0" is forbidden: User "system:serviceaccount:airflow:airflow-worker" cannot get '
            'resource "pods/exec" in API group "" in the namespace "train"',
        ),
        # resourceNames: another name, and list/create (which name nothing) are not granted.
        (
            WORKER,
            "get",
            "",
            "configmaps",
            "",
            "train",
            "other",
            'configmaps "other" is forbidden: User "system:serviceaccount:airflow:airflow-worker" cannot '
            'get resource "configmaps" in API group "" in the namespace "train"',
        ),
        (
            WORKER,
            "list",
            "",
            "configmaps",
            "",
            "train",
            "",
            'configmaps is forbidden: User "system:serviceaccount:airflow:airflow-worker" cannot list '
            'resource "configmaps" in API group "" in the namespace "train"',
        ),
        # "*/scale" grants the subresource only, not the resource.
        (
            WORKER,
            "patch",
            "apps",
            "deployments",
            "",
            "train",
            "web",
            'deployments.apps "web" is forbidden: User "system:serviceaccount:airflow:airflow-worker" '
            'cannot patch resource "deployments" in API group "apps" in the namespace "train"',
        ),
        # The ClusterRole bound by a RoleBinding in "train" grants nothing elsewhere, nor cluster-wide.
        (
            WORKER_IAM,
            "list",
            "",
            "pods",
            "",
            "default",
            "",
            'pods is forbidden: User "arn:aws:sts::123456789012:assumed-role/airflow-worker/i-0abc" cannot '
            'list resource "pods" in API group "" in the namespace "default"',
        ),
        (
            WORKER_IAM,
            "list",
            "",
            "pods",
            "",
            "",
            "",
            'pods is forbidden: User "arn:aws:sts::123456789012:assumed-role/airflow-worker/i-0abc" cannot '
            'list resource "pods" in API group "" at the cluster scope',
        ),
        # The SA of the same name in another namespace is someone else.
        (
            service_account_user("default", "airflow-worker"),
            "create",
            "batch",
            "jobs",
            "",
            "train",
            "",
            'jobs.batch is forbidden: User "system:serviceaccount:default:airflow-worker" cannot create '
            'resource "jobs" in API group "batch" in the namespace "train"',
        ),
        (
            UserInfo("bob"),
            "get",
            "",
            "nodes",
            "",
            "",
            "node-1",
            'nodes "node-1" is forbidden: User "bob" cannot get resource "nodes" in API group "" at the cluster scope',
        ),
    ],
)
def test_rbac_denies_with_the_apiservers_message(user, verb, group, resource, sub, ns, name, message):
    assert RbacAuthorizer(INLINE_RBAC).authorize(user, verb, group, resource, sub, ns, name) == message


def test_kit_rbac_separates_the_worker_from_the_read_only_triggerer():
    """The kit's rbac.yaml as it is: the worker (SA or group) launches and patches nodes, the
    triggerer (SA or group) reads and writes nothing. Only the calls whose grant the issue fixes."""
    rbac = RbacAuthorizer(load(*KIT_RBAC))
    triggerer_iam = UserInfo(
        "arn:aws:sts::123456789012:assumed-role/airflow-triggerer/i-0def",
        ("fsdp-airflow-triggerer", "system:authenticated"),
    )
    for worker in (WORKER, WORKER_IAM):
        assert rbac.authorize(worker, "create", "batch", "jobs", "", TRAINING_NS, "") is None
        assert rbac.authorize(worker, "patch", "", "nodes", "", "", "gpu-node-1") is None
        assert rbac.authorize(worker, "delete", "karpenter.sh", "nodeclaims", "", "", "gpu-x") is None
        assert rbac.authorize(worker, "create", "batch", "jobs", "", "default", "") is not None
    for triggerer in (TRIGGERER, triggerer_iam):
        assert rbac.authorize(triggerer, "get", "batch", "jobs", "", TRAINING_NS, "job-a") is None
        assert rbac.authorize(triggerer, "list", "", "pods", "", TRAINING_NS, "") is None
        assert rbac.authorize(triggerer, "list", "", "nodes", "", "", "") is None
        for verb, group, resource, ns, name in [
            ("create", "batch", "jobs", TRAINING_NS, ""),
            ("patch", "batch", "jobs", TRAINING_NS, "job-a"),
            ("patch", "", "nodes", "", "gpu-node-1"),
            ("delete", "karpenter.sh", "nodeclaims", "", "gpu-x"),
        ]:
            message = rbac.authorize(triggerer, verb, group, resource, "", ns, name)
            assert message is not None and f'User "{triggerer.username}" cannot {verb}' in message


# --------------------------------------------------------------------------------------------
# Admission machinery (inline policy)
# --------------------------------------------------------------------------------------------


def _policy(name, spec):
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": name},
        "spec": spec,
    }


def _binding(name, policy, actions=("Deny",), match=None):
    spec = {"policyName": policy, "validationActions": list(actions)}
    if match:
        spec["matchResources"] = match
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": name},
        "spec": spec,
    }


CONFIGMAP_RULES = {
    "resourceRules": [
        {"apiGroups": [""], "apiVersions": ["v1"], "resources": ["configmaps"], "operations": ["CREATE", "UPDATE"]}
    ]
}


def _configmap(data, labels=None):
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "cm", "namespace": "train", "labels": labels or {}},
        "data": data,
    }


def _admit_configmap(objects, data, user=WORKER, labels=None, operation="CREATE", namespace="train"):
    return AdmissionPolicies(objects).admit(
        user, operation, "", "v1", "configmaps", "", namespace, "cm", _configmap(data, labels), None, None
    )


def test_admission_reason_code_message_and_variables():
    policy = _policy(
        "small",
        {
            "matchConstraints": CONFIGMAP_RULES,
            "variables": [{"name": "size", "expression": "has(object.data) ? size(object.data) : 0"}],
            "validations": [
                {
                    "expression": "variables.size <= 1",
                    "reason": "RequestEntityTooLarge",
                    "messageExpression": "'too many keys: ' + string(variables.size)",
                },
                {"expression": "!('secret' in object.data)", "message": "no secrets here"},
            ],
        },
    )
    objects = [policy, _binding("small-binding", "small")]
    assert _admit_configmap(objects, {"a": "1"}) is None
    assert _admit_configmap(objects, {"a": "1", "b": "2"}) == (
        413,
        "configmaps \"cm\" is forbidden: ValidatingAdmissionPolicy 'small' with binding "
        "'small-binding' denied request: too many keys: 2",
    )
    code, message = _admit_configmap(objects, {"secret": "x"})
    assert code == 422 and message.endswith("denied request: no secrets here")  # Invalid by default
    # Warn and Audit admit (and record why); no binding, no policy.
    assert _admit_configmap([policy, _binding("b", "small", actions=("Warn", "Audit"))], {"secret": "x"}) is None
    assert _admit_configmap([policy], {"secret": "x"}) is None


def test_admission_match_conditions_selectors_and_failure_policy():
    policy = _policy(
        "p",
        {
            "matchConstraints": CONFIGMAP_RULES,
            "matchConditions": [
                {"name": "worker-only", "expression": "request.userInfo.username.endsWith(':airflow-worker')"}
            ],
            "validations": [{"expression": "object.data.mode == 'safe'", "reason": "Forbidden"}],
        },
    )
    binding = _binding(
        "b",
        "p",
        match={
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "train"}},
            "objectSelector": {"matchExpressions": [{"key": "app", "operator": "In", "values": ["fsdp"]}]},
        },
    )
    objects = [policy, binding]
    fsdp = {"app": "fsdp"}
    code, message = _admit_configmap(objects, {"mode": "fast"}, labels=fsdp)
    assert code == 403 and message.endswith("denied request: failed expression: object.data.mode == 'safe'")
    assert _admit_configmap(objects, {"mode": "safe"}, labels=fsdp) is None
    assert _admit_configmap(objects, {"mode": "fast"}, labels=fsdp, user=ADMIN) is None  # condition false
    assert _admit_configmap(objects, {"mode": "fast"}, labels={"app": "web"}) is None  # objectSelector
    assert _admit_configmap(objects, {"mode": "fast"}, labels=fsdp, namespace="other") is None  # nsSelector
    assert _admit_configmap(objects, {"mode": "fast"}, labels=fsdp, operation="DELETE") is None  # rules
    # A missing key is an evaluation error: denied under failurePolicy Fail, ignored under Ignore.
    code, message = _admit_configmap(objects, {}, labels=fsdp)
    assert code == 422 and "resulted in error" in message
    policy["spec"]["failurePolicy"] = "Ignore"
    assert _admit_configmap(objects, {}, labels=fsdp) is None


# --------------------------------------------------------------------------------------------
# The kit's node policy
# --------------------------------------------------------------------------------------------


def _node(name="gpu-node-1", pool="gpu", taints=(), annotations=None, unschedulable=None):
    labels = {"kubernetes.io/hostname": name, "node.kubernetes.io/instance-type": "p5.48xlarge"}
    if pool:
        labels["fsdp-resilience/pool"] = pool
    node = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": labels,
            "resourceVersion": "41",
            "annotations": {"node.alpha.kubernetes.io/ttl": "0", **(annotations or {})},
        },
        "spec": {"providerID": f"aws:///us-west-2a/i-{name}"},
    }
    if taints:
        node["spec"]["taints"] = [dict(t) for t in taints]
    if unschedulable is not None:
        node["spec"]["unschedulable"] = unschedulable
    return node


UNREACHABLE = {"key": "node.kubernetes.io/unreachable", "effect": "NoExecute", "timeAdded": "2026-12-01T06:00:00Z"}


def _quarantined(node):
    """What the backend's quarantine patch does: cordon, add the taint, note the reason."""
    new = copy.deepcopy(node)
    new["spec"]["unschedulable"] = True
    new["spec"].setdefault("taints", []).append({"key": QUARANTINE_TAINT, "value": "xid-79", "effect": "NoSchedule"})
    new["metadata"]["annotations"][REASON_ANNOTATION] = "xid 79: GPU fell off the bus"
    return new


def _admit_node(user, old, new):
    policies = AdmissionPolicies(load(NODE_POLICY))
    return policies.admit(user, "UPDATE", "", "v1", "nodes", "", "", old["metadata"]["name"], new, old, None)


@pytest.mark.parametrize("user", [WORKER, TRIGGERER, WORKER_IAM], ids=["worker", "triggerer", "worker-iam"])
def test_node_quarantine_on_a_gpu_pool_node_is_admitted(user):
    old = _node(taints=[UNREACHABLE])
    assert _admit_node(user, old, _quarantined(old)) is None
    # ... and lifting it again (uncordon, taint and annotation removed).
    assert _admit_node(user, _quarantined(old), old) is None


def test_node_write_outside_the_gpu_pool_is_denied():
    old = _node(name="system-node-1", pool="system")
    code, message = _admit_node(WORKER, old, _quarantined(old))
    assert code == 403
    assert message == (
        "nodes \"system-node-1\" is forbidden: ValidatingAdmissionPolicy 'fsdp-airflow-node-writes' "
        "with binding 'fsdp-airflow-node-writes' denied request: Airflow may change only nodes of "
        "the GPU pool (label fsdp-resilience/pool=gpu); node system-node-1 is not one"
    )
    unlabelled = _node(name="bare-node", pool=None)
    code, message = _admit_node(WORKER_IAM, unlabelled, _quarantined(unlabelled))
    assert code == 403 and "node bare-node is not one" in message


def _changed(node, change):
    new = _quarantined(node)
    change(new)
    return new


@pytest.mark.parametrize(
    "change, says",
    [
        (lambda n: n["metadata"]["labels"].update({"fsdp-resilience/pool": "cpu"}), "labels"),
        (lambda n: n["metadata"]["labels"].update({"team": "x"}), "labels"),
        (lambda n: n["metadata"]["annotations"].update({"other": "x"}), "annotation"),
        (lambda n: n["metadata"]["annotations"].pop("node.alpha.kubernetes.io/ttl"), "annotation"),
        (
            lambda n: n["spec"].update(taints=[t for t in n["spec"]["taints"] if t["key"] != UNREACHABLE["key"]]),
            "every other taint",
        ),
        (
            lambda n: n["spec"]["taints"].append({"key": "dedicated", "value": "x", "effect": "NoSchedule"}),
            "every other taint",
        ),
    ],
    ids=[
        "pool-label",
        "new-label",
        "other-annotation",
        "remove-annotation",
        "remove-unreachable-taint",
        "add-other-taint",
    ],
)
def test_node_write_beyond_the_quarantine_fields_is_denied(change, says):
    old = _node(taints=[UNREACHABLE])
    code, message = _admit_node(WORKER, old, _changed(old, change))
    assert code == 403 and "ValidatingAdmissionPolicy 'fsdp-airflow-node-writes'" in message
    assert says in message


def test_node_policy_does_not_match_other_identities():
    """Admins, the node lifecycle controller and Karpenter are not the Airflow identities."""
    old = _node(name="system-node-1", pool="system", taints=[UNREACHABLE])
    new = _changed(old, lambda n: n["metadata"]["labels"].update({"team": "x"}))
    controller = service_account_user("kube-system", "node-controller")
    other_in_airflow = service_account_user("airflow", "airflow-webserver")
    for user in (ADMIN, controller, other_in_airflow):
        assert _admit_node(user, old, new) is None


# --------------------------------------------------------------------------------------------
# The kit's NodeClaim policy (Karpenter component)
# --------------------------------------------------------------------------------------------


def _nodeclaim(name, nodepool):
    return {
        "apiVersion": "karpenter.sh/v1",
        "kind": "NodeClaim",
        "metadata": {"name": name, "labels": {"karpenter.sh/nodepool": nodepool}},
    }


def _delete_nodeclaim(user, claim):
    policies = AdmissionPolicies(load(NODECLAIM_POLICY))
    return policies.admit(
        user, "DELETE", "karpenter.sh", "v1", "nodeclaims", "", "", claim["metadata"]["name"], None, claim, None
    )


def test_nodeclaim_delete_only_in_the_gpu_nodepool():
    assert _delete_nodeclaim(WORKER, _nodeclaim("gpu-7xk2p", "gpu")) is None
    assert _delete_nodeclaim(WORKER_IAM, _nodeclaim("gpu-7xk2p", "gpu")) is None
    code, message = _delete_nodeclaim(WORKER, _nodeclaim("default-abcde", "default"))
    assert code == 403
    assert message == (
        'nodeclaims.karpenter.sh "default-abcde" is forbidden: ValidatingAdmissionPolicy '
        "'fsdp-airflow-nodeclaim-deletes' with binding 'fsdp-airflow-nodeclaim-deletes' denied "
        "request: Airflow may delete only NodeClaims of the NodePool gpu (label "
        "karpenter.sh/nodepool=gpu); default-abcde is not one"
    )
    unlabelled = {"apiVersion": "karpenter.sh/v1", "kind": "NodeClaim", "metadata": {"name": "odd"}}
    assert _delete_nodeclaim(WORKER, unlabelled)[0] == 403
    assert _delete_nodeclaim(ADMIN, _nodeclaim("default-abcde", "default")) is None


# --------------------------------------------------------------------------------------------
# The kit's pod-security policy (namespace fsdp-training)
# --------------------------------------------------------------------------------------------


def _training_pod(ipc_lock=True):
    """A training pod as eks/manifests.py builds it (issue 12's intended securityContext)."""
    capabilities = {"drop": ["ALL"], **({"add": ["IPC_LOCK"]} if ipc_lock else {})}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"generateName": "fsdp-llama-8b-try-1-0-", "namespace": TRAINING_NS},
        "spec": {
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": 1000,
                "runAsGroup": 1000,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "containers": [
                {
                    "name": "trainer",
                    "image": "123456789012.dkr.ecr.us-west-2.amazonaws.com/fsdp-training:1.0",
                    "securityContext": {"allowPrivilegeEscalation": False, "capabilities": capabilities},
                    "ports": [{"containerPort": 29500, "name": "rdzv"}],
                    "volumeMounts": [{"name": "fsx", "mountPath": "/fsx"}, {"name": "dshm", "mountPath": "/dev/shm"}],
                }
            ],
            "volumes": [
                {"name": "fsx", "persistentVolumeClaim": {"claimName": "fsx-claim"}},
                {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi"}},
            ],
        },
    }


def _create_pod(pod, namespace=TRAINING_NS, user=None):
    policies = AdmissionPolicies(load(POD_POLICY))
    user = user or service_account_user("kube-system", "job-controller")
    return policies.admit(
        user,
        "CREATE",
        "",
        "v1",
        "pods",
        "",
        namespace,
        "",
        pod,
        None,
        {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": namespace, "labels": {"kubernetes.io/metadata.name": namespace}},
        },
    )


def test_training_pod_with_ipc_lock_is_admitted():
    assert _create_pod(_training_pod(ipc_lock=True)) is None
    assert _create_pod(_training_pod(ipc_lock=False)) is None


def _container_sc(pod):
    return pod["spec"]["containers"][0]["securityContext"]


@pytest.mark.parametrize(
    "change, says",
    [
        (lambda p: p["spec"]["securityContext"].pop("runAsNonRoot"), "runAsNonRoot must be true"),
        (lambda p: _container_sc(p).update(runAsNonRoot=False), "runAsNonRoot must be true"),
        (lambda p: _container_sc(p).update(runAsUser=0), "runAsUser must not be 0"),
        (
            lambda p: _container_sc(p)["capabilities"].update(add=["IPC_LOCK", "SYS_ADMIN"]),
            "may add only the capabilities IPC_LOCK and NET_BIND_SERVICE",
        ),
        (lambda p: _container_sc(p)["capabilities"].pop("drop"), 'drop=["ALL"]'),
        (lambda p: _container_sc(p).update(privileged=True), "must not be privileged"),
        (lambda p: _container_sc(p).pop("allowPrivilegeEscalation"), "allowPrivilegeEscalation=false"),
        (lambda p: p["spec"]["securityContext"].pop("seccompProfile"), "seccompProfile.type"),
        (
            lambda p: p["spec"]["volumes"].append({"name": "host", "hostPath": {"path": "/var/run"}}),
            "hostPath volumes are not allowed",
        ),
        (lambda p: p["spec"].update(hostNetwork=True), "hostNetwork"),
        (lambda p: p["spec"]["containers"][0]["ports"][0].update(hostPort=29500), "hostPort must not be set"),
        (
            lambda p: p["spec"].update(initContainers=[{"name": "setup", "image": "busybox"}]),
            "allowPrivilegeEscalation=false",
        ),
    ],
    ids=[
        "no-runAsNonRoot",
        "container-runAsNonRoot-false",
        "root-user",
        "SYS_ADMIN",
        "no-drop-all",
        "privileged",
        "no-allowPrivilegeEscalation",
        "no-seccomp",
        "hostPath",
        "hostNetwork",
        "hostPort",
        "bare-init-container",
    ],
)
def test_pod_breaking_a_restricted_rule_is_denied(change, says):
    pod = _training_pod()
    change(pod)
    code, message = _create_pod(pod)
    assert code == 403
    assert message.startswith(
        'pods "fsdp-llama-8b-try-1-0-" is forbidden: ValidatingAdmissionPolicy '
        "'fsdp-training-pod-security' with binding 'fsdp-training-pod-security' "
        "denied request: "
    )
    assert says in message


def test_pod_policy_applies_only_in_the_training_namespace():
    pod = _training_pod()
    pod["spec"]["containers"][0]["securityContext"]["privileged"] = True
    assert _create_pod(pod, namespace="default") is None


@pytest.mark.parametrize("efa_ipc_lock", [True, False])
def test_the_backends_pods_pass_the_pod_security_policy(efa_ipc_lock):
    """The pods eks/manifests.py really builds (training with EFA, evaluation) are admitted."""
    from fsdp_resilience.control.backends.eks import PodTemplateSettings, evaluation_job, training_job
    from fsdp_resilience.training.contract import RunConfig

    cfg = RunConfig(
        run_id="7b-llama", run_dir="/fsx/runs/7b-llama", dataset_dir="/fsx/datasets/fineweb", nodes=2, procs_per_node=8
    )
    settings = PodTemplateSettings(
        image="123456789012.dkr.ecr.us-west-2.amazonaws.com/fsdp-training:1.0", efa_ipc_lock=efa_ipc_lock
    )
    for job in (training_job(cfg, "try-1", settings), evaluation_job(cfg, settings)):
        template = job["spec"]["template"]
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {**template.get("metadata", {}), "generateName": job["metadata"]["name"] + "-"},
            "spec": template["spec"],
        }
        assert _create_pod(pod) is None, job["metadata"]["name"]


# --------------------------------------------------------------------------------------------
# The policy files themselves
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["1.30.0", "1.33.0"])
@pytest.mark.parametrize("path", [NODE_POLICY, NODECLAIM_POLICY, POD_POLICY], ids=lambda p: p.name)
def test_policy_files_validate_strictly_and_bind_their_policy_with_deny(path, version):
    """admissionregistration.k8s.io/v1 exists from Kubernetes 1.30 (EKS 1.30); each file holds
    one policy and the binding that enforces it."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    docs = load(path)
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)
    policy, binding = docs
    assert (policy["kind"], binding["kind"]) == ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert policy["spec"]["failurePolicy"] == "Fail"
