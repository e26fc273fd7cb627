"""What the training tests call: run configs written for a test, launches of
``python -m fsdp_resilience.training.launch`` as a pod runs it (checked for processes left behind),
and a checkpoint's tensors."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from fsdp_resilience.training.contract import RunConfig, read_events
from fsdp_resilience.training.faults import LAUNCH_PID_ENV

from shared import FAST_RUN, REPO, free_port

__all__ = [
    "FAST",
    "REPO",
    "Run",
    "checkpoint_tensors",
    "free_port",
    "launch",
    "launch_processes",
    "run_config",
    "run_training",
    "wait_until_no_process_of",
    "write_config",
]

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

    def last_launch(self) -> list[dict]:
        """The events of the newest launch (from its node-0 ``launch_begin`` on)."""
        events = self.events
        begins = [i for i, r in enumerate(events) if r["event"] == "launch_begin" and r.get("node_rank") == 0]
        return events[begins[-1] :]


def checkpoint_tensors(path: Path, out: Path) -> dict:
    """Every tensor of a DCP checkpoint (model, optimizer, trainer state), by flattened key; the
    checkpoint is converted to a torch.save file at ``out`` on the way."""
    import torch  # here, not at the top: importing torch early costs every test session seconds
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(path), str(out))
    flat: dict[str, torch.Tensor] = {}

    def walk(obj, prefix: str) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{prefix}.{k}" if prefix else str(k))
        elif isinstance(obj, torch.Tensor):
            flat[prefix] = obj

    walk(torch.load(out, weights_only=False), "")
    return flat


def write_config(tmp_path: Path, dataset: Path, run_id: str, **overrides) -> RunConfig:
    fields = dict(FAST, run_id=run_id, run_dir=str(tmp_path / run_id), dataset_dir=str(dataset), rdzv_port=free_port())
    fields.update(overrides)
    cfg = RunConfig(**fields)
    (tmp_path / f"{run_id}.json").write_text(cfg.to_json())
    return cfg


def launch(
    cfg: RunConfig, cfg_path: Path, *, node_rank: int | None = None, env: dict[str, str] | None = None
) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "fsdp_resilience.training.launch", "--config", str(cfg_path)]
    if node_rank is not None:
        cmd += ["--node-rank", str(node_rank), "--rdzv-host", "127.0.0.1"]
    log = open(Path(cfg_path).with_suffix(f".node{node_rank or 0}.log"), "a")
    return subprocess.Popen(
        cmd,
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )


def launch_processes(launch_pid: int) -> list[tuple[int, str]]:
    """Every live process of the launch started by fsdp_resilience.training.launch ``launch_pid``, found by the
    mark it gives them all (TRAINING_LAUNCH_PID in their environment, inherited by ranks, NVRx's
    helpers and daemons, whatever session or parent they end up with), with its command line."""
    mark = f"{LAUNCH_PID_ENV}={launch_pid}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if mark not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue  # exited; only its parent's bookkeeping is left
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue  # gone meanwhile, or not ours to read
        found.append((int(entry), cmdline))
    return found


def wait_until_no_process_of(launch_pid: int, timeout: float = 120) -> list[tuple[int, str]]:
    """Wait (bounded) until no process of the launch is left; returns what is left at the end."""
    deadline = time.monotonic() + timeout
    while True:
        left = launch_processes(launch_pid)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def run_config(tmp_path: Path, cfg: RunConfig, timeout: float = 400) -> Run:
    """Launch ``cfg`` as a pod would, wait for it, and check that it left no process behind."""
    cfg_path = tmp_path / f"{cfg.run_id}.json"
    cfg_path.write_text(cfg.to_json())
    proc = launch(cfg, cfg_path)
    try:
        rc = proc.wait(timeout=timeout)
    except BaseException:  # timed out, or interrupted: the launcher takes its whole tree with it
        proc.kill()
        raise
    output = cfg_path.with_suffix(".node0.log").read_text()
    # The launcher reaps before it exits; a loaded machine may take a moment to show it.
    left = wait_until_no_process_of(proc.pid, timeout=10)
    assert not left, f"processes left behind by the launcher (pid {proc.pid}):\n" + "\n".join(
        f"{pid} {cmd[:200]}" for pid, cmd in left
    )
    return Run(cfg, rc, output)


def run_training(tmp_path: Path, dataset: Path, run_id: str, timeout: float = 400, **overrides) -> Run:
    """Write a config (``FAST`` plus ``overrides``) and run it to the end with ``run_config``."""
    return run_config(tmp_path, write_config(tmp_path, dataset, run_id, **overrides), timeout)
