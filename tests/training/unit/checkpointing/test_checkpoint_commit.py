"""Rank 0's side of the commit (checkpointing/commit.py), single process: the records a rank with
nothing to write leaves, and the removal of torn leftovers (never of a committed checkpoint)."""

from __future__ import annotations

from fsdp_resilience.training.checkpointing.commit import remove_torn, write_empty_sums
from fsdp_resilience.training.checkpointing.write_job import model_digest, read_writer_records
from fsdp_resilience.training.contract import COMMIT_MARKER, SUMS_DIR


def test_a_rank_with_nothing_to_write_still_leaves_its_records(tmp_path):
    step = tmp_path / "step_00000004"
    write_empty_sums(step, 0)
    assert any((step / SUMS_DIR).iterdir())
    (record,) = read_writer_records(step, 1)
    assert (record["model_crc32c"], record["model_bytes"]) == model_digest([])


def test_remove_torn_removes_only_uncommitted_folders(tmp_path):
    torn, committed = tmp_path / "step_00000002", tmp_path / "step_00000003"
    for folder in (torn, committed):
        folder.mkdir()
        (folder / "__0_0.distcp").write_bytes(b"x")
    (committed / COMMIT_MARKER).write_text("{}")
    remove_torn(torn)
    remove_torn(committed)
    remove_torn(tmp_path / "step_00000009")  # nothing there: nothing to do
    assert not torn.exists() and (committed / "__0_0.distcp").exists()
