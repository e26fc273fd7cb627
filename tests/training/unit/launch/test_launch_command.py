"""The launcher command and ft_launcher's YAML (fsdp_resilience.training.launch.command): pure,
apart from reading the installed NVRx's config class."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from fsdp_resilience.training.contract import ConfigError, RunConfig
from fsdp_resilience.training.launch import command, worker_zygote
from fsdp_resilience.training.launch.command import (
    build_command,
    check_ft_launcher_config,
    ft_launcher_config,
    nnodes_flag,
    write_ft_launcher_config,
)


def config(tmp_path: Path, **kw) -> RunConfig:
    return RunConfig(run_id="r", run_dir=str(tmp_path / "r"), dataset_dir=str(tmp_path / "data"), **kw)


def test_layered_and_injob_runs_use_ft_launcher(tmp_path, monkeypatch):
    monkeypatch.delenv("USE_LIBUV", raising=False)
    cfg = config(tmp_path, nodes=2, max_restarts=4)
    cmd = build_command(cfg, 1, "node0.svc", tmp_path / "ft.yaml", tmp_path)
    # This interpreter runs ft_launcher's main, whether or not a console script is anywhere.
    assert cmd[:3] == command.FT_LAUNCHER and cmd[0] == sys.executable
    assert cmd[3:7] == [
        f"--ft-cfg-path={tmp_path / 'ft.yaml'}",
        "--ft-enable-nic-monitor=false",
        "--max-restarts=4",
        "--nnodes=2",
    ]
    assert f"--nproc-per-node={cfg.procs_per_node}" in cmd
    assert f"--rdzv-endpoint=node0.svc:{cfg.rdzv_port}" in cmd and "--rdzv-id=r" in cmd
    assert "--rdzv-conf=is_host=false,join_timeout=600" in cmd  # node 1 does not host the store
    # Each rank is forked from the node's zygote by the client script, run as a file (see worker_zygote).
    assert cmd[-3:] == [str(worker_zygote.CLIENT_SCRIPT), "--config", str(tmp_path / "r" / "run.json")]
    assert worker_zygote.CLIENT_SCRIPT.is_file()
    assert build_command(config(tmp_path, restart_mode="injob"), 0, "h", tmp_path / "ft.yaml", tmp_path)[:3] == cmd[:3]


@pytest.mark.parametrize("mode", ["inprocess", "none"])
def test_runs_without_in_job_restarts_use_torchrun(tmp_path, monkeypatch, mode):
    monkeypatch.delenv("USE_LIBUV", raising=False)  # the NVRx 0.7 lane sets it (Debian's torch has no libuv)
    cmd = build_command(config(tmp_path, restart_mode=mode), 0, "127.0.0.1", tmp_path / "ft.yaml", tmp_path)
    assert cmd[:4] == [sys.executable, "-m", "torch.distributed.run", "--max-restarts=0"]
    assert "--rdzv-conf=is_host=true,join_timeout=600" in cmd
    assert not any(a.startswith("--ft-") for a in cmd)


def test_a_torch_without_libuv_tells_the_rendezvous(tmp_path, monkeypatch):
    monkeypatch.setenv("USE_LIBUV", "0")
    cmd = build_command(config(tmp_path), 0, "127.0.0.1", tmp_path / "ft.yaml", tmp_path)
    assert "--rdzv-conf=is_host=true,join_timeout=600,use_libuv=false" in cmd


def test_spares_get_a_node_range_and_a_storage_check_on_nvrx_06_only(tmp_path, monkeypatch):
    cfg = config(tmp_path, nodes=2, spare_nodes=1)
    monkeypatch.setattr(command, "nvrx_version", lambda: (0, 7, 0))
    assert nnodes_flag(cfg) == f"--nnodes=2:{cfg.node_rank_limit}"
    cmd = build_command(cfg, 2, "h", tmp_path / "ft.yaml", tmp_path)
    assert f"--ft-storage-health-check-path={(tmp_path / 'r').absolute() / 'checkpoints'}" in cmd
    monkeypatch.setattr(command, "nvrx_version", lambda: (0, 4, 1))
    assert nnodes_flag(cfg) == "--nnodes=2"  # 0.4.1: the rest wait on the redundancy list
    assert not any(a.startswith("--ft-storage") for a in build_command(cfg, 2, "h", tmp_path / "ft.yaml", tmp_path))
    assert nnodes_flag(config(tmp_path, nodes=2)) == "--nnodes=2"


def test_the_ft_section_holds_the_configured_timeouts(tmp_path):
    cfg = config(tmp_path)
    section = ft_launcher_config(cfg, frozenset())["fault_tolerance"]
    assert section["initial_rank_heartbeat_timeout"] == cfg.initial_heartbeat_timeout_s
    assert section["rank_heartbeat_timeout"] == cfg.heartbeat_timeout_s
    assert section["rank_section_timeouts"] == cfg.section_timeouts()
    assert section["safety_factor"] == cfg.timeout_safety_factor
    assert section["rank_termination_signal"] == "SIGKILL"
    assert "checkpoint_iteration_file" not in section  # NVRx 0.4.1 has no progress tracking
    tracked = ft_launcher_config(cfg, {"checkpoint_iteration_file"})["fault_tolerance"]
    assert tracked["checkpoint_iteration_file"] == str(cfg.layout.latest_step.absolute())


class _Parsed:
    def __init__(self, **values):
        self.__dict__.update(values)


def _reads_as(**values) -> type:
    class Config:
        @classmethod
        def from_yaml_file(cls, path, ignore_not_recognized=True):
            assert ignore_not_recognized is False  # unknown keys must be refused, not ignored
            return _Parsed(**values)

    return Config


def test_a_yaml_nvrx_would_read_otherwise_is_a_config_error(tmp_path):
    written = {"fault_tolerance": {"rank_heartbeat_timeout": 30.0, "log_level": "INFO"}}
    check_ft_launcher_config(tmp_path / "ft.yaml", written, _reads_as(rank_heartbeat_timeout=30.0))
    with pytest.raises(ConfigError, match="rank_heartbeat_timeout=3600"):
        check_ft_launcher_config(tmp_path / "ft.yaml", written, _reads_as(rank_heartbeat_timeout=3600))

    class Refuses:
        @classmethod
        def from_yaml_file(cls, path, ignore_not_recognized=True):
            raise ValueError("unknown key")

    with pytest.raises(ConfigError, match="would not read .* as written: unknown key"):
        check_ft_launcher_config(tmp_path / "ft.yaml", written, Refuses)


def test_the_written_yaml_reads_back_with_the_installed_nvrx(tmp_path):
    cfg = config(tmp_path)
    cfg.layout.create()
    path = tmp_path / "ft.yaml"
    write_ft_launcher_config(cfg, path)
    assert json.loads(path.read_text())["fault_tolerance"]["rank_heartbeat_timeout"] == cfg.heartbeat_timeout_s


def test_every_module_the_commands_run_has_a_main():
    for module in ("fsdp_resilience.training.launch", "fsdp_resilience.training.train"):
        assert importlib.util.find_spec(f"{module}.__main__") is not None, module
