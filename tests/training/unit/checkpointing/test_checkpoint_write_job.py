"""What the writer does for one save, beside NVRx's write (checkpointing/write_job.py): the model
digest and the writer record the commit reads. Single process."""

from __future__ import annotations

import torch

from fsdp_resilience.training.checkpointing.write_job import model_digest, read_writer_records, write_writer_record


def test_model_digest_is_order_free_and_counts_every_byte():
    a, b = torch.arange(6, dtype=torch.float32), torch.ones(2, 3, dtype=torch.bfloat16)
    digest, nbytes = model_digest([("model.a", (), a), ("model.b", (0, 0), b)])
    assert nbytes == 6 * 4 + 6 * 2
    assert model_digest([("model.b", (0, 0), b), ("model.a", (), a)]) == (digest, nbytes)  # fqn order, not given order
    changed = a.clone()
    changed[3] += 1
    assert model_digest([("model.a", (), changed), ("model.b", (0, 0), b)])[0] != digest
    assert model_digest([("model.empty", (), torch.empty(0))]) == model_digest([])


def test_writer_records_are_read_only_when_every_rank_wrote_one(tmp_path):
    step = tmp_path / "step_00000001"
    step.mkdir()
    write_writer_record(step, 0, model_crc32c="0000abcd", model_bytes=8)
    assert read_writer_records(step, 2) is None  # rank 1's is missing
    write_writer_record(step, 1, model_crc32c="0000ef01", model_bytes=8)
    records = read_writer_records(step, 2)
    assert [r["model_crc32c"] for r in records] == ["0000abcd", "0000ef01"]
