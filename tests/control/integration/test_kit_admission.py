"""The deploy kit's ValidatingAdmissionPolicies on the real apiserver, applied as the kit's users
apply it (deploy/render.py, ``kubectl apply --server-side``): real CEL, compiled and type-checked
by the apiserver's own checker, and enforced on real requests.

- fsdp-airflow-node-writes: the Airflow identities (the worker's and triggerer's ServiceAccounts,
  and the groups an EKS access entry maps their IAM roles to) may quarantine and return only nodes
  of the GPU pool, and change nothing else on them; every other identity is not matched.
- fsdp-airflow-nodeclaim-deletes (overlay example-karpenter): they may delete only NodeClaims of
  the GPU NodePool.
- the training namespace's Pod Security: ``restricted``, enforced by Pod Security admission from
  the kit's namespace labels (the kit's own pod policy is gone: nothing in the pods needs more);
  the backend's own pods pass it, a pod adding IPC_LOCK does not. Pods are created with
  ``dryRun=All``: admission runs in full, nothing is stored or scheduled.

An IAM role is played by impersonation (control.fakes.eks_cluster.acting_as), so the apiserver
authorizes and admits the request as the role's user and groups. The Job controller meeting the
Pod Security refusal, and the image allowlist, are test_eks_backend.py's.

Also here: the training Job, as the backend renders it (spares, EFA), is created with
``fieldValidation=Strict`` and read back whole, so it relies on no field the tested Kubernetes
version drops or refuses.
"""

from __future__ import annotations

import json

import pytest

from fsdp_resilience.control.backends.eks.constants import QUARANTINE_ANNOTATION, QUARANTINE_TAINT, RETURN_ANNOTATION

from control.fakes.eks_cluster import (
    GPU_TAINT,
    NS,
    TRIGGERER,
    WORKER,
    acting_as,
    add_gpu_node,
    render_kit,
    run_config,
    start_strict_cluster,
)
from control.kube.cluster import ApiError, UserInfo, service_account_user, taint_keys, wait_for

#: Airflow outside the cluster: IAM roles an EKS access entry maps to the kit's groups.
WORKER_IAM = UserInfo(
    "arn:aws:sts::123456789012:assumed-role/airflow-worker/i-0abc", ("fsdp-airflow-worker", "system:authenticated")
)
TRIGGERER_IAM = UserInfo(
    "arn:aws:sts::123456789012:assumed-role/airflow-triggerer/i-0def",
    ("fsdp-airflow-triggerer", "system:authenticated"),
)
WEBSERVER = service_account_user("airflow", "airflow-webserver")
NODE_CONTROLLER = service_account_user("kube-system", "node-controller")
NODE_POLICY, NODECLAIM_POLICY = "fsdp-airflow-node-writes", "fsdp-airflow-nodeclaim-deletes"
VAP = "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies"


def denied_by(policy: str, resource: str, name: str) -> str:
    """The start of the apiserver's message for a request a policy's Deny binding refused."""
    return (
        f"{resource} \"{name}\" is forbidden: ValidatingAdmissionPolicy '{policy}' with binding "
        f"'{policy}' denied request: "
    )


def attempt(kube, user: UserInfo, call) -> tuple[int, str] | None:
    """Run ``call`` (a ``kubernetes`` client call) as ``user``: None if admitted, else the status
    and the apiserver's message."""
    from kubernetes.client import ApiException

    with acting_as(kube, user):
        try:
            call()
            return None
        except ApiException as e:
            return e.status, json.loads(e.body)["message"]


@pytest.fixture
def cluster(cluster):
    """The cluster fixture (the example overlay applied), once its policies are in effect."""
    cluster.wait_admission_policies()
    return cluster


@pytest.fixture
def api(cluster, tmp_path):
    """A ``kubernetes`` ApiClient on the cluster (whose identity ``attempt`` sets per call)."""
    import kubernetes

    with kubernetes.config.new_client_from_config(str(tmp_path / "kubeconfig")) as client:
        yield client


def allowed(kube, user: UserInfo, verb: str, resource: str, group: str = "") -> bool:
    review = {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SubjectAccessReview",
        "spec": {"user": user.username, "groups": list(user.groups),
                 "resourceAttributes": {"verb": verb, "group": group, "resource": resource}},
    }  # fmt: skip
    return kube.api("POST", "/apis/authorization.k8s.io/v1/subjectaccessreviews", review)["status"].get("allowed")


