"""Where a node's launcher gets its config and its place (fsdp_resilience.training.launch.config)."""

from __future__ import annotations

import pytest

from fsdp_resilience.training.contract import ConfigError, RunConfig
from fsdp_resilience.training.launch.config import CONFIG_ENV, load_config, node_rank_from_env, rdzv_host_from_env

PLACE_VARS = ("JOB_COMPLETION_INDEX", "NODE_RANK", "TRAINING_RDZV_HOST", "MASTER_ADDR", CONFIG_ENV)


@pytest.fixture
def clean_env(monkeypatch):
    for var in PLACE_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def config(tmp_path, **kw) -> RunConfig:
    return RunConfig(run_id="r", run_dir=str(tmp_path / "r"), dataset_dir=str(tmp_path / "data"), **kw)


def test_the_node_rank_comes_from_the_flag_then_the_job_index_then_node_rank(clean_env):
    assert node_rank_from_env(None) == 0
    clean_env.setenv("NODE_RANK", "2")
    assert node_rank_from_env(None) == 2
    clean_env.setenv("JOB_COMPLETION_INDEX", "1")  # a Kubernetes Indexed Job's pod
    assert node_rank_from_env(None) == 1
    assert node_rank_from_env(3) == 3
    clean_env.setenv("JOB_COMPLETION_INDEX", " ")  # blank: not set
    assert node_rank_from_env(None) == 2


def test_the_rendezvous_host_comes_from_the_flag_then_the_env(tmp_path, clean_env):
    single, multi = config(tmp_path), config(tmp_path, nodes=2)
    assert rdzv_host_from_env(None, single) == "127.0.0.1"
    with pytest.raises(ConfigError, match="needs the rendezvous host"):
        rdzv_host_from_env(None, multi)
    clean_env.setenv("MASTER_ADDR", "10.0.0.1")
    assert rdzv_host_from_env(None, multi) == "10.0.0.1"
    clean_env.setenv("TRAINING_RDZV_HOST", "run-0.svc")
    assert rdzv_host_from_env(None, multi) == "run-0.svc"
    assert rdzv_host_from_env("node0", multi) == "node0"


def test_the_config_comes_from_a_file_else_the_env(tmp_path, clean_env):
    cfg = config(tmp_path, steps=7)
    path = tmp_path / "run.json"
    path.write_text(cfg.to_json())
    assert load_config(str(path)).steps == 7
    with pytest.raises(ConfigError, match=CONFIG_ENV):
        load_config(None)
    clean_env.setenv(CONFIG_ENV, cfg.to_json())
    assert load_config(None).steps == 7
