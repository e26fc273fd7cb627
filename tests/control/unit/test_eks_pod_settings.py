"""The EKS pods' own settings (eks/pod_settings.py): validation names the wrong field and what to
set instead, and nothing is built from bad settings; the settings survive JSON; and what they
derive (GPUs per pod, the nodeSelector, device RDMA)."""

from __future__ import annotations

import json

import pytest

from fsdp_resilience.control.backends.eks.constants import INSTANCE_TYPE_LABEL, ZONE_LABEL
from fsdp_resilience.control.backends.eks.manifests import training_job
from fsdp_resilience.control.backends.eks.pod_settings import PodTemplateSettings

from control.support.eks_pods import make_cfg, make_settings


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(image=""), r"image=''.*container image"),
        (dict(image="repo/img: 1"), r"image="),
        (dict(namespace="Training_NS"), r"namespace=.*namespace name"),
        (dict(service_account="SA"), r"service_account=.*object name"),
        (dict(fsx_claim=""), r"fsx_claim="),
        (dict(fsx_mount_path="fsx"), r"fsx_mount_path=.*absolute path"),
        (dict(fsx_mount_path="/"), r"fsx_mount_path="),
        (dict(fsx_mount_path="/dev"), r"fsx_mount_path=.*/dev/shm"),
        (dict(node_selector={"pool": "gpu nodes"}), r"node_selector="),
        (dict(tolerations=[{"key": "nvidia.com/gpu", "operator": "Exist"}]), r"tolerations=.*operator"),
        (dict(tolerations=[{"key": "k", "efect": "NoSchedule"}]), r"unknown toleration field.*efect"),
        (dict(tolerations=[{"key": "k", "operator": "Exists", "value": "v"}]), r"Exists takes no value"),
        (dict(gpus_per_node=-1), r"gpus_per_node=-1"),
        (dict(efa_per_node=True), r"efa_per_node=True"),
        (dict(memory=None), r"guaranteed_qos=True needs cpu and memory"),
        (dict(instance_type="p5"), r"instance_type=.*EC2 instance type"),
        (dict(guaranteed_qos="yes"), r"guaranteed_qos=.*true or false"),
        (dict(zone="us-west-2"), r"zone='us-west-2'.*availability zone name"),
        (
            dict(zone="us-west-2b", node_selector={"topology.kubernetes.io/zone": "us-west-2a"}),
            r"zone='us-west-2b' contradicts node_selector\['topology.kubernetes.io/zone'\]='us-west-2a'",
        ),
        (dict(shm_size="0"), r"shm_size=.*None to size it from the model"),
        (dict(memory="2000Gi"), r"memory='2000Gi' is more than a p5.48xlarge node can give.*at most 1945Gi"),
        (dict(eval_memory="1.95Ti"), r"eval_memory=.*more than a p5.48xlarge node can give"),
        (dict(run_as_user=0), r"run_as_user=0.*non-root"),
        (dict(max_pod_disruptions=-1), r"max_pod_disruptions="),
        (dict(eval_memory="lots"), r"eval_memory=.*quantity"),
        (dict(shm_size="lots"), r"shm_size=.*quantity"),
        (dict(memory="1TB"), r"memory=.*quantity"),
        (dict(backoff_limit=-1), r"backoff_limit="),
        (dict(active_deadline_s=0), r"active_deadline_s="),
        (dict(termination_grace_s=1.5), r"termination_grace_s="),
        (dict(priority_class="High Priority"), r"priority_class="),
        (dict(image_pull_policy="Sometimes"), r"image_pull_policy=.*IfNotPresent"),
        (dict(env={"NCCL_DEBUG": 1}), r"env=.*values must be strings"),
        (dict(env={"BAD=NAME": "x"}), r"env=.*invalid variable name"),
        (dict(env={"TRAINING_RUN_CONFIG": "{}"}), r"env=.*TRAINING_RUN_CONFIG.*remove it"),
    ],
)
def test_settings_validate_names_the_field_and_what_to_do(overrides, message):
    settings = make_settings(**overrides)  # constructing does not validate: a watcher needs no image
    with pytest.raises(ValueError, match=message):
        settings.validate()
    with pytest.raises(ValueError, match=message):  # and nothing is built from bad settings
        training_job(make_cfg(), "try-1", settings)