EXTRA_GRANT = "test-beyond-the-kit-node-patch"


@pytest.fixture
def beyond_the_kit(cluster):
    """``patch`` on nodes for identities the kit does not give it (the triggerer, as its
    ServiceAccount and its group; another ServiceAccount of the airflow namespace), so that the
    node policy, not RBAC, is what their writes meet. Removed again after the test."""
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": EXTRA_GRANT},
            "rules": [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["patch"]}]}  # fmt: skip
    subjects = [
        {"kind": "ServiceAccount", "name": "airflow-triggerer", "namespace": "airflow"},
        {"kind": "ServiceAccount", "name": "airflow-webserver", "namespace": "airflow"},
        {"kind": "Group", "apiGroup": "rbac.authorization.k8s.io", "name": "fsdp-airflow-triggerer"},
    ]
    role_ref = {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": EXTRA_GRANT}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
               "metadata": {"name": EXTRA_GRANT}, "subjects": subjects, "roleRef": role_ref}  # fmt: skip
    cluster.apply([role, binding])
    users = (TRIGGERER, TRIGGERER_IAM, WEBSERVER)
    wait_for(lambda: all(allowed(cluster, u, "patch", "nodes") for u in users), what="the extra grant in effect")
    yield
    for path in (f"/apis/rbac.authorization.k8s.io/v1/clusterrolebindings/{EXTRA_GRANT}",
                 f"/apis/rbac.authorization.k8s.io/v1/clusterroles/{EXTRA_GRANT}"):  # fmt: skip
        cluster.api("DELETE", path)
    wait_for(lambda: not any(allowed(cluster, u, "patch", "nodes") for u in users), what="the extra grant gone")


# --------------------------------------------------------------------------------------------
# The node policy
# --------------------------------------------------------------------------------------------

OWNER_ANNOTATION = "example.com/owner"


def pool_node(kube, name: str, pool: str | None = "gpu") -> dict:
    """A node of ``pool`` (None: no pool label) with the GPU taint and an annotation of someone
    else's, as the admin made it."""
    if pool == "gpu":
        add_gpu_node(kube, name)
    else:
        kube.add_node(name, labels={"fsdp-resilience/pool": pool} if pool else {}, taints=[GPU_TAINT])
    kube.patch(f"/api/v1/nodes/{name}", {"metadata": {"annotations": {OWNER_ANNOTATION: "ml-platform"}}}, "merge")
    # A new node is tainted not-ready until the node lifecycle controller has seen it Ready: the
    # taint lists below are computed from a read, so read it once the controller is done with it.
    return wait_for(
        lambda: (
            (n := kube.node(name))
            and not any(t["key"] == "node.kubernetes.io/not-ready" for t in n["spec"].get("taints") or [])
            and n
        ),
        what=f"node {name} without the not-ready taint",
    )


def quarantine_patch(node: dict) -> dict:
    """What the backend's quarantine patch does: cordon, add the taint (the list sent whole), note
    the reason."""
    taints = [*(node["spec"].get("taints") or []), {"key": QUARANTINE_TAINT, "value": "xid-79", "effect": "NoSchedule"}]
    return {
        "metadata": {"annotations": {QUARANTINE_ANNOTATION: "xid 79: GPU fell off the bus"}},
        "spec": {"unschedulable": True, "taints": taints},
    }


def return_patch(node: dict) -> dict:
    """What the backend's return does: uncordon, drop the taint and the reason, note the return."""
    taints = [t for t in node["spec"].get("taints") or [] if t["key"] != QUARANTINE_TAINT]
    return {
        "metadata": {"annotations": {QUARANTINE_ANNOTATION: None, RETURN_ANNOTATION: json.dumps({"by": "ops"})}},
        "spec": {"unschedulable": None, "taints": taints},
    }


def patch_node(api, name: str, body: dict):
    from kubernetes import client

    return lambda: client.CoreV1Api(api).patch_node(name, body)


