"""Checkpoints on disk as the training plane leaves them, for control-plane tests (no torch): a
shard file per rank with DCP's names, each rank's checksum record (``contract.write_rank_sums``,
as its writer does after its write), DCP's ``.metadata``, then rank 0's commit. And the ways disks
and people damage them."""

from __future__ import annotations

from pathlib import Path

from fsdp_resilience.training.contract import CheckpointCatalog, write_rank_sums


def save_checkpoint(
    run_dir: str | Path, step: int, world_size: int = 2, *, commit: bool = True, shard_bytes: int = 256
) -> Path:
    """Write checkpoint ``step`` of the run (committed unless ``commit=False``: torn) and return
    its folder. Shard bytes differ per step and rank, as real model state does."""
    catalog = CheckpointCatalog(run_dir)
    path = catalog.layout.checkpoint_dir(step)
    path.mkdir(parents=True, exist_ok=True)
    for rank in range(world_size):
        shard = f"__{rank}_0.distcp"
        (path / shard).write_bytes(bytes((step * 31 + rank * 7 + i) % 251 for i in range(shard_bytes)))
        write_rank_sums(path, rank, [shard])
    (path / ".metadata").write_bytes(f"dcp metadata of step {step}".encode())
    if commit:
        catalog.commit(step, world_size)
    return path


def flip_bytes(path: str | Path, offset: int = 16, count: int = 4) -> None:
    """Flip ``count`` bytes in place: same size, wrong content (a bad disk, a stray write)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        data = f.read(count)
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in data))
