"""What gpu_check runs: where its report goes, the run settings on CUDA, one run config per scenario
(built, and so validated, by RunConfig), and the command lines that start a run or a worker.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from bench.common import REPO, RESULTS, free_port
from fsdp_resilience.training.contract import RunConfig

DOC = REPO / "docs" / "gpu.md"
JSON_OUT = RESULTS / "gpu.json"
WORK = REPO / "runs" / "gpu-check"  # /runs/ is git-ignored; `make clean` removes it

#: Every launched run: the product path on CUDA (NCCL, bf16, layered restarts) with timeouts short
#: enough to resolve the drills in seconds yet valid on NCCL (RunConfig.validate orders them).
#: collective_timeout_s is left unset: the contract derives it for the backend (on NCCL, above
#: the in-process hard timeout, so the watchdog never kills ranks a hang recovery would save).
GPU_RUN: dict[str, Any] = {
    "model": "small",
    "seq_len": 1024,
    "batch_size": 8,
    "device": "cuda",
    "nodes": 1,
    "restart_mode": "layered",
    "hang_timeout_s": 15.0,
    "heartbeat_timeout_s": 60.0,
    "initial_heartbeat_timeout_s": 300.0,
    "keep_checkpoints": 2,
    "eval_batches": 8,
}
#: The ``python -m fsdp_resilience.training.launch`` runs. Drills fire at step 12, after the step-10 checkpoint,
#: so each recovery also restores a committed checkpoint.
LAUNCH_SCENARIOS: dict[str, dict[str, Any]] = {
    "train": {"steps": 40, "checkpoint_interval": 10},
    "exception": {"steps": 20, "checkpoint_interval": 5, "faults": [{"kind": "exception", "step": 12, "rank": 0}]},
    "hang": {"steps": 20, "checkpoint_interval": 5, "faults": [{"kind": "hang", "step": 12, "rank": 0}]},
    "sigkill": {"steps": 20, "checkpoint_interval": 5, "faults": [{"kind": "sigkill", "step": 12, "rank": 0}]},
}
CHECKPOINT_SAVES = 5  # the first one pins its buffers and waits for the writer's boot: not timed
MEMORY_STEPS = 3
WARMUP_STEPS = 5  # steps left out of step-time medians (allocator, cuBLAS and NCCL warm-up)
STALL_TARGET = 2.0  # stall <= 2x the memcpy floor: the target docs/benchmarks.md measures on CPU
STOP_GRACE_S = 30.0  # SIGTERM -> SIGKILL: fsdp_resilience.training.launch and torchrun stop their workers first


# --------------------------------------------------------------------------------------------
# Run configs: one per scenario, built (and so validated) by RunConfig
# --------------------------------------------------------------------------------------------


def build_configs(work: Path, dataset: Path, gpus: int) -> dict[str, RunConfig]:
    """Every run config the checks use. Raises ConfigError (naming the field) if one is invalid."""
    configs = {}
    for name, scenario in LAUNCH_SCENARIOS.items():
        configs[name] = RunConfig(
            **{**GPU_RUN, **scenario},
            run_id=f"gpu-check-{name}",
            run_dir=str(work / "runs" / name),
            dataset_dir=str(dataset),
            procs_per_node=gpus,
            rdzv_port=free_port(),
        )
    # The workers below take their settings from a RunConfig too, so the dry run validates them.
    configs["checkpoint"] = RunConfig(
        **GPU_RUN,
        run_id="gpu-check-checkpoint",
        run_dir=str(work / "runs" / "checkpoint"),
        dataset_dir=str(dataset),
        procs_per_node=gpus,
        steps=CHECKPOINT_SAVES,
        checkpoint_interval=1,
    )
    # The 1b preset's default run (fsdp_resilience.training.model.PRESET_RUNS): its tokens per rank per step, so
    # the figure can be set beside the README's estimate (memory_per_gpu).
    from fsdp_resilience.training.model import PRESET_RUNS  # torch: imported only where a config needs it

    preset = PRESET_RUNS["1b"]
    configs["memory"] = RunConfig(
        run_id="gpu-check-memory",
        run_dir=str(work / "runs" / "memory"),
        dataset_dir=str(dataset),
        model="1b",
        device="cuda",
        procs_per_node=gpus,
        steps=MEMORY_STEPS,
        batch_size=preset.batch_size,
        seq_len=preset.seq_len,
    )
    return configs


def write_configs(configs: dict[str, RunConfig], folder: Path) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, cfg in configs.items():
        paths[name] = folder / f"{name}.json"
        paths[name].write_text(cfg.to_json() + "\n")
    return paths


def launch_command(cfg_path: Path, dry_run: bool = False) -> list[str]:
    return [sys.executable, "-m", "fsdp_resilience.training.launch", "--config", str(cfg_path)] + (
        ["--dry-run"] if dry_run else []
    )


def worker_command(worker: str, cfg_path: Path, result: Path, gpus: int) -> list[str]:
    """One process per GPU under torchrun, each running ``worker`` (workers.py)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={gpus}",
        "-m",
        "bench.gpu_check",
        "--worker",
        worker,
        "--config",
        str(cfg_path),
        "--result",
        str(result),
    ]
