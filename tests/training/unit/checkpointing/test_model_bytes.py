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


@pytest.mark.parametrize("sizes", [(0, 5), (5, 0), (1, 1), (3, 4096), (1 << 20, 3 << 20), (7, 13, 1 << 16, 0, 9)])
def test_combined_crcs_equal_the_crc_of_the_bytes_in_sequence(sizes):
    import os

    import crc32c

    from fsdp_resilience.training.checkpointing.model_bytes import crc32c_combine

    parts = [os.urandom(n) for n in sizes]
    combined = 0
    for part in parts:
        combined = crc32c_combine(combined, crc32c.crc32c(part), len(part))
    assert combined == crc32c.crc32c(b"".join(parts))


def test_chunks_read_in_many_blocks_and_into_strided_parameters_have_the_writers_digest(tmp_path, monkeypatch):
    """Blocks far smaller than the tensors (each checksummed as it lands, the chunks' CRCs
    combined in the writer's order), and a parameter that is a non-contiguous view."""
    from fsdp_resilience.training.checkpointing import model_bytes

    monkeypatch.setattr(model_bytes, "_BLOCK_BYTES", 100)
    saved = {
        "z": torch.randn(37, 11),
        "a": torch.arange(1000, dtype=torch.float32),
        "t": torch.randn(6, 5),
        "empty": torch.zeros(0),
    }
    metadata = _save(tmp_path / "step", saved)
    params = {k: torch.zeros_like(v) for k, v in saved.items()}
    params["t"] = torch.zeros(5, 6).t()  # strided: read into a buffer, then copied in
    chunks = plan_direct_read(tmp_path / "step", metadata, params)

    digests = read_model_bytes(tmp_path / "step", chunks, 1)

    assert all(torch.equal(params[k], saved[k]) for k in saved)
    assert digests == [model_digest([(f"model.{k}", (), v) for k, v in saved.items()])[0]]


def test_the_digest_is_over_the_bytes_that_landed_in_the_parameters(tmp_path, monkeypatch):
    """What is checked is the parameters' memory after the read, not the file: a read that
    delivers a wrong byte (or a file changed under it) gives a digest the commit's cannot match."""
    import os

    from fsdp_resilience.training.checkpointing import model_bytes

    saved = {"a": torch.arange(4096, dtype=torch.float32)}
    metadata = _save(tmp_path / "step", saved)
    params = {"a": torch.zeros(4096)}
    chunks = plan_direct_read(tmp_path / "step", metadata, params)
    real_preadv = os.preadv

    def preadv_one_bit_off(fd, buffers, offset):
        n = real_preadv(fd, buffers, offset)
        buffers[0][n // 2] ^= 0x01
        return n

    monkeypatch.setattr(model_bytes.os, "preadv", preadv_one_bit_off)
    digests = read_model_bytes(tmp_path / "step", chunks, 1)

    assert digests != [model_digest([("model.a", (), saved["a"])])[0]]
    assert digests == [model_digest([("model.a", (), params["a"])])[0]]  # exactly what landed


def test_a_file_changed_after_the_read_changes_nothing_loaded(tmp_path):
    """The parameters hold their own copy of the bytes that were checked: later writes to the
    checkpoint's files do not reach them (no memory is shared with the file or the page cache)."""
    saved = {"a": torch.arange(4096, dtype=torch.float32)}
    metadata = _save(tmp_path / "step", saved)
    params = {"a": torch.zeros(4096)}
    chunks = plan_direct_read(tmp_path / "step", metadata, params)
    digests = read_model_bytes(tmp_path / "step", chunks, 1)
    (chunk,) = chunks
    with open(tmp_path / "step" / chunk.file, "r+b") as f:
        f.seek(chunk.at)
        f.write(b"\xff" * chunk.nbytes)

    assert digests == [model_digest([("model.a", (), saved["a"])])[0]]
    assert torch.equal(params["a"], saved["a"])
