"""The model evaluation loads into (evaluate.empty_model): the run's model, uninitialised, built
without the meta device on the CPU, so that its first build in a process imports nothing more."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from fsdp_resilience.training.contract import RunConfig
from fsdp_resilience.training.evaluate import _SkipInitialisers, empty_model
from fsdp_resilience.training.model import build_model


def _cfg(tmp_path, model: str = "tiny") -> RunConfig:
    return RunConfig(run_id="e", run_dir=str(tmp_path / "run"), dataset_dir=str(tmp_path / "data"), model=model)


def test_the_empty_model_has_the_runs_parameters_on_the_cpu_and_its_derived_buffers_filled(tmp_path):
    cfg = _cfg(tmp_path)
    model = empty_model(cfg, torch.device("cpu"))
    reference = build_model(cfg.model, device="cpu", max_seq_len=cfg.seq_len)

    got, want = model.state_dict(), reference.state_dict()
    assert [(k, v.shape, v.dtype) for k, v in got.items()] == [(k, v.shape, v.dtype) for k, v in want.items()]
    assert all(v.device.type == "cpu" for v in got.values())
    assert torch.equal(model.rope_cos, reference.rope_cos) and torch.equal(model.rope_sin, reference.rope_sin)
    assert not model.rope_cos.is_inference() and model.tok_embeddings.weight.requires_grad  # plain parameters


def test_initialisers_are_skipped_only_while_building():
    weight = torch.full((3, 4), 5.0)
    with _SkipInitialisers():
        torch.nn.init.normal_(weight)
        torch.nn.init.kaiming_uniform_(tensor=weight)
        torch.nn.init.constant_(weight, 1.0)
        weight.uniform_()
        torch.nn.Linear(4, 3)  # its reset_parameters: skipped too
        summed = weight + 1  # everything else runs
    assert torch.equal(weight, torch.full((3, 4), 5.0)) and torch.equal(summed, torch.full((3, 4), 6.0))
    torch.nn.init.zeros_(weight)
    assert torch.equal(weight, torch.zeros(3, 4))


def test_an_unknown_preset_is_still_the_presets_error(tmp_path):
    cfg = _cfg(tmp_path)
    object.__setattr__(cfg, "model", "no-such-preset")
    with pytest.raises(ValueError, match="unknown model preset"):
        empty_model(cfg, torch.device("cpu"))


def test_the_first_build_in_a_process_does_not_import_torch_dynamo(tmp_path):
    """Building on the meta device runs torch's Python meta kernels, whose first call imports
    torch._dynamo (over a second on 2 cores), in every evaluation process."""
    code = (
        "import sys, torch\n"
        "from fsdp_resilience.training.contract import RunConfig\n"
        "from fsdp_resilience.training.evaluate import empty_model\n"
        f"cfg = RunConfig(run_id='e', run_dir={str(tmp_path / 'run')!r}, dataset_dir='.', model='tiny')\n"
        "empty_model(cfg, torch.device('cpu'))\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_checkpoint_read_into_the_empty_model_equals_the_saved_model_bitwise(tmp_path):
    import torch.distributed.checkpoint as dcp

    from fsdp_resilience.training.checkpointing.model_bytes import plan_direct_read, read_model_bytes
    from fsdp_resilience.training.checkpointing.write_job import model_digest

    cfg = _cfg(tmp_path)
    trained = build_model(cfg.model, device="cpu", max_seq_len=cfg.seq_len)
    saved = trained.state_dict()
    dcp.save({"model": saved}, checkpoint_id=str(tmp_path / "step"))
    metadata = dcp.FileSystemReader(str(tmp_path / "step")).read_metadata()
    model = empty_model(cfg, torch.device("cpu"))
    params = model.state_dict()

    digests = read_model_bytes(tmp_path / "step", plan_direct_read(tmp_path / "step", metadata, params), 1)

    assert digests == [model_digest([(f"model.{k}", (), v) for k, v in saved.items()])[0]]
    assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
    tokens = torch.randint(0, 256, (2, cfg.seq_len))
    assert torch.equal(model.eval()(tokens), trained.eval()(tokens))


def test_the_command_freezes_what_it_imported_before_it_loads(tmp_path, monkeypatch):
    """So that the collector's first full pass, which the load's allocations trigger, does not
    scan everything torch imported (gc.freeze)."""
    import gc

    from fsdp_resilience.training import evaluate

    frozen_at_load = []

    def fake_evaluate(cfg, checkpoint_id=None, device=None):
        frozen_at_load.append(gc.get_freeze_count())
        raise evaluate.NoUsableCheckpoint("stop here")

    config = tmp_path / "run.json"
    config.write_text(_cfg(tmp_path).to_json())
    monkeypatch.setattr(evaluate, "evaluate", fake_evaluate)
    try:
        assert evaluate.main(["--config", str(config)]) == evaluate.EXIT_NO_VERIFIED_CHECKPOINT
    finally:
        gc.unfreeze()
    assert frozen_at_load and frozen_at_load[0] > 0
