"""The EKS backend's Kubernetes objects: strict validation against the official schemas of the
supported Kubernetes range (1.30 and 1.33; offline, kubernetes-validate), and the behaviour the
objects encode: names, labels, the pod failure policy of the run contract, devices, mounts, the
pods' security context and QoS, and the per-launch NetworkPolicy. (The pod settings' own
validation: test_eks_pod_settings.py; the image allowlist: test_eks_images.py.)

No cluster: the objects are checked as the API server's schema and the Job controller's rules
read them, and the pod env is fed to the real ``fsdp_resilience.training.launch`` (dry run).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]

from fsdp_resilience.control.backends.base import JOB_NAME_MAX, job_name_for  # noqa: E402
from fsdp_resilience.control.backends.eks.constants import (  # noqa: E402
    CONTAINER,
    DEVICE_RDMA_ENV,
    EFA_ENV,
    INSTANCE_TYPE_LABEL,
    LABEL_AIRFLOW_RUN,
    LABEL_COMPONENT,
    LABEL_JOB,
    LABEL_LAUNCH,
    LABEL_RUN,
    MANAGED_BY,
    NCCL_ENV,
    NEWEST_SUPPORTED_K8S,
    OLDEST_SUPPORTED_K8S,
)
from fsdp_resilience.control.backends.eks.failure_policy import training_backoff_limit  # noqa: E402
from fsdp_resilience.control.backends.eks.manifests import evaluation_job, training_job  # noqa: E402
from fsdp_resilience.control.backends.eks.networking import (  # noqa: E402
    rendezvous_host,
    rendezvous_network_policy,
    rendezvous_service,
)
from fsdp_resilience.control.backends.eks.object_metadata import label_value  # noqa: E402
from fsdp_resilience.control.backends.eks.pod_settings import PodTemplateSettings  # noqa: E402
from fsdp_resilience.training.contract import ExitCode, FailureClass, RunConfig, failure_class_for_exit  # noqa: E402

from control.support.eks_pods import make_cfg, make_settings  # noqa: E402

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is missing: pip install '.[test-eks]'"
)

TRAINING_PYTHON = Path(os.environ.get("TRAINING_PYTHON") or REPO / ".venv" / "bin" / "python")
K8S_VERSIONS = (OLDEST_SUPPORTED_K8S, NEWEST_SUPPORTED_K8S)
AIRFLOW_RUN_ID = "manual__2026-11-30T07:35:43.123456+00:00"

DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
#: What a Service name must be (and so the Job and NetworkPolicy named like it).
DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def roundtrip(obj: dict) -> dict:
    """The object as it goes over the wire: JSON (no NaN, no Python-only types)."""
    return json.loads(json.dumps(obj, allow_nan=False))


def validate(obj: dict, version: str) -> None:
    kubernetes_validate.validate(roundtrip(obj), version, strict=True)


def container_of(job: dict) -> dict:
    containers = job["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == [CONTAINER]
    return containers[0]


def env_of(job: dict) -> dict[str, dict]:
    """name -> env entry (value or valueFrom); a name set twice would be a bug."""
    entries = container_of(job)["env"]
    names = [e["name"] for e in entries]
    assert len(names) == len(set(names)), f"duplicate env names: {names}"
    return {e["name"]: e for e in entries}


def all_labels(obj: dict) -> list[dict[str, str]]:
    out = [obj["metadata"]["labels"]]
    template = obj.get("spec", {}).get("template")
    if template:
        out.append(template["metadata"]["labels"])
    return out


# A spread of settings: every optional branch of the builders, each validated against the schemas.
SETTINGS_VARIANTS = {
    "p5-defaults": {},
    "cpu-cluster": dict(
        gpus_per_node=0, efa_per_node=0, node_selector={}, tolerations=[], instance_type=None, cpu="8", memory="32Gi"
    ),
    "zone-shm-priority": dict(
        zone="us-west-2a",
        shm_size="160Gi",
        memory="1800Gi",
        cpu="180",
        priority_class="training-high",
        env={"NCCL_DEBUG": "INFO", "NCCL_NVLS_ENABLE": "0"},
    ),
    "burstable": dict(
        guaranteed_qos=False,
        cpu=None,
        memory=None,
        instance_type="g6e.48xlarge",
        gpus_per_node=None,
    ),
}


def all_objects(settings: PodTemplateSettings) -> list[dict]:
    cfg = make_cfg()
    job = training_job(cfg, "try-1", settings, airflow_run_id=AIRFLOW_RUN_ID)
    owner = {"metadata": {"name": job["metadata"]["name"], "uid": "0b7c6a4e-4a43-4c6e-9a43-1c2f3e4d5a6b"}}
    return [
        job,
        rendezvous_service(cfg, "try-1", settings),
        rendezvous_service(cfg, "try-1", settings, owner=owner, airflow_run_id=AIRFLOW_RUN_ID),
        rendezvous_network_policy(cfg, "try-1", settings),
        rendezvous_network_policy(cfg, "try-1", settings, owner=owner, airflow_run_id=AIRFLOW_RUN_ID),
        evaluation_job(cfg, settings),
        evaluation_job(cfg, settings, airflow_run_id=AIRFLOW_RUN_ID),
        evaluation_job(cfg, settings, checkpoint_id="step_00000040", airflow_run_id=AIRFLOW_RUN_ID),
    ]


# --------------------------------------------------------------------------------------------
# Strict schema validation
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("variant", sorted(SETTINGS_VARIANTS))
def test_objects_validate_strictly(version, variant):
    for obj in all_objects(make_settings(**SETTINGS_VARIANTS[variant])):
        validate(obj, version)


def test_the_supported_range_starts_where_the_kits_admission_policies_exist():
    """The constant is not a guess: the kit's ValidatingAdmissionPolicies are
    admissionregistration.k8s.io/v1, which the schema of one minor version earlier does not have.
    The backend's own objects need 1.29: 1.28's schema rejects the Job (its podFailurePolicy
    exit-code rules have no onPodConditions, which that schema requires)."""
    major, minor = (int(x) for x in OLDEST_SUPPORTED_K8S.split("."))
    assert (major, minor) == (1, 30) and NEWEST_SUPPORTED_K8S == "1.37"
    policy = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": "node-writes"},
        "spec": {"validations": [{"expression": "true"}]},
    }
    validate(policy, OLDEST_SUPPORTED_K8S)
    with pytest.raises(kubernetes_validate.utils.SchemaNotFoundError):
        validate(policy, f"{major}.{minor - 1}")
    job = training_job(make_cfg(), "try-1", make_settings())
    validate(job, f"{major}.{minor - 1}")
    with pytest.raises(kubernetes_validate.ValidationError, match="onPodConditions"):
        validate(job, f"{major}.{minor - 2}")


@pytest.mark.parametrize(
    "mutate, where",
    [
        (lambda j: container_of(j).__setitem__("imagePullPolicyy", "Always"), "imagePullPolicyy"),
        (lambda j: j["spec"].__setitem__("completionsMode", "Indexed"), "completionsMode"),
        (lambda j: j["spec"]["template"]["spec"].__setitem__("subDomain", "x"), "subDomain"),
        (
            lambda j: j["spec"]["podFailurePolicy"]["rules"][1]["onExitCodes"].__setitem__("container", CONTAINER),
            "container",
        ),
    ],
)
def test_strict_validation_rejects_a_misspelt_field(mutate, where):
    """Proves the validation above is live: strict mode rejects what a cluster would drop."""
    job = training_job(make_cfg(), "try-1", make_settings())
    mutate(job)
    for version in K8S_VERSIONS:
        with pytest.raises(kubernetes_validate.ValidationError, match=where):
            validate(job, version)


def test_strict_validation_rejects_a_wrong_type():
    service = rendezvous_service(make_cfg(), "try-1", make_settings())
    service["spec"]["publishNotReadyAddresses"] = "yes"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(service, "1.33")


# --------------------------------------------------------------------------------------------
# The training Job
# --------------------------------------------------------------------------------------------


def test_training_job_is_one_indexed_job_with_a_pod_per_node():
    cfg, settings = make_cfg(nodes=6, rdzv_port=29555), make_settings()
    job = training_job(cfg, "try-2", settings, airflow_run_id=AIRFLOW_RUN_ID)
    name = job_name_for(cfg.run_id, "try-2")
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert job["metadata"]["name"] == name and job["metadata"]["namespace"] == settings.namespace
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == 6
    # Created suspended: the backend resumes it once its Service and NetworkPolicy exist.
    assert spec["suspend"] is True and training_job(cfg, "try-2", settings, suspend=False)["spec"]["suspend"] is False
    assert spec["backoffLimit"] == training_backoff_limit(settings) == 2 + 3
    assert spec["activeDeadlineSeconds"] == settings.active_deadline_s
    assert spec["ttlSecondsAfterFinished"] == settings.ttl_after_finished_s
    assert pod["restartPolicy"] == "Never"
    assert pod["subdomain"] == name
    assert pod["serviceAccountName"] == settings.service_account
    assert pod["automountServiceAccountToken"] is False
    assert pod["terminationGracePeriodSeconds"] == settings.termination_grace_s
    # The pool's label and its instance type (p5.48xlarge: what the sizes and the RDMA setting are for).
    assert pod["nodeSelector"] == {**settings.node_selector, INSTANCE_TYPE_LABEL: "p5.48xlarge"}
    assert pod["tolerations"] == settings.tolerations
    assert "priorityClassName" not in pod
    # One pod per machine: the anti-affinity term selects exactly this Job's pods, by hostname.
    (term,) = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    pod_labels = spec["template"]["metadata"]["labels"]
    assert term["labelSelector"] == {"matchLabels": {LABEL_JOB: name}}
    assert pod_labels[LABEL_JOB] == name
    # All in one zone (EFA stays within a subnet): a required affinity to the same Job's pods.
    (zone,) = pod["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert zone == {"labelSelector": {"matchLabels": {LABEL_JOB: name}}, "topologyKey": "topology.kubernetes.io/zone"}
    # Karpenter leaves the nodes under the pods alone (no consolidation, no drift).
    assert spec["template"]["metadata"]["annotations"]["karpenter.sh/do-not-disrupt"] == "true"

    c = container_of(job)
    assert c["image"] == settings.image and c["imagePullPolicy"] == settings.image_pull_policy
    assert c["command"] == ["python", "-m", "fsdp_resilience.training.launch"]
    assert "args" not in c and "workingDir" not in c
    assert c["ports"] == [{"name": "rdzv", "containerPort": 29555, "protocol": "TCP"}]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert set(mounts) == set(volumes)
    fsx = next(v for v in pod["volumes"] if "persistentVolumeClaim" in v)
    assert fsx["persistentVolumeClaim"] == {"claimName": settings.fsx_claim}
    assert mounts[fsx["name"]] == settings.fsx_mount_path
    assert mounts["dshm"] == "/dev/shm"
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": settings.shm_size_for(cfg)}


def test_training_env_carries_the_run_contract():
    cfg, settings = make_cfg(), make_settings()
    job = training_job(cfg, "try-1", settings)
    env = env_of(job)
    name = job["metadata"]["name"]
    # The launcher rebuilds exactly this config from the env; no file is shipped.
    assert RunConfig.from_json(env["TRAINING_RUN_CONFIG"]["value"]) == cfg
    assert env["TRAINING_LAUNCH_ID"]["value"] == "try-1"
    assert env["TRAINING_NODE_ID"] == {
        "name": "TRAINING_NODE_ID",
        "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}},
    }
    assert (
        env["TRAINING_RDZV_HOST"]["value"]
        == rendezvous_host(name, settings.namespace)
        == f"{name}-0.{name}.{settings.namespace}.svc"
    )
    assert env["PYTHONUNBUFFERED"]["value"] == "1"


def test_settings_env_overrides_the_defaults_and_comes_last():
    job = training_job(make_cfg(), "try-1", make_settings(env={"NCCL_DEBUG": "INFO", "NCCL_BUFFSIZE": "8388608"}))
    env = env_of(job)
    assert env["NCCL_DEBUG"]["value"] == "INFO"
    assert env["NCCL_BUFFSIZE"]["value"] == "8388608"
    assert [e["name"] for e in container_of(job)["env"]][-1] == "NCCL_BUFFSIZE"


def test_efa_and_the_pools_gpus_by_default():
    for procs in (8, 2):  # the pod gets the node's 8 GPUs (p5.48xlarge) however many ranks use them
        job = training_job(make_cfg(procs_per_node=procs), "try-1", make_settings())
        resources = container_of(job)["resources"]
        assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"] == "8"
        assert resources["limits"]["vpc.amazonaws.com/efa"] == resources["requests"]["vpc.amazonaws.com/efa"] == "32"
    env = env_of(job)
    for k, v in {**EFA_ENV, **DEVICE_RDMA_ENV, **NCCL_ENV}.items():
        assert env[k]["value"] == v
    assert env["FI_PROVIDER"]["value"] == "efa" and env["FI_EFA_USE_DEVICE_RDMA"]["value"] == "1"
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"]["value"] == "1"
    # gpus_per_node=None: one GPU per process.
    job = training_job(make_cfg(procs_per_node=4), "try-1", make_settings(gpus_per_node=None))
    assert container_of(job)["resources"]["limits"]["nvidia.com/gpu"] == "4"


def test_more_processes_than_gpus_is_refused():
    with pytest.raises(ValueError, match=r"procs_per_node=16 is more than the 8 GPU\(s\).*gpus_per_node=8"):
        training_job(make_cfg(procs_per_node=16), "try-1", make_settings())
    training_job(make_cfg(procs_per_node=16), "try-1", make_settings(gpus_per_node=0, efa_per_node=0))  # CPU


@pytest.mark.parametrize(
    "instance_type, rdma",
    [
        ("p4d.24xlarge", True),
        ("p4de.24xlarge", True),
        ("p5.48xlarge", True),
        ("p5e.48xlarge", True),
        ("p5en.48xlarge", True),
        ("p6-b200.48xlarge", True),
        ("g6e.48xlarge", False),
        ("g5.48xlarge", False),
        ("p3dn.24xlarge", False),
        (None, False),
    ],
)
def test_device_rdma_only_on_instance_types_that_have_it(instance_type, rdma):
    settings = make_settings(instance_type=instance_type, memory="1000Gi")  # fits a p4d's 1152 GiB too
    job = training_job(make_cfg(), "try-1", settings)
    env = env_of(job)
    assert env["FI_PROVIDER"]["value"] == "efa"  # EFA itself, whatever the type
    assert ("FI_EFA_USE_DEVICE_RDMA" in env) is rdma
    selector = job["spec"]["template"]["spec"]["nodeSelector"]
    assert selector.get(INSTANCE_TYPE_LABEL) == instance_type
    assert settings.device_rdma() is rdma


def test_no_efa_means_no_efa_devices_and_no_efa_env():
    job = training_job(make_cfg(), "try-1", make_settings(efa_per_node=0))
    resources = container_of(job)["resources"]
    assert "vpc.amazonaws.com/efa" not in resources["limits"]
    assert "vpc.amazonaws.com/efa" not in resources["requests"]
    assert not [k for k in env_of(job) if k.startswith("FI_")]
    assert resources["limits"]["nvidia.com/gpu"] == "8"  # GPUs stay


def test_no_gpus_means_no_gpu_request_and_no_nccl_env():
    job = training_job(make_cfg(), "try-1", make_settings(gpus_per_node=0, efa_per_node=0))
    resources = container_of(job)["resources"]
    assert resources["requests"] == resources["limits"] == {"cpu": "180", "memory": "1800Gi"}  # no devices
    assert not set(env_of(job)) & set(NCCL_ENV)
    burstable = training_job(
        make_cfg(), "try-1", make_settings(gpus_per_node=0, efa_per_node=0, cpu=None, memory=None, guaranteed_qos=False)
    )
    assert "resources" not in container_of(burstable)  # nothing requested at all


def test_training_pods_are_guaranteed_by_default_sized_for_p5():
    resources = container_of(training_job(make_cfg(), "try-1", make_settings()))["resources"]
    # QoS Guaranteed: every request equals its limit, cpu and memory included.
    assert (
        resources["requests"]
        == resources["limits"]
        == {"nvidia.com/gpu": "8", "vpc.amazonaws.com/efa": "32", "cpu": "180", "memory": "1800Gi"}
    )


def test_explicit_gpu_count_cpu_and_memory():
    settings = make_settings(gpus_per_node=4, cpu="96", memory="1000Gi")
    resources = container_of(training_job(make_cfg(procs_per_node=4), "try-1", settings))["resources"]
    assert (
        resources["requests"]
        == resources["limits"]
        == {
            "nvidia.com/gpu": "4",
            "vpc.amazonaws.com/efa": "32",
            "cpu": "96",
            "memory": "1000Gi",
        }
    )
    # Burstable on request: no CPU limit (never throttled below what the node has free).
    burstable = make_settings(gpus_per_node=4, cpu="96", memory="1000Gi", guaranteed_qos=False)
    resources = container_of(training_job(make_cfg(procs_per_node=4), "try-1", burstable))["resources"]
    assert resources["requests"]["cpu"] == "96" and "cpu" not in resources["limits"]


# --------------------------------------------------------------------------------------------
# Least privilege: the pods' security context
# --------------------------------------------------------------------------------------------


def pod_specs(settings: PodTemplateSettings) -> list[dict]:
    return [o["spec"]["template"]["spec"] for o in all_objects(settings) if o["kind"] == "Job"]


def restricted_violations(pod: dict) -> list[str]:
    """The Pod Security Standards' "restricted" rules (what PSA enforce=restricted checks), on a
    pod spec."""
    problems = []
    pod_sc = pod.get("securityContext") or {}
    for c in pod["containers"] + (pod.get("initContainers") or []):
        sc = c.get("securityContext") or {}
        if sc.get("privileged"):
            problems.append("privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            problems.append("allowPrivilegeEscalation != false")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            problems.append("capabilities.drop lacks ALL")
        extra = set(caps.get("add") or []) - {"NET_BIND_SERVICE"}
        if extra:
            problems.append(f"capabilities.add {sorted(extra)}")
        if not sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")):
            problems.append("runAsNonRoot != true")
        if sc.get("runAsUser", pod_sc.get("runAsUser")) == 0:
            problems.append("runAsUser 0")
        seccomp = (sc.get("seccompProfile") or pod_sc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            problems.append(f"seccompProfile {seccomp}")
        if any(p.get("hostPort") for p in c.get("ports") or []):
            problems.append("hostPort")
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(key):
            problems.append(key)
    allowed = {
        "persistentVolumeClaim",
        "emptyDir",
        "configMap",
        "secret",
        "projected",
        "downwardAPI",
        "csi",
        "ephemeral",
        "name",
    }
    for volume in pod.get("volumes") or []:
        if set(volume) - allowed:
            problems.append(f"volume {volume['name']}: {sorted(set(volume) - allowed)}")
    return problems


@pytest.mark.parametrize("variant", sorted(SETTINGS_VARIANTS))
def test_every_pod_runs_non_root_with_seccomp_and_no_privilege_escalation(variant):
    settings = make_settings(**SETTINGS_VARIANTS[variant])
    for pod in pod_specs(settings):
        assert pod["securityContext"] == {
            "runAsNonRoot": True,
            "runAsUser": 1000,
            "runAsGroup": 1000,
            "seccompProfile": {"type": "RuntimeDefault"},
        }
        (c,) = pod["containers"]
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["privileged"] is False
        assert sc["capabilities"]["drop"] == ["ALL"]
        assert pod["automountServiceAccountToken"] is False


@pytest.mark.parametrize("variant", sorted(SETTINGS_VARIANTS))
def test_every_pod_passes_restricted_and_adds_no_capability_even_with_efa(variant):
    """EFA's memlock limit is the node's (containerd's base runtime spec): no IPC_LOCK, which a
    non-root container could not use anyway."""
    cfg, settings = make_cfg(), make_settings(**SETTINGS_VARIANTS[variant])
    pods = [*pod_specs(settings), evaluation_job(cfg, settings)["spec"]["template"]["spec"]]
    for pod in pods:
        assert "add" not in pod["containers"][0]["securityContext"]["capabilities"]
        assert restricted_violations(pod) == [], variant


def test_priority_class_is_set_when_given():
    job = training_job(make_cfg(), "try-1", make_settings(priority_class="training-high"))
    assert job["spec"]["template"]["spec"]["priorityClassName"] == "training-high"


# --------------------------------------------------------------------------------------------
# The pod failure policy, as the Job controller applies it
# --------------------------------------------------------------------------------------------


def job_controller_action(policy: dict, exit_code: int, conditions: tuple[str, ...] = ()) -> str:
    """What the Job controller does with a failed pod of ``CONTAINER`` that exited with
    ``exit_code`` and has these True conditions: the first matching rule's action, else "Count"
    (the failure counts against backoffLimit)."""
    for rule in policy["rules"]:
        on_exit = rule.get("onExitCodes")
        if on_exit is not None:
            assert on_exit["operator"] in ("In", "NotIn")
            if on_exit.get("containerName") not in (None, CONTAINER):
                continue
            if (exit_code in on_exit["values"]) == (on_exit["operator"] == "In"):
                return rule["action"]
        for pattern in rule.get("onPodConditions") or ():
            if pattern["type"] in conditions and pattern.get("status", "True") == "True":
                return rule["action"]
    return "Count"


def test_pod_failure_policy_fails_the_job_on_exactly_the_contracts_final_exit_codes():
    job = training_job(make_cfg(), "try-1", make_settings())
    policy = job["spec"]["podFailurePolicy"]
    # Every exit code the contract defines, judged by the failure class it stands for.
    for code in ExitCode:
        failure = failure_class_for_exit(code)
        if code == ExitCode.SUCCESS:
            continue  # a pod that succeeded is not a failure; the policy never sees it
        expected = {FailureClass.UNKNOWN: "Count", FailureClass.LAUNCH_ENDED: "Ignore"}.get(failure, "FailJob")
        assert job_controller_action(policy, int(code)) == expected, (code, failure)
    # Codes outside the contract (an OOM kill's 137, a signal's 143) are retried within backoffLimit.
    for code in (137, 143, 3):
        assert job_controller_action(policy, code) == "Count"
    # The FailJob rules name exactly the contract's final codes, and only the trainer container.
    final_codes = {
        int(c)
        for c in ExitCode
        if failure_class_for_exit(c) not in (FailureClass.SUCCESS, FailureClass.UNKNOWN, FailureClass.LAUNCH_ENDED)
    }
    fail_rules = [r for r in policy["rules"] if r["action"] == "FailJob"]
    assert {v for r in fail_rules for v in r["onExitCodes"]["values"]} == final_codes
    assert {r["onExitCodes"]["containerName"] for r in fail_rules} == {CONTAINER}
    # The contract as documented in src/fsdp_resilience/training/contract/failures.py: config/user error,
    # non-finite state, a run already being trained, storage, restarts exhausted, no progress.
    assert final_codes == {2, 65, 73, 74, 75, 78, 93}
    # Not a node fault, never retried by another pod: a failed pod fails the Job at once, whatever
    # the backoffLimit left (and the DAG's ladder replaces no node for them).
    for code in (ExitCode.NON_FINITE, ExitCode.ALREADY_RUNNING, ExitCode.STORAGE_ERROR):
        assert job_controller_action(policy, int(code)) == "FailJob"
        assert job_controller_action(policy, int(code), ("DisruptionTarget",)) == "Count"
    # The API wants each rule's values unique and ascending.
    assert all(r["onExitCodes"]["values"] == sorted(set(r["onExitCodes"]["values"])) for r in fail_rules)


def test_a_disrupted_pod_never_fails_the_job_at_once_and_is_replaced_within_a_bound():
    """Evicted, preempted or lost with its node: whatever its exit code, the pod is replaced, but
    it counts against backoffLimit, which holds max_pod_disruptions on top of backoff_limit (with
    "Ignore", the Job controller would replace evicted pods for ever)."""
    settings = make_settings(backoff_limit=1, max_pod_disruptions=4)
    job = training_job(make_cfg(), "try-1", settings)
    policy = job["spec"]["podFailurePolicy"]
    for code in (1, 137, int(ExitCode.RESTARTS_EXHAUSTED), int(ExitCode.USER_ERROR)):
        assert job_controller_action(policy, code, ("DisruptionTarget",)) == "Count"
    assert job["spec"]["backoffLimit"] == 5
    assert (
        training_job(make_cfg(), "try-1", make_settings(backoff_limit=0, max_pod_disruptions=0))["spec"]["backoffLimit"]
        == 0
    )


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_a_job_with_hot_spares_runs_a_pod_per_node_and_spare_and_validates_strictly(version):
    """nodes + spare_nodes pods (completion index >= nodes is a spare: fsdp_resilience.training.launch makes it
    wait), one per machine, all rendezvousing at index 0 (always a training node); the failure
    policy and budget are those of a Job without spares: a lost pod (DisruptionTarget) is counted
    and recreated for its index, where its launcher parks as the new spare."""
    cfg, settings = make_cfg(nodes=2, spare_nodes=1, restart_mode="layered"), make_settings()
    job = training_job(cfg, "try-1", settings, airflow_run_id=AIRFLOW_RUN_ID)
    validate(job, version)
    spec, name = job["spec"], job["metadata"]["name"]
    assert cfg.launch_nodes == 3
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == 3
    (term,) = spec["template"]["spec"]["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term == {"labelSelector": {"matchLabels": {LABEL_JOB: name}}, "topologyKey": "kubernetes.io/hostname"}
    assert env_of(job)["TRAINING_RDZV_HOST"]["value"] == f"{name}-0.{name}.{settings.namespace}.svc"
    assert RunConfig.from_json(env_of(job)["TRAINING_RUN_CONFIG"]["value"]).spare_nodes == 1
    without = training_job(make_cfg(nodes=2, restart_mode="layered"), "try-1", settings)["spec"]
    assert spec["podFailurePolicy"] == without["podFailurePolicy"]
    assert spec["backoffLimit"] == without["backoffLimit"] == training_backoff_limit(settings)
    policy = spec["podFailurePolicy"]
    assert job_controller_action(policy, 143, ("DisruptionTarget",)) == "Count"  # replaced, within the budget
    assert job_controller_action(policy, int(ExitCode.RESTARTS_EXHAUSTED)) == "FailJob"


# --------------------------------------------------------------------------------------------
# Names and labels
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "run_id, launch_id",
    [
        ("a" * 63, "try-1"),
        ("r-" + "x" * 59 + "9", "relaunch-" + "y" * 150),
        ("7", "Try #3 / replaced ip-10-0-1-23.us-west-2.compute.internal"),
        ("run", "___"),
        ("7b-llama", "0"),
        ("0" * 63, "eval-step_00000040"),
    ],
)
def test_names_are_dns_1035_labels_of_at_most_52_chars_for_odd_ids(run_id, launch_id):
    cfg = make_cfg(run_id=run_id, run_dir=f"/fsx/runs/{run_id}")
    settings = make_settings()
    job = training_job(cfg, launch_id, settings, airflow_run_id=AIRFLOW_RUN_ID)
    service = rendezvous_service(cfg, launch_id, settings)
    policy = rendezvous_network_policy(cfg, launch_id, settings)
    evaluation = evaluation_job(cfg, settings)
    name = job["metadata"]["name"]
    for n in (name, service["metadata"]["name"], policy["metadata"]["name"], evaluation["metadata"]["name"]):
        # A Service name must start with a letter (DNS-1035); a digit-first run id gets "r-".
        assert len(n) <= JOB_NAME_MAX and DNS1035_LABEL.match(n) and DNS1123_LABEL.match(n), n
    assert (
        service["metadata"]["name"]
        == policy["metadata"]["name"]
        == job["spec"]["template"]["spec"]["subdomain"]
        == name
    )
    # The highest pod hostname <job>-<index> is a DNS label too.
    assert len(f"{name}-{cfg.nodes - 1}") <= 63 and len(f"{name}-1023") <= 63
    for labels in all_labels(job) + all_labels(service) + all_labels(evaluation):
        for key, value in labels.items():
            assert len(value) <= 63 and LABEL_VALUE.match(value), (key, value)
    assert job["metadata"]["annotations"][LABEL_LAUNCH] == launch_id
    for obj in (job, service, evaluation):
        validate(obj, "1.33")


def test_job_names_start_with_a_letter_and_stay_what_they_were_otherwise():
    import hashlib

    name = job_name_for("7b-llama", "0")
    assert name.startswith("r-7b-llama-0-") and name == job_name_for("7b-llama", "0")
    assert name.endswith(hashlib.sha256(b"7b-llama\x000").hexdigest()[:8])
    assert job_name_for("7b-llama", "1") != name
    # A run id that starts with a letter keeps the name it always had (running jobs are found again).
    assert job_name_for("llm", "0") == "llm-0-" + hashlib.sha256(b"llm\x000").hexdigest()[:8]
    assert job_name_for("___", "___").startswith("r-") and len(job_name_for("___", "___")) == 10
    for run_id in ("7" * 80, "9-" * 40):
        assert len(job_name_for(run_id, "relaunch-2")) <= JOB_NAME_MAX
        assert DNS1035_LABEL.match(job_name_for(run_id, "relaunch-2"))


def test_labels_of_the_training_job_and_its_pods():
    cfg = make_cfg()
    job = training_job(cfg, "try-1", make_settings(), airflow_run_id=AIRFLOW_RUN_ID)
    meta_labels, pod_labels = all_labels(job)
    expected = {
        **MANAGED_BY,
        LABEL_COMPONENT: "training",
        LABEL_RUN: cfg.run_id,
        LABEL_LAUNCH: "try-1",
        LABEL_AIRFLOW_RUN: label_value(AIRFLOW_RUN_ID),
    }
    assert meta_labels == expected
    assert pod_labels == {**expected, LABEL_JOB: job["metadata"]["name"]}
    # Label values cannot hold the Airflow run id; the annotations keep it exactly.
    exact = {LABEL_LAUNCH: "try-1", LABEL_AIRFLOW_RUN: AIRFLOW_RUN_ID}
    assert job["metadata"]["annotations"] == exact
    assert job["spec"]["template"]["metadata"]["annotations"] == {**exact, "karpenter.sh/do-not-disrupt": "true"}
    without = training_job(cfg, "try-1", make_settings())
    assert LABEL_AIRFLOW_RUN not in without["metadata"]["labels"]
    assert LABEL_AIRFLOW_RUN not in without["metadata"]["annotations"]


@pytest.mark.parametrize(
    "text",
    [
        AIRFLOW_RUN_ID,
        "scheduled__2026-01-01T00:00:00+00:00",
        "",
        "-",
        "a" * 64,
        "x" * 300,
        "dataset_triggered__2026-11-30T07:35:43+00:00_" + "z" * 40,
        "ünïcødé run",
        "ends-with-dot.",
    ],
)
def test_label_value_is_valid_deterministic_and_hashed_when_changed(text):
    value = label_value(text)
    assert 1 <= len(value) <= 63 and LABEL_VALUE.match(value), value
    assert label_value(text) == value
    assert value != text
    assert re.search(r"(^|-)[0-9a-f]{8}$", value), value


def test_label_value_keeps_valid_values_and_separates_ids_that_clean_alike():
    for valid in ("try-1", "manual__2026-11-30", "A.b_c-9", "x", "a" * 63):
        assert label_value(valid) == valid
    assert label_value("run:1") != label_value("run+1")
    assert label_value("a" * 64) != label_value("a" * 65)
    assert label_value(AIRFLOW_RUN_ID).startswith("manual__2026-11-30T07-35-43.123456-00-00-")


def test_objects_are_deterministic():
    cfg, settings = make_cfg(), make_settings(zone="us-west-2a", memory="900Gi")
    first = [json.dumps(o, sort_keys=False) for o in all_objects(settings)]
    again = [json.dumps(o, sort_keys=False) for o in all_objects(make_settings(zone="us-west-2a", memory="900Gi"))]
    assert first == again
    assert (
        training_job(cfg, "try-1", settings)["metadata"]["name"]
        != training_job(cfg, "try-2", settings)["metadata"]["name"]
    )


def test_builders_do_not_share_mutable_state_with_settings():
    settings = make_settings()
    job = training_job(make_cfg(), "try-1", settings)
    pod = job["spec"]["template"]["spec"]
    pod["tolerations"][0]["key"] = "changed"
    pod["nodeSelector"]["changed"] = "yes"
    assert settings.tolerations[0]["key"] == "nvidia.com/gpu"
    assert "changed" not in settings.node_selector


# --------------------------------------------------------------------------------------------
# The rendezvous Service
# --------------------------------------------------------------------------------------------


def test_rendezvous_service_selects_the_jobs_pods_before_they_are_ready():
    cfg, settings = make_cfg(rdzv_port=29511), make_settings()
    job = training_job(cfg, "try-1", settings, airflow_run_id=AIRFLOW_RUN_ID)
    service = rendezvous_service(cfg, "try-1", settings, airflow_run_id=AIRFLOW_RUN_ID)
    spec = service["spec"]
    assert service["apiVersion"] == "v1" and service["kind"] == "Service"
    assert service["metadata"]["name"] == job["metadata"]["name"]
    assert service["metadata"]["namespace"] == settings.namespace
    assert spec["clusterIP"] == "None"
    assert spec["publishNotReadyAddresses"] is True
    pod_labels = job["spec"]["template"]["metadata"]["labels"]
    assert spec["selector"] == {LABEL_JOB: job["metadata"]["name"]}
    assert all(pod_labels.get(k) == v for k, v in spec["selector"].items())
    assert spec["ports"] == [{"name": "rdzv", "port": 29511, "targetPort": 29511, "protocol": "TCP"}]
    assert service["metadata"]["labels"] == job["metadata"]["labels"]
    assert "ownerReferences" not in service["metadata"]


def test_rendezvous_service_is_owned_by_the_created_job():
    cfg, settings = make_cfg(), make_settings()
    name = job_name_for(cfg.run_id, "try-1")
    created = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": settings.namespace, "uid": "uid-1234"},
    }
    service = rendezvous_service(cfg, "try-1", settings, owner=created)
    assert service["metadata"]["ownerReferences"] == [
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "name": name,
            "uid": "uid-1234",
            "controller": True,
            "blockOwnerDeletion": False,
        }
    ]
    # The client's model object (what create_namespaced_job returns) works too.
    from kubernetes.client import V1Job, V1ObjectMeta

    from_model = rendezvous_service(cfg, "try-1", settings, owner=V1Job(metadata=V1ObjectMeta(name=name, uid="u-9")))
    assert from_model["metadata"]["ownerReferences"][0]["uid"] == "u-9"


@pytest.mark.parametrize(
    "owner, message",
    [
        ({"metadata": {"name": "some-other-job", "uid": "u"}}, "this launch's Job"),
        ({"metadata": {"name": "x"}}, "metadata.uid"),
        ({}, "metadata.name"),
    ],
)
def test_rendezvous_service_rejects_a_wrong_owner(owner, message):
    cfg = make_cfg()
    if owner.get("metadata", {}).get("name") == "x":
        owner["metadata"]["name"] = job_name_for(cfg.run_id, "try-1")
    with pytest.raises(ValueError, match=message):
        rendezvous_service(cfg, "try-1", make_settings(), owner=owner)


# --------------------------------------------------------------------------------------------
# The evaluation Job
# --------------------------------------------------------------------------------------------


def test_evaluation_job_is_one_pod_one_gpu_no_efa():
    cfg, settings = make_cfg(procs_per_node=8), make_settings(memory="900Gi")
    job = evaluation_job(cfg, settings, airflow_run_id=AIRFLOW_RUN_ID)
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert job["metadata"]["name"] == job_name_for(cfg.run_id, "eval")
    assert spec.get("completionMode", "NonIndexed") == "NonIndexed"
    assert spec["completions"] == 1 and spec["parallelism"] == 1
    assert spec["backoffLimit"] == settings.max_pod_disruptions  # only disruptions are retried
    assert pod["restartPolicy"] == "Never" and "subdomain" not in pod
    assert pod["automountServiceAccountToken"] is False
    c = container_of(job)
    assert c["command"] == ["python", "-m", "fsdp_resilience.training.evaluate", "--config", f"{cfg.run_dir}/run.json"]
    # One GPU's share of the node, Guaranteed; no EFA; a small /dev/shm (no async checkpoint).
    assert (
        c["resources"]["limits"]
        == c["resources"]["requests"]
        == {"nvidia.com/gpu": "1", "cpu": "22", "memory": "225Gi"}
    )
    assert "add" not in c["securityContext"]["capabilities"]
    assert {v["name"]: v for v in pod["volumes"]}["dshm"]["emptyDir"]["sizeLimit"] == "8Gi"
    assert "karpenter.sh/do-not-disrupt" not in job["spec"]["template"]["metadata"].get("annotations", {})
    assert "affinity" not in pod
    assert not [k for k in env_of(job) if k.startswith("FI_")]
    assert "TRAINING_RUN_CONFIG" not in env_of(job)
    labels = job["metadata"]["labels"]
    assert labels[LABEL_COMPONENT] == "evaluation" and labels[LABEL_RUN] == cfg.run_id
    assert LABEL_LAUNCH not in labels
    assert job["spec"]["template"]["metadata"]["labels"][LABEL_JOB] == job["metadata"]["name"]
    # A disruption is retried (counted, within max_pod_disruptions); a failing evaluation fails the
    # same way again, so any failing exit code fails the Job at once.
    for code in (1, 137):
        assert job_controller_action(spec["podFailurePolicy"], code, ("DisruptionTarget",)) == "Count"
        assert job_controller_action(spec["podFailurePolicy"], code) == "FailJob"


def test_evaluation_job_of_a_named_checkpoint():
    # The control plane names the checkpoint it verified: one Job per checkpoint, evaluating that one.
    cfg = make_cfg()
    job = evaluation_job(cfg, make_settings(), checkpoint_id="step_00000040")
    assert job["metadata"]["name"] == job_name_for(cfg.run_id, "eval-step_00000040")
    assert job["spec"]["template"]["metadata"]["labels"][LABEL_JOB] == job["metadata"]["name"]
    assert container_of(job)["command"] == [
        "python",
        "-m",
        "fsdp_resilience.training.evaluate",
        "--config",
        f"{cfg.run_dir}/run.json",
        "--checkpoint",
        "step_00000040",
    ]
    with pytest.raises(ValueError, match="not a checkpoint folder name"):
        evaluation_job(cfg, make_settings(), checkpoint_id="../../etc")


def test_evaluation_job_without_gpus():
    job = evaluation_job(make_cfg(), make_settings(gpus_per_node=0, efa_per_node=0))
    assert "nvidia.com/gpu" not in container_of(job)["resources"]["limits"]
    job = evaluation_job(make_cfg(), make_settings(gpus_per_node=0, efa_per_node=0, eval_cpu=None, eval_memory=None))
    assert "resources" not in container_of(job)


# --------------------------------------------------------------------------------------------
# The rendezvous NetworkPolicy
# --------------------------------------------------------------------------------------------


def test_network_policy_admits_only_the_same_launchs_pods():
    cfg, settings = make_cfg(), make_settings()
    job = training_job(cfg, "try-1", settings, airflow_run_id=AIRFLOW_RUN_ID)
    name = job["metadata"]["name"]
    policy = rendezvous_network_policy(cfg, "try-1", settings, airflow_run_id=AIRFLOW_RUN_ID)
    assert policy["apiVersion"] == "networking.k8s.io/v1" and policy["kind"] == "NetworkPolicy"
    assert policy["metadata"]["name"] == name and policy["metadata"]["namespace"] == settings.namespace
    assert policy["metadata"]["labels"] == job["metadata"]["labels"]
    launch_pods = {"matchLabels": {LABEL_JOB: name}}
    assert policy["spec"] == {
        "podSelector": launch_pods,
        "policyTypes": ["Ingress"],
        "ingress": [{"from": [{"podSelector": launch_pods}]}],
    }  # every port, only from them
    pod_labels = job["spec"]["template"]["metadata"]["labels"]
    assert pod_labels[LABEL_JOB] == name  # the launch's pods are what it selects
    other = rendezvous_network_policy(cfg, "try-2", settings)
    assert other["spec"]["podSelector"] != policy["spec"]["podSelector"]  # another launch: not admitted
    # Owned by the created Job: it goes with the Job.
    owner = {"metadata": {"name": name, "uid": "uid-1"}}
    owned = rendezvous_network_policy(cfg, "try-1", settings, owner=owner)
    assert owned["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    with pytest.raises(ValueError, match="this launch's Job"):
        rendezvous_network_policy(cfg, "try-2", settings, owner=owner)


# --------------------------------------------------------------------------------------------
# What is rejected
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, path",
    [
        ("run_dir", "/home/ubuntu/runs/r"),
        ("run_dir", "/fsx/../etc/runs/r"),
        ("run_dir", "runs/r"),
        ("dataset_dir", "/data/fineweb"),
        ("dataset_dir", "/fsxdata/fineweb"),
    ],
)
def test_paths_outside_the_fsx_mount_are_rejected(field, path):
    cfg = make_cfg(**{field: path})
    for build in (lambda: training_job(cfg, "try-1", make_settings()), lambda: evaluation_job(cfg, make_settings())):
        with pytest.raises(ValueError, match=rf"{field}=.*outside the shared file system.*under /fsx/"):
            build()


def test_paths_under_another_mount_are_accepted():
    cfg = make_cfg(run_dir="/mnt/lustre/runs/r", dataset_dir="/mnt/lustre/data/d")
    job = training_job(cfg, "try-1", make_settings(fsx_mount_path="/mnt/lustre"))
    mounts = {m["name"]: m["mountPath"] for m in container_of(job)["volumeMounts"]}
    assert "/mnt/lustre" in mounts.values()


def test_every_builder_validates_the_settings():
    settings = make_settings(image="")
    cfg = make_cfg()
    for build in (
        lambda: training_job(cfg, "try-1", settings),
        lambda: rendezvous_service(cfg, "try-1", settings),
        lambda: evaluation_job(cfg, settings),
    ):
        with pytest.raises(ValueError, match="image"):
            build()


@pytest.mark.parametrize("launch_id", ["", "   ", "x" * 201, None])
def test_bad_launch_ids_are_rejected(launch_id):
    with pytest.raises(ValueError, match="launch_id"):
        training_job(make_cfg(), launch_id, make_settings())


# --------------------------------------------------------------------------------------------
# The data plane reads what the pod is given
# --------------------------------------------------------------------------------------------


def pod_environment(job: dict, index: int, node_name: str) -> dict[str, str]:
    """The env the kubelet gives pod ``index``: the container's env with the downward API
    resolved (the node name, the pod's UID, the Job's UID from the Job controller's label), plus
    the completion index an Indexed Job adds."""
    downward = {
        "spec.nodeName": node_name,
        "metadata.uid": f"pod-uid-{index}",
        "metadata.labels['batch.kubernetes.io/controller-uid']": "job-uid",
    }
    env = {}
    for entry in container_of(job)["env"]:
        if "value" in entry:
            env[entry["name"]] = entry["value"]
        else:
            env[entry["name"]] = downward[entry["valueFrom"]["fieldRef"]["fieldPath"]]
    env["JOB_COMPLETION_INDEX"] = str(index)
    return env


@pytest.mark.skipif(not TRAINING_PYTHON.exists(), reason=f"no training venv at {TRAINING_PYTHON}: run `make setup`")
def test_training_launch_builds_its_command_from_the_pod_env(tmp_path):
    """``python -m fsdp_resilience.training.launch`` (no flags) in a pod: the config, node rank and rendezvous
    host all come from the env the Job gives it."""
    mount = tmp_path / "fsx"
    dataset = mount / "datasets" / "d"
    dataset.mkdir(parents=True)
    (dataset / "index.json").write_text(
        json.dumps({"format": "byte-tokens-v1", "dtype": "uint16", "train": ["train_0.bin"], "val": ["val_0.bin"]})
    )
    cfg = make_cfg(
        nodes=2, procs_per_node=2, run_dir=str(mount / "runs" / "r"), dataset_dir=str(dataset), rdzv_port=29533
    )
    job = training_job(cfg, "try-1", make_settings(fsx_mount_path=str(mount), gpus_per_node=0, efa_per_node=0))
    name = job["metadata"]["name"]
    command = container_of(job)["command"]
    assert command[0] == "python"
    for index in (0, 1):  # node 0 first: the other nodes wait for its copy of run.json
        env = {"PATH": os.environ.get("PATH", ""), **pod_environment(job, index, f"ip-10-0-0-{index}")}
        result = subprocess.run(
            [str(TRAINING_PYTHON), *command[1:], "--dry-run"],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        assert f"--rdzv-endpoint={name}-0.{name}.fsdp-training.svc:29533" in result.stdout
        assert "--nnodes=2" in result.stdout and "--nproc-per-node=2" in result.stdout
        assert f"is_host={'true' if index == 0 else 'false'}" in result.stdout
    assert RunConfig.load(cfg.layout.config) == cfg
