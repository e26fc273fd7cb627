"""The EKS pods' own settings (eks/pod_settings.py): validation names the wrong field and what to
set instead, and nothing is built from bad settings; the settings survive JSON; and what they
derive (GPUs per pod, the nodeSelector, device RDMA)."""

from __future__ import annotations

import json

import pytest

from fsdp_resilience.control.backends.eks.constants import INSTANCE_TYPE_LABEL
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
        (dict(hugepages_2mi="5120Mi", memory=None, guaranteed_qos=False), r"hugepages_2mi=.*needs memory"),
        (dict(memory=None), r"guaranteed_qos=True needs cpu and memory"),
        (dict(instance_type="p5"), r"instance_type=.*EC2 instance type"),
        (dict(efa_ipc_lock="yes"), r"efa_ipc_lock=.*true or false"),
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
    settings = make_settings(gpus_per_node=4, env={"NCCL_DEBUG": "INFO"}, hugepages_2mi="2Gi", memory="10Gi")
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
