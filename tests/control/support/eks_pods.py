"""A run and the EKS pods' settings as the manifest tests build them: 4 nodes x 8 ranks on FSx, an
ECR image; each test overrides what it is about."""

from __future__ import annotations

from fsdp_resilience.control.backends.eks.pod_settings import PodTemplateSettings
from fsdp_resilience.training.contract import RunConfig


def make_cfg(**overrides) -> RunConfig:
    values = dict(
        run_id="llama-8b-resilience",
        run_dir="/fsx/runs/llama-8b-resilience",
        dataset_dir="/fsx/datasets/fineweb",
        nodes=4,
        procs_per_node=8,
    )
    values.update(overrides)
    return RunConfig(**values)


def make_settings(**overrides) -> PodTemplateSettings:
    values = dict(image="123456789012.dkr.ecr.us-west-2.amazonaws.com/fsdp-training:1.0")
    values.update(overrides)
    return PodTemplateSettings(**values)
