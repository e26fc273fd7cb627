"""The saved-checkpoint double leaves what the training plane's writers and rank 0 leave: a
checkpoint the catalog counts and ``verify_checkpoint`` trusts, a torn one it never counts, and
flipped bytes that verification catches."""

from __future__ import annotations

from fsdp_resilience.training.contract import CheckpointCatalog, verify_checkpoint

from control.fakes.saved_checkpoints import flip_bytes, save_checkpoint


def test_a_saved_checkpoint_is_committed_and_verifies(tmp_path):
    path = save_checkpoint(tmp_path / "run", step=20, world_size=2)
    catalog = CheckpointCatalog(tmp_path / "run")
    assert [c.step for c in catalog.committed()] == [20]
    assert catalog.latest().path == path
    assert verify_checkpoint(path) is None
    assert sorted(p.name for p in path.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]


def test_shards_differ_per_step_and_rank(tmp_path):
    a = save_checkpoint(tmp_path / "run", step=10)
    b = save_checkpoint(tmp_path / "run", step=20)
    assert (a / "__0_0.distcp").read_bytes() != (b / "__0_0.distcp").read_bytes()
    assert (a / "__0_0.distcp").read_bytes() != (a / "__1_0.distcp").read_bytes()


def test_an_uncommitted_checkpoint_is_torn(tmp_path):
    save_checkpoint(tmp_path / "run", step=10)
    save_checkpoint(tmp_path / "run", step=20, commit=False)
    catalog = CheckpointCatalog(tmp_path / "run")
    assert [c.step for c in catalog.committed()] == [10]
    assert [c.step for c in catalog.torn()] == [20]
    assert catalog.latest().step == 10


def test_flipped_bytes_keep_the_size_and_fail_verification(tmp_path):
    path = save_checkpoint(tmp_path / "run", step=10)
    shard = path / "__1_0.distcp"
    size = shard.stat().st_size
    flip_bytes(shard)
    assert shard.stat().st_size == size
    reason = verify_checkpoint(path)
    assert reason is not None and "__1_0.distcp" in reason
