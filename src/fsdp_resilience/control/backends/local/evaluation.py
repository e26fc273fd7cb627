"""Evaluating a local run: ``python -m fsdp_resilience.training.evaluate`` in the training venv, as a
subprocess (the control plane never imports torch)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from fsdp_resilience.control.backends.base import BackendError
from fsdp_resilience.training.contract import RunConfig


def evaluate_checkpoint(
    training_python: str, repo_root: Path, cfg: RunConfig, checkpoint_id: str | None, timeout_s: float
) -> dict[str, Any]:
    """Evaluate checkpoint ``checkpoint_id`` (None: the newest committed one) of ``cfg`` (absolute
    paths) in ``repo_root`` and return ``<run_dir>/eval.json``; BackendError with its output when
    it fails or runs past ``timeout_s``."""
    command = [training_python, "-m", "fsdp_resilience.training.evaluate", "--config", str(cfg.layout.config)]
    if checkpoint_id is not None:
        command += ["--checkpoint", checkpoint_id]
    try:
        out = subprocess.run(command, cwd=repo_root, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise BackendError(f"evaluation of run {cfg.run_id} did not finish within {timeout_s:.0f}s") from None
    print(out.stdout + out.stderr, end="")
    if out.returncode != 0:
        raise BackendError(
            f"evaluation of run {cfg.run_id} failed (exit {out.returncode}): {out.stderr.strip()[-2000:]}"
        )
    return json.loads((Path(cfg.run_dir) / "eval.json").read_text())