@pytest.mark.parametrize(
    "user",
    [WORKER, WORKER_IAM, TRIGGERER, TRIGGERER_IAM],
    ids=["worker", "worker-iam", "triggerer", "triggerer-iam"],
)
def test_node_quarantine_and_return_on_a_gpu_pool_node_are_admitted(cluster, api, beyond_the_kit, user):
    node = pool_node(cluster, "gpu-node-1")
    assert attempt(cluster, user, patch_node(api, "gpu-node-1", quarantine_patch(node))) is None
    # The node lifecycle controller taints a cordoned node unschedulable: read the node once it has.
    quarantined = wait_for(
        lambda: "node.kubernetes.io/unschedulable" in taint_keys(n := cluster.node("gpu-node-1")) and n,
        what="the cordoned node tainted unschedulable",
    )
    assert quarantined["spec"]["unschedulable"] is True
    assert attempt(cluster, user, patch_node(api, "gpu-node-1", return_patch(quarantined))) is None
    returned = wait_for(
        lambda: taint_keys(n := cluster.node("gpu-node-1")) == [GPU_TAINT["key"]] and n,
        what="the returned node with only the GPU taint (the controller drops its unschedulable taint)",
    )
    assert not returned["spec"].get("unschedulable")


def test_node_write_outside_the_gpu_pool_is_denied(cluster, api):
    node = pool_node(cluster, "system-node-1", pool="system")
    code, message = attempt(cluster, WORKER, patch_node(api, "system-node-1", quarantine_patch(node)))
    assert code == 403
    assert message == denied_by(NODE_POLICY, "nodes", "system-node-1") + (
        "Airflow may change only nodes of the GPU pool (label fsdp-resilience/pool=gpu); node system-node-1 is not one"
    )
    bare = pool_node(cluster, "bare-node", pool=None)
    code, message = attempt(cluster, WORKER_IAM, patch_node(api, "bare-node", quarantine_patch(bare)))
    assert code == 403 and "node bare-node is not one" in message
    assert not cluster.node("system-node-1")["spec"].get("unschedulable")


def test_uncordoning_a_node_someone_else_cordoned_is_denied(cluster, api):
    pool_node(cluster, "gpu-node-1")
    cluster.patch("/api/v1/nodes/gpu-node-1", {"spec": {"unschedulable": True}})  # a person cordoned it
    code, message = attempt(cluster, WORKER, patch_node(api, "gpu-node-1", {"spec": {"unschedulable": None}}))
    assert code == 403 and "Airflow may uncordon only a node it quarantined" in message
    assert message.endswith("node gpu-node-1 was cordoned by someone else")


@pytest.mark.parametrize(
    "change, says",
    [
        (lambda b: b["metadata"].update(labels={"fsdp-resilience/pool": "cpu"}), "may not change a node's labels"),
        (lambda b: b["metadata"].update(labels={"team": "x"}), "may not change a node's labels"),
        (lambda b: b["metadata"]["annotations"].update({"other": "x"}), "may change only the annotations"),
        (lambda b: b["metadata"]["annotations"].update({OWNER_ANNOTATION: None}), "may change only the annotations"),
        (
            lambda b: b["spec"].update(taints=[t for t in b["spec"]["taints"] if t["key"] != GPU_TAINT["key"]]),
            "every other taint must stay as it is",
        ),
        (
            lambda b: b["spec"]["taints"].append({"key": "dedicated", "value": "x", "effect": "NoSchedule"}),
            "every other taint must stay as it is",
        ),
    ],
    ids=["pool-label", "new-label", "other-annotation", "remove-annotation", "remove-other-taint", "add-other-taint"],
)
def test_node_write_beyond_the_quarantine_fields_is_denied(cluster, api, change, says):
    node = pool_node(cluster, "gpu-node-1")
    body = quarantine_patch(node)
    change(body)
    code, message = attempt(cluster, WORKER, patch_node(api, "gpu-node-1", body))
    assert code == 403 and message.startswith(denied_by(NODE_POLICY, "nodes", "gpu-node-1")), message
    assert says in message
    assert not cluster.node("gpu-node-1")["spec"].get("unschedulable")  # nothing of it was written


def test_node_policy_does_not_match_other_identities(cluster, api, beyond_the_kit):
    """The node lifecycle controller, another ServiceAccount of the airflow namespace and the
    cluster admin are not the Airflow identities: their writes are RBAC's alone."""
    node = pool_node(cluster, "system-node-1", pool="system")
    for i, user in enumerate((NODE_CONTROLLER, WEBSERVER)):
        body = quarantine_patch(node)
        body["metadata"]["labels"] = {f"team-{i}": "x"}
        assert attempt(cluster, user, patch_node(api, "system-node-1", body)) is None, user.username
    cluster.patch("/api/v1/nodes/system-node-1", {"metadata": {"labels": {"fsdp-resilience/pool": "gpu"}}})
    labels = cluster.node("system-node-1")["metadata"]["labels"]
    assert labels["team-0"] == labels["team-1"] == "x" and labels["fsdp-resilience/pool"] == "gpu"


