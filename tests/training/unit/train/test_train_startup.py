"""What a worker sets up besides model and checkpoint (fsdp_resilience.training.train.startup)."""

from __future__ import annotations

import torch

from fsdp_resilience.training.contract import RunConfig
from fsdp_resilience.training.train.env import WorkerEnv
from fsdp_resilience.training.train.startup import restore_timeout, setup_device


def test_a_cpu_run_trains_on_the_cpu(tmp_path):
    cfg = RunConfig(run_id="r", run_dir=str(tmp_path / "r"), dataset_dir=str(tmp_path / "d"), device="cpu")
    env = WorkerEnv(rank=0, local_rank=0, world_size=1, node_rank=0, attempt=0)
    assert setup_device(cfg, env) == torch.device("cpu")


def test_a_restore_timeout_no_longer_than_the_collective_one_changes_nothing():
    with restore_timeout(30.0, 30.0):  # no process group needed: nothing to change
        pass
