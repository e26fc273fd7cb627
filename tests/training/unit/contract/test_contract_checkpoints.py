"""Checkpoint layout, commit protocol, verification, quarantine and retention
(fsdp_resilience.training.contract.checkpoints, .checkpoint_catalog)."""

import json

import pytest

from fsdp_resilience.training.contract.checkpoint_catalog import CheckpointCatalog
from fsdp_resilience.training.contract.checkpoints import COMMIT_MARKER, verify_checkpoint, write_rank_sums
from fsdp_resilience.training.contract.rundir import RunDir


def _fake_checkpoint(layout, step, committed):
    d = layout.checkpoint_dir(step)
    d.mkdir(parents=True)
    for rank in (0, 1):
        (d / f"__{rank}_0.distcp").write_bytes(bytes([rank]) * 4096)
        write_rank_sums(d, rank, [f"__{rank}_0.distcp"])
    (d / ".metadata").write_bytes(b"m")
    if committed:
        CheckpointCatalog(layout).commit(step, world_size=2)
    return d


def test_catalog_ignores_torn_checkpoints_and_retention_keeps_last_k(tmp_path):
    layout = RunDir(tmp_path)
    layout.create()
    for step in (10, 20, 30, 40):
        _fake_checkpoint(layout, step, committed=True)
    _fake_checkpoint(layout, 25, committed=False)  # torn, older than the newest
    _fake_checkpoint(layout, 50, committed=False)  # torn or still being written
    cat = CheckpointCatalog(layout)
    assert cat.latest().step == 40
    assert layout.latest_pointer.read_text().strip() == "step_00000040"
    assert [c.step for c in cat.torn()] == [25, 50]
    deleted = cat.apply_retention(keep=2)
    assert sorted(p.name for p in deleted) == ["step_00000010", "step_00000020", "step_00000025"]
    assert [c.step for c in cat.all()] == [30, 40, 50]  # a newer torn folder is not ours to delete
    assert json.loads((layout.checkpoint_dir(40) / COMMIT_MARKER).read_text())["world_size"] == 2


def test_commit_refuses_a_checkpoint_without_metadata(tmp_path):
    layout = RunDir(tmp_path)
    layout.checkpoint_dir(5).mkdir(parents=True)
    with pytest.raises(RuntimeError, match="metadata is missing"):
        CheckpointCatalog(layout).commit(5, world_size=1)


def test_commit_records_every_file_and_refuses_without_checksums(tmp_path):
    layout = RunDir(tmp_path)
    d = _fake_checkpoint(layout, 10, committed=True)
    marker = json.loads((d / COMMIT_MARKER).read_text())
    assert marker["checksum"] == "crc32c"
    assert sorted(marker["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert marker["files"]["__1_0.distcp"]["size"] == 4096
    assert verify_checkpoint(d) is None
    # a rank's checksums missing: not committed
    d2 = _fake_checkpoint(layout, 20, committed=False)
    (d2 / ".sums" / "rank_00001.json").unlink()
    with pytest.raises(RuntimeError, match=r"no checksums from rank\(s\) \[1\]"):
        CheckpointCatalog(layout).commit(20, world_size=2)
    # a file nobody checksummed: not committed
    d3 = _fake_checkpoint(layout, 30, committed=False)
    (d3 / "__2_0.distcp").write_bytes(b"stray")
    with pytest.raises(RuntimeError, match="no checksum for"):
        CheckpointCatalog(layout).commit(30, world_size=2)
    assert [c.step for c in CheckpointCatalog(layout).committed()] == [10]


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda d: (d / "__1_0.distcp").unlink(), "__1_0.distcp is missing"),
        (lambda d: (d / "__0_0.distcp").write_bytes(b"\0" * 100), "is 100 bytes"),
        (lambda d: _flip(d / "__0_0.distcp", 17), "fails its crc32c check"),
        (lambda d: _flip(d / ".metadata", 0), ".metadata fails its crc32c check"),
    ],
)
def test_verify_names_what_is_wrong(tmp_path, damage, reason):
    d = _fake_checkpoint(RunDir(tmp_path), 10, committed=True)
    damage(d)
    assert reason in verify_checkpoint(d)


def _flip(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_marker_without_checksums_does_not_verify(tmp_path):
    d = _fake_checkpoint(RunDir(tmp_path), 10, committed=True)
    (d / COMMIT_MARKER).write_text(json.dumps({"step": 10, "world_size": 2}))
    assert "lists no checksummed files" in verify_checkpoint(d)


def test_quarantine_moves_aside_with_the_reason_and_fixes_latest(tmp_path):
    layout = RunDir(tmp_path)
    for step in (10, 20):
        _fake_checkpoint(layout, step, committed=True)
    cat = CheckpointCatalog(layout)
    moved = cat.quarantine(cat.latest(), "__0_0.distcp fails its crc32c check", rank=1)
    assert not layout.checkpoint_dir(20).exists() and moved.parent == layout.quarantine
    assert [c.step for c in cat.committed()] == [10]
    assert cat.latest_hint() == "step_00000010" and layout.latest_step.read_text().strip() == "10"
    (rec,) = cat.quarantined()
    assert rec["checkpoint_id"] == "step_00000020" and "crc32c" in rec["reason"] and rec["rank"] == 1
    # retention never looks inside the quarantine
    assert cat.apply_retention(keep=1) == [] and moved.exists()


def test_latest_pointer_is_only_a_hint(tmp_path):
    layout = RunDir(tmp_path)
    _fake_checkpoint(layout, 10, committed=True)
    layout.latest_pointer.write_text("../../etc/passwd\n")
    cat = CheckpointCatalog(layout)
    assert cat.latest_hint() is None and cat.latest().step == 10
    layout.latest_pointer.write_text("step_00000099\n")  # dangling
    assert cat.latest().step == 10


def test_retention_never_deletes_the_newest_checkpoint_that_verifies(tmp_path):
    layout = RunDir(tmp_path)
    for step in (10, 20, 30, 40):
        _fake_checkpoint(layout, step, committed=True)
    # the two newest are damaged (a shard gone, a shard truncated): 20 is the newest good one
    (layout.checkpoint_dir(40) / "__0_0.distcp").unlink()
    (layout.checkpoint_dir(30) / "__1_0.distcp").write_bytes(b"short")
    deleted = CheckpointCatalog(layout).apply_retention(keep=2)
    assert [p.name for p in deleted] == ["step_00000010"]
    assert verify_checkpoint(layout.checkpoint_dir(20)) is None
    # and a protected step survives however old it is
    for step in (50, 60):
        _fake_checkpoint(layout, step, committed=True)
    deleted = CheckpointCatalog(layout).apply_retention(keep=2, protect={30})
    assert sorted(p.name for p in deleted) == ["step_00000020", "step_00000040"]