def test_the_triggerer_may_not_patch_a_node_at_all_without_a_grant_beyond_the_kit(cluster, api):
    node = pool_node(cluster, "gpu-node-1")
    code, message = attempt(cluster, TRIGGERER_IAM, patch_node(api, "gpu-node-1", quarantine_patch(node)))
    assert code == 403 and f'User "{TRIGGERER_IAM.username}" cannot patch resource "nodes"' in message


# --------------------------------------------------------------------------------------------
# The NodeClaim policy (the Karpenter component)
# --------------------------------------------------------------------------------------------


def nodeclaim(kube, name: str, nodepool: str | None) -> None:
    """A NodeClaim as Karpenter makes it (its finalizer keeps a deleted one until Karpenter ends
    the instance: here, until the next test's reset)."""
    claim = {
        "apiVersion": "karpenter.sh/v1",
        "kind": "NodeClaim",
        "metadata": {"name": name, "labels": {"karpenter.sh/nodepool": nodepool} if nodepool else {},
                     "finalizers": ["karpenter.sh/termination"]},
        "spec": {"nodeClassRef": {"group": "karpenter.k8s.aws", "kind": "EC2NodeClass", "name": "default"},
                 "requirements": []},
    }  # fmt: skip
    kube.api("POST", "/apis/karpenter.sh/v1/nodeclaims", claim)


def test_nodeclaim_delete_only_in_the_gpu_nodepool(kube, tmp_path, monkeypatch):
    import kubernetes
    from kubernetes import client as k8s

    cluster = start_strict_cluster(kube, tmp_path, monkeypatch, "example-karpenter")
    cluster.wait_admission_policies()
    with kubernetes.config.new_client_from_config(str(tmp_path / "kubeconfig")) as api:
        claims = k8s.CustomObjectsApi(api)

        def delete(name):
            return lambda: claims.delete_cluster_custom_object("karpenter.sh", "v1", "nodeclaims", name)

        for name, pool in (("gpu-7xk2p", "gpu"), ("gpu-8ab3q", "gpu"), ("default-abcde", "default"), ("odd", None)):
            nodeclaim(cluster, name, pool)
        assert attempt(cluster, WORKER, delete("gpu-7xk2p")) is None
        assert attempt(cluster, WORKER_IAM, delete("gpu-8ab3q")) is None
        code, message = attempt(cluster, WORKER, delete("default-abcde"))
        assert code == 403
        assert message == denied_by(NODECLAIM_POLICY, "nodeclaims.karpenter.sh", "default-abcde") + (
            "Airflow may delete only NodeClaims of the NodePool gpu (label karpenter.sh/nodepool=gpu); "
            "default-abcde is not one"
        )
        assert attempt(cluster, WORKER_IAM, delete("odd"))[0] == 403
        for name in ("gpu-7xk2p", "gpu-8ab3q"):
            assert cluster.nodeclaim(name)["metadata"].get("deletionTimestamp")
        assert not cluster.nodeclaim("default-abcde")["metadata"].get("deletionTimestamp")
        cluster.api("DELETE", "/apis/karpenter.sh/v1/nodeclaims/default-abcde")  # the admin is not matched
        assert cluster.nodeclaim("default-abcde")["metadata"].get("deletionTimestamp")


# --------------------------------------------------------------------------------------------
# The training namespace's Pod Security: restricted
# --------------------------------------------------------------------------------------------

POD_NAME = "fsdp-llama-8b-try-1-0-x7k2p"
RESTRICTED = f'pods "{POD_NAME}" is forbidden: violates PodSecurity "restricted:v1.30": '