def test_settings_survive_json_and_reject_unknown_keys():
    settings = make_settings(gpus_per_node=4, env={"NCCL_DEBUG": "INFO"}, shm_size="200Gi", zone="us-west-2a")
    assert PodTemplateSettings.from_dict(json.loads(json.dumps(settings.to_dict()))) == settings
    with pytest.raises(ValueError, match="unknown pod template setting.*gpus"):
        PodTemplateSettings.from_dict({**settings.to_dict(), "gpus": 8})
    with pytest.raises(ValueError, match="shm_size"):
        PodTemplateSettings.from_dict({**settings.to_dict(), "shm_size": "big"})


def test_the_defaults_are_valid_and_fit_p5():
    settings = make_settings()
    settings.validate()
    assert (settings.instance_type, settings.gpus_per_node, settings.efa_per_node) == ("p5.48xlarge", 8, 32)
    assert settings.guaranteed_qos and settings.run_as_user == settings.run_as_group == 1000


def test_gpus_per_pod_are_the_pools_or_one_per_process():
    cfg = make_cfg(procs_per_node=4)
    assert make_settings().gpus(cfg) == 8
    assert make_settings(gpus_per_node=None).gpus(cfg) == 4
    assert make_settings(gpus_per_node=0).gpus(cfg) == 0


def test_the_pods_node_selector_adds_the_instance_type_unless_the_pool_is_mixed():
    assert make_settings().pod_node_selector() == {"fsdp-resilience/pool": "gpu", INSTANCE_TYPE_LABEL: "p5.48xlarge"}
    assert make_settings(instance_type=None).pod_node_selector() == {"fsdp-resilience/pool": "gpu"}
    # A selector that names the instance type itself wins.
    pinned = make_settings(node_selector={INSTANCE_TYPE_LABEL: "p5e.48xlarge"})
    assert pinned.pod_node_selector() == {INSTANCE_TYPE_LABEL: "p5e.48xlarge"}
    selector = make_settings().node_selector
    make_settings(node_selector=selector).pod_node_selector()["x"] = "y"
    assert "x" not in selector  # a copy


@pytest.mark.parametrize(
    "instance_type, rdma",
    [
        ("p5.48xlarge", True),
        ("p4d.24xlarge", True),
        ("p6-b200.48xlarge", True),
        ("g6e.48xlarge", False),
        ("g5.48xlarge", False),
        (None, False),
    ],
)
def test_device_rdma_follows_the_instance_family(instance_type, rdma):
    assert make_settings(instance_type=instance_type).device_rdma() is rdma


def test_from_dict_validates_unless_asked_not_to():
    with pytest.raises(ValueError, match="image"):
        PodTemplateSettings.from_dict({"image": ""})
    watcher = PodTemplateSettings.from_dict({"image": ""}, validate=False)  # a backend that only watches jobs
    assert watcher.image == "" and watcher.to_dict()["namespace"] == "fsdp-training"
    with pytest.raises(TypeError, match="needs a dict"):
        PodTemplateSettings.from_dict(["image"])


def test_to_dict_is_a_deep_copy():
    settings = make_settings(env={"NCCL_DEBUG": "INFO"})
    data = settings.to_dict()
    data["env"]["NCCL_DEBUG"] = "TRACE"
    data["tolerations"].clear()
    assert settings.env == {"NCCL_DEBUG": "INFO"} and settings.tolerations


@pytest.mark.parametrize(
    "key, says",
    [
        (
            "efa_ipc_lock",
            r"'efa_ipc_lock' was removed: adding CAP_IPC_LOCK does nothing.*memlock limit is now set on the node",
        ),
        ("hugepages_2mi", r"'hugepages_2mi' was removed: the EKS AL2023 GPU AMI reserves no 2 MiB huge pages"),
    ],
)
def test_removed_settings_are_refused_with_what_replaced_them(key, says):
    for value in (True, False, "5120Mi", None):
        with pytest.raises(ValueError, match=says):
            PodTemplateSettings.from_dict({**make_settings().to_dict(), key: value})


