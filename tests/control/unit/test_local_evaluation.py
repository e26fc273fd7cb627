"""Evaluating a local run (backends/local/evaluation.py): the subprocess it runs and what it returns.
A stand-in interpreter (a shell script) plays the training venv's Python; no torch here."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from fsdp_resilience.control.backends import BackendError
from fsdp_resilience.control.backends.local.evaluation import evaluate_checkpoint
from fsdp_resilience.training.contract import RunConfig


def stand_in_python(tmp_path: Path, body: str) -> str:
    script = tmp_path / "python"
    script.write_text("#!/bin/sh\n" + body + "\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


def config(tmp_path: Path) -> RunConfig:
    return RunConfig(run_id="r", run_dir=str(tmp_path / "run"), dataset_dir=str(tmp_path / "data"))


def test_returns_eval_json_and_passes_the_checkpoint(tmp_path, capsys):
    cfg = config(tmp_path)
    Path(cfg.run_dir).mkdir()
    python = stand_in_python(tmp_path, f'echo "$@"; echo \'{{"loss": 1.5}}\' > {cfg.run_dir}/eval.json')
    assert evaluate_checkpoint(python, tmp_path, cfg, "step-10", 30) == {"loss": 1.5}
    printed = capsys.readouterr().out
    assert "-m fsdp_resilience.training.evaluate --config" in printed and "--checkpoint step-10" in printed
    evaluate_checkpoint(python, tmp_path, cfg, None, 30)
    assert "--checkpoint" not in capsys.readouterr().out  # None: the newest committed one


def test_a_failed_evaluation_raises_with_its_output(tmp_path):
    python = stand_in_python(tmp_path, "echo 'no committed checkpoint' >&2; exit 3")
    with pytest.raises(BackendError, match=r"evaluation of run r failed \(exit 3\): no committed checkpoint"):
        evaluate_checkpoint(python, tmp_path, config(tmp_path), None, 30)


def test_an_evaluation_past_its_timeout_raises(tmp_path):
    python = stand_in_python(tmp_path, "exec sleep 5")
    with pytest.raises(BackendError, match="did not finish within 0s"):
        evaluate_checkpoint(python, tmp_path, config(tmp_path), None, 0.2)


def test_eval_json_is_read_from_the_run_dir(tmp_path):
    cfg = config(tmp_path)
    Path(cfg.run_dir).mkdir()
    (Path(cfg.run_dir) / "eval.json").write_text(json.dumps({"accuracy": 0.5}))
    assert evaluate_checkpoint(stand_in_python(tmp_path, "true"), tmp_path, cfg, None, 30) == {"accuracy": 0.5}