def training_pod() -> dict:
    """A training pod's security-relevant shape, as eks/manifests.py builds it."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": POD_NAME},
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
                    "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
                    "ports": [{"containerPort": 29500, "name": "rdzv"}],
                    "volumeMounts": [{"name": "fsx", "mountPath": "/fsx"}, {"name": "dshm", "mountPath": "/dev/shm"}],
                }
            ],
            "volumes": [
                {"name": "fsx", "persistentVolumeClaim": {"claimName": "fsx-training"}},
                {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "119Gi"}},
            ],
        },
    }


def create_pod(kube, pod: dict, namespace: str = NS) -> tuple[int, str] | None:
    """Create ``pod`` with dryRun=All (admission in full, nothing stored): None if admitted."""
    try:
        kube.api("POST", f"/api/v1/namespaces/{namespace}/pods", pod, query={"dryRun": "All"})
        return None
    except ApiError as e:
        return e.status, e.body["message"] if isinstance(e.body, dict) else str(e.body)


def container_sc(pod: dict) -> dict:
    return pod["spec"]["containers"][0]["securityContext"]


@pytest.mark.parametrize(
    "change, says",
    [
        (lambda p: container_sc(p)["capabilities"].update(add=["IPC_LOCK"]), '"IPC_LOCK"'),
        (lambda p: p["spec"]["securityContext"].pop("runAsNonRoot"), "runAsNonRoot"),
        (lambda p: container_sc(p).update(runAsNonRoot=False), "runAsNonRoot"),
        (lambda p: container_sc(p).update(runAsUser=0), "runAsUser=0"),
        (lambda p: container_sc(p)["capabilities"].update(add=["SYS_ADMIN"]), '"SYS_ADMIN"'),
        (lambda p: container_sc(p)["capabilities"].pop("drop"), 'capabilities.drop=["ALL"]'),
        # (privileged with allowPrivilegeEscalation=false is invalid: the apiserver's validation says so first)
        (lambda p: container_sc(p).update(privileged=True, allowPrivilegeEscalation=None), "privileged"),
        (lambda p: container_sc(p).pop("allowPrivilegeEscalation"), "allowPrivilegeEscalation=false"),
        (lambda p: p["spec"]["securityContext"].pop("seccompProfile"), "seccompProfile"),
        (lambda p: p["spec"]["volumes"].append({"name": "host", "hostPath": {"path": "/var/run"}}), "hostPath"),
        (lambda p: p["spec"].update(hostNetwork=True), "hostNetwork"),
        (lambda p: p["spec"]["containers"][0]["ports"][0].update(hostPort=29500), "hostPort"),
        (lambda p: p["spec"].update(initContainers=[{"name": "setup", "image": "busybox"}]), '"setup"'),
    ],
    ids=[
        "IPC_LOCK",
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
def test_a_pod_breaking_a_restricted_rule_is_denied(cluster, change, says):
    """Adding IPC_LOCK (what efa_ipc_lock did) is refused like any other break of restricted."""
    assert create_pod(cluster, training_pod()) is None
    pod = training_pod()
    change(pod)
    code, message = create_pod(cluster, pod)
    assert code == 403 and message.startswith(RESTRICTED), message
    assert says in message


def test_restricted_applies_only_in_the_training_namespace(cluster):
    pod = training_pod()
    container_sc(pod)["capabilities"].update(add=["IPC_LOCK"])
    assert create_pod(cluster, pod, namespace="default") is None
    assert create_pod(cluster, pod)[0] == 403


def test_the_backends_own_pods_pass_pod_security_restricted(cluster, tmp_path):
    """The pods eks/manifests.py really builds (training with EFA and a spare, evaluation)."""
    from fsdp_resilience.control.backends.eks import PodTemplateSettings, evaluation_job, training_job

    cfg = run_config(tmp_path, run_id="7b-llama", spare_nodes=1)
    settings = PodTemplateSettings(
        image="123456789012.dkr.ecr.us-west-2.amazonaws.com/fsdp-training:1.0",
        namespace=NS,
        fsx_mount_path=str(tmp_path / "fsx"),
    )
    for job in (training_job(cfg, "try-1", settings), evaluation_job(cfg, settings)):
        template = job["spec"]["template"]
        pod = {"apiVersion": "v1", "kind": "Pod", "spec": template["spec"],
               "metadata": {**template.get("metadata", {}), "name": job["metadata"]["name"] + "-0-abcde"}}  # fmt: skip
        assert create_pod(cluster, pod) is None, job["metadata"]["name"]


# --------------------------------------------------------------------------------------------
# The policies as the apiserver checked them, and the Job as the apiserver keeps it
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", ["example", "example-karpenter"])
def test_each_policy_fails_closed_and_is_bound_with_deny(overlay):
    """Each of the kit's policies denies when its CEL cannot be evaluated, and one binding enforces
    it (Deny, not Warn or Audit). Every object also validates strictly against the Kubernetes 1.30
    and 1.33 schemas (test_deploy_kit.py)."""
    kit = render_kit(overlay)
    policies = {o["metadata"]["name"]: o for o in kit if o["kind"] == "ValidatingAdmissionPolicy"}
    bindings = [o for o in kit if o["kind"] == "ValidatingAdmissionPolicyBinding"]
    assert sorted(b["spec"]["policyName"] for b in bindings) == sorted(policies)
    for binding in bindings:
        assert binding["spec"]["validationActions"] == ["Deny"], binding["metadata"]["name"]
    assert all(p["spec"]["failurePolicy"] == "Fail" for p in policies.values())


def type_checking(kube, name: str) -> dict:
    """The policy's status once the apiserver type-checked its current generation."""
    path = f"{VAP}/{name}"
    status = wait_for(
        lambda: (
            (p := kube.get(path)).get("status", {}).get("observedGeneration") == p["metadata"]["generation"]
            and p["status"]
        ),
        what=f"the apiserver to type-check policy {name}",
    )
    return status.get("typeChecking") or {}