def test_a_pinned_zone_joins_the_node_selector():
    assert make_settings(zone="us-west-2b").pod_node_selector() == {
        "fsdp-resilience/pool": "gpu",
        INSTANCE_TYPE_LABEL: "p5.48xlarge",
        ZONE_LABEL: "us-west-2b",
    }
    for zone in ("us-west-2a", "us-gov-west-1b", "us-west-2-lax-1a"):
        make_settings(zone=zone).validate()


def test_shm_is_sized_from_the_model_unless_set():
    """Unset, /dev/shm holds the node's checkpoint staging + 1 GiB a rank, plus a quarter: 8b on
    any number of HSDP nodes gets 119Gi (its 87 GiB snapshot does not fit the old 64Gi)."""
    for nodes in (2, 64, 1024):
        assert make_settings().shm_size_for(make_cfg(model="8b", nodes=nodes)) == "119Gi"
    assert make_settings().shm_size_for(make_cfg(model="1b")) == "26Gi"
    assert make_settings().shm_size_for(make_cfg(model="8b", nodes=4, procs_per_node=1)) == "29Gi"  # FSDP: a quarter
    assert make_settings(shm_size="100Gi").shm_size_for(make_cfg(model="8b")) == "100Gi"


@pytest.mark.parametrize(
    "overrides, says",
    [
        (
            dict(shm_size="64Gi"),
            r"shm_size='64Gi' cannot hold what model 8b on 4 node\(s\) x 8 rank\(s\) keeps in /dev/shm: about 95 GiB "
            r"\(87 GiB of checkpoint snapshot.*at least 96Gi, or leave it unset to size it from the model \(119Gi\)",
        ),
        (dict(shm_size="1850Gi"), r"/dev/shm of 1850Gi is more than their memory='1800Gi'.*at least 1850Gi"),
        (dict(memory="100Gi"), r"/dev/shm of 119Gi is more than their memory='100Gi'.*at least 180Gi"),
        (
            dict(memory=None, guaranteed_qos=False, shm_size="1999Gi"),
            r"a /dev/shm of 1999Gi is more than a p5.48xlarge node can give a pod",
        ),
    ],
)
def test_a_pod_whose_memory_cannot_hold_the_run_is_refused_before_anything_is_built(overrides, says):
    settings = make_settings(**overrides)
    settings.validate()  # each setting is fine alone: it is the run that does not fit
    with pytest.raises(ValueError, match=says):
        training_job(make_cfg(model="8b"), "try-1", settings)


def test_an_explicit_shm_between_the_estimate_and_its_margin_is_the_users_call():
    job = training_job(make_cfg(model="8b"), "try-1", make_settings(shm_size="100Gi"))
    volumes = {v["name"]: v for v in job["spec"]["template"]["spec"]["volumes"]}
    assert volumes["dshm"]["emptyDir"]["sizeLimit"] == "100Gi"


#: The runs docs/run-on-eks.md's /dev/shm table shows: (preset, nodes, ranks a node).
SHM_TABLE_RUNS = [("small", 1, 1), ("1b", 1, 8), ("8b", 1, 8), ("8b", 2, 8), ("8b", 1024, 8), ("8b", 16, 1)]


def shm_table_row(preset: str, nodes: int, ranks: int) -> str:
    from fsdp_resilience.training.contract import GIB, host_memory_for_preset

    need = host_memory_for_preset(preset, nodes, ranks)
    size = make_settings().shm_size_for(make_cfg(model=preset, nodes=nodes, procs_per_node=ranks))
    return (
        f"| `{preset}` | {nodes:,} × {ranks} | {need['checkpoint_staging'] / GIB:.1f} GiB | "
        f"{need['shm'] / GIB:.1f} GiB | `{size}` | {need['total'] / GIB:.0f} GiB |"
    )


def test_the_documented_shm_table_is_the_estimates():
    from control.support import REPO

    docs = (REPO / "docs" / "run-on-eks.md").read_text().splitlines()
    for run in SHM_TABLE_RUNS:
        assert shm_table_row(*run) in docs, (
            f"docs/run-on-eks.md: the /dev/shm row for {run} should read {shm_table_row(*run)}"
        )
