"""Shared fixtures: a small real-text dataset and a helper that runs training end to end."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from shared import FAST_RUN, make_dataset
from training.contract import RunConfig, read_events

REPO = Path(__file__).resolve().parent.parent


def lane_versions() -> str:
    """Which NVRx and torch this lane runs: the .venv lane (0.4.1) and tests/nvrx07/lane.sh (0.7).
    From package metadata (the same string as torch.__version__): importing torch this early
    would cost seconds and move its import-time warnings out of pytest's capture."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    return (f"nvidia-resiliency-ext {installed('nvidia-resiliency-ext')}, torch {installed('torch')}, "
            f"Python {platform.python_version()}")


def pytest_report_header(config) -> str:
    return lane_versions()


def pytest_sessionstart(session) -> None:
    """-q (as in make test) hides the report header: print the versions line anyway."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and session.config.get_verbosity() < 0:
        reporter.write_line(lane_versions())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def dataset(tmp_path_factory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("data") / "dataset")


FAST = dict(FAST_RUN, model="tiny", checkpoint_interval=3)


@dataclass
class Run:
    cfg: RunConfig
    rc: int
    output: str

    @property
    def events(self) -> list[dict]:
        return read_events(self.cfg.layout.events)

    def of(self, event: str) -> list[dict]:
        return [r for r in self.events if r["event"] == event]

    def losses(self) -> dict[int, float]:
        """Loss per step; a step replayed after a restart must log the same loss, so keep the last."""
        return {r["step"]: r["loss"] for r in self.of("step")}


def write_config(tmp_path: Path, dataset: Path, run_id: str, **overrides) -> RunConfig:
    fields = dict(FAST, run_id=run_id, run_dir=str(tmp_path / run_id), dataset_dir=str(dataset),
                  rdzv_port=free_port())
    fields.update(overrides)
    cfg = RunConfig(**fields)
    (tmp_path / f"{run_id}.json").write_text(cfg.to_json())
    return cfg


def launch(cfg: RunConfig, cfg_path: Path, *, node_rank: int | None = None, timeout: float = 300) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "training.launch", "--config", str(cfg_path)]
    if node_rank is not None:
        cmd += ["--node-rank", str(node_rank), "--rdzv-host", "127.0.0.1"]
    log = open(Path(cfg_path).with_suffix(f".node{node_rank or 0}.log"), "w")
    return subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def run_training(tmp_path: Path, dataset: Path, run_id: str, timeout: float = 300, **overrides) -> Run:
    cfg = write_config(tmp_path, dataset, run_id, **overrides)
    cfg_path = tmp_path / f"{run_id}.json"
    proc = launch(cfg, cfg_path)
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    output = Path(cfg_path).with_suffix(".node0.log").read_text()
    return Run(cfg, rc, output)
