"""Reading a checkpoint's model tensors straight into parameters (checkpointing/model_bytes.py),
single process: a DCP save of one rank, read back with the digest the writer would have taken."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from fsdp_resilience.training.checkpointing.model_bytes import NotDirectlyReadable, plan_direct_read, read_model_bytes
from fsdp_resilience.training.checkpointing.write_job import model_digest

# One process, no process group: DCP says it saves as a single process, which is the point here.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _save(path, model: dict[str, torch.Tensor]) -> object:
    dcp.save({"model": model, "optim": {"m": torch.ones(3)}}, checkpoint_id=str(path))
    return dcp.FileSystemReader(str(path)).read_metadata()


def test_model_bytes_land_in_the_parameters_with_the_writers_digest(tmp_path):
    saved = {"a": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.full((5,), 7, dtype=torch.bfloat16)}
    metadata = _save(tmp_path / "step", saved)
    params = {k: torch.zeros_like(v) for k, v in saved.items()}

    chunks = plan_direct_read(tmp_path / "step", metadata, params)
    assert sorted(c.fqn for c in chunks) == ["model.a", "model.b"]  # never the optimizer's
    digests = read_model_bytes(tmp_path / "step", chunks, 1)

    assert all(torch.equal(params[k], saved[k]) for k in saved)
    assert digests == [model_digest([(f"model.{k}", (), v) for k, v in saved.items()])[0]]


def test_a_parameter_of_another_dtype_is_not_read_directly(tmp_path):
    metadata = _save(tmp_path / "step", {"a": torch.ones(4)})
    with pytest.raises(NotDirectlyReadable, match="model.a"):
        plan_direct_read(tmp_path / "step", metadata, {"a": torch.zeros(4, dtype=torch.float64)})


def test_a_shard_of_a_rank_beyond_the_world_size_is_refused(tmp_path):
    metadata = _save(tmp_path / "step", {"a": torch.ones(4)})
    chunks = plan_direct_read(tmp_path / "step", metadata, {"a": torch.zeros(4)})
    with pytest.raises(NotDirectlyReadable, match="rank 0 of a 0-rank save"):
        read_model_bytes(tmp_path / "step", chunks, 0)