@pytest.mark.every_kube_version
def test_the_kits_policies_type_check_without_warnings(kube):
    """The apiserver compiles each policy's CEL against the schemas of what it matches (Node, Pod,
    Karpenter's NodeClaim CRD) and reports what does not type-check in status.typeChecking; the
    kit's policies have nothing there. An ill-typed policy shows the check is real."""
    kube.load(render_kit("example-karpenter"))
    policies = [
        o["metadata"]["name"] for o in render_kit("example-karpenter") if o["kind"] == "ValidatingAdmissionPolicy"
    ]
    assert sorted(policies) == sorted([NODE_POLICY, NODECLAIM_POLICY])
    for name in policies:
        assert not type_checking(kube, name).get("expressionWarnings"), name
    ill_typed = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": "test-ill-typed"},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {"resourceRules": [
                {"apiGroups": [""], "apiVersions": ["v1"], "resources": ["nodes"], "operations": ["UPDATE"]}]},
            "validations": [{"expression": "object.spec.noSuchField == 'x'"}],
        },
    }  # fmt: skip
    kube.api("POST", VAP, ill_typed)
    try:
        warnings = type_checking(kube, "test-ill-typed").get("expressionWarnings") or []
        assert [w["fieldRef"] for w in warnings] == ["spec.validations[0].expression"]
        assert "noSuchField" in warnings[0]["warning"]
    finally:
        kube.api("DELETE", f"{VAP}/test-ill-typed")


def dropped(sent, kept, path: str = "") -> list[str]:
    """The paths of ``sent`` that ``kept`` lacks or holds otherwise (what the server added is fine;
    a number sent for a quantity comes back as its string)."""
    if isinstance(sent, dict):
        if not isinstance(kept, dict):
            return [path or "."]
        return [p for k, v in sent.items() for p in dropped(v, kept.get(k, _MISSING), f"{path}.{k}")]
    if isinstance(sent, list):
        if not isinstance(kept, list) or len(kept) != len(sent):
            return [path]
        return [p for i, (s, k) in enumerate(zip(sent, kept)) for p in dropped(s, k, f"{path}[{i}]")]
    if isinstance(sent, (int, float)) and not isinstance(sent, bool) and isinstance(kept, str):
        return [] if str(sent) == kept else [path]
    return [] if sent == kept else [path]


_MISSING = object()


@pytest.mark.every_kube_version
def test_the_training_job_is_accepted_under_strict_field_validation_and_kept_whole(cluster, tmp_path):
    """The Job with spares (successPolicy, podFailurePolicy) and EFA, created with
    fieldValidation=Strict (an unknown, duplicate or dropped field is an error, not a warning)
    and read back: every field it sets is there as it was sent."""
    from fsdp_resilience.control.backends.eks import PodTemplateSettings, training_job

    cfg = run_config(tmp_path, run_id="7b-strict", nodes=2, spare_nodes=1, restart_mode="layered")
    settings = PodTemplateSettings(image="example.com/fsdp-training:test", namespace=NS,
                                   fsx_mount_path=str(tmp_path / "fsx"))  # fmt: skip
    job = training_job(cfg, "0", settings)
    assert job["spec"].get("successPolicy") and job["spec"].get("podFailurePolicy")
    assert job["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["vpc.amazonaws.com/efa"]
    created = cluster.api("POST", f"/apis/batch/v1/namespaces/{NS}/jobs", job, query={"fieldValidation": "Strict"})
    kept = cluster.job(NS, created["metadata"]["name"])
    assert dropped(job["spec"], kept["spec"], "spec") == []
    assert dropped(job["metadata"], kept["metadata"], "metadata") == []
