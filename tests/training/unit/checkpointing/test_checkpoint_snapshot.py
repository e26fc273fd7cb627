"""The one host copy a save makes (checkpointing/snapshot.py): reused shared buffers, and NVRx's
staging step without its CUDA sync. Single process."""

from __future__ import annotations

import functools

import pytest
import torch
from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import FileSystemWriterAsync

from fsdp_resilience.training.checkpointing.snapshot import _BUCKETS_IN_WRITER, SnapshotBuffers, _cpu_safe_preload


def test_snapshot_copies_into_reused_shared_buffers():
    weights = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    state = {"model": {"w": weights, "view": weights[:, 1]}, "trainer": {"step": 3, "names": ["a"]}}
    buffers = SnapshotBuffers()

    first = buffers.snapshot(state)
    weights.add_(100.0)  # training goes on
    state["trainer"]["names"].append("b")

    assert torch.equal(first["model"]["w"], torch.arange(12, dtype=torch.float32).reshape(3, 4))
    assert first["model"]["w"].data_ptr() != weights.data_ptr()
    assert first["model"]["w"].is_shared()  # the writer process maps it, no copy through the queue
    assert first["model"]["view"].is_contiguous() and first["model"]["view"].untyped_storage().nbytes() == 3 * 4
    assert first["trainer"] == {"step": 3, "names": ["a"]}

    second = buffers.snapshot(state)
    assert second["model"]["w"].data_ptr() == first["model"]["w"].data_ptr()  # reused, not reallocated
    assert torch.equal(second["model"]["w"], weights)
    assert buffers.nbytes == (12 + 3) * 4


def test_stock_preload_needs_cuda_and_ours_does_not():
    """NVRx 0.4.1's preload syncs CUDA unconditionally; with non_blocking=False it is a no-op
    staging of host tensors. (0.7's preload syncs only for CUDA tensors.)"""
    if _BUCKETS_IN_WRITER:
        pytest.skip("NVRx 0.7's preload builds the buckets in the writer and syncs CUDA only for CUDA tensors")
    tensor = torch.ones(4)
    buckets = [("/nowhere/__0_0.distcp", "__0_0.distcp", ([], [("item", tensor)]))]
    stock = functools.partial(FileSystemWriterAsync.preload_tensors, buckets, True)
    if not torch.cuda.is_available():
        with pytest.raises((AssertionError, RuntimeError)):
            stock()
    staged = _cpu_safe_preload(stock)()
    assert staged[0][2][1][0][1] is tensor


def test_an_overlapped_snapshot_lands_by_wait_copied():
    """overlap=True: the tensor copies run in a copy thread; plain values are copied at once;
    wait_copied returns once every buffer holds the state as it was at the snapshot."""
    weights = torch.randn(256, 1024)
    state = {"model": {"w": weights, "b": torch.arange(7)}, "trainer": {"step": 3, "names": ["a"]}}
    buffers = SnapshotBuffers()
    expected = weights.clone()

    copied = buffers.snapshot(state, overlap=True)
    state["trainer"]["names"].append("b")  # plain values were copied before snapshot returned
    assert buffers.wait_copied() >= 0.0
    weights.add_(1.0)  # the state may change once the copy is waited for

    assert torch.equal(copied["model"]["w"], expected) and torch.equal(copied["model"]["b"], torch.arange(7))
    assert copied["trainer"] == {"step": 3, "names": ["a"]}
    assert buffers.wait_copied() == pytest.approx(0.0, abs=0.01)  # nothing left in flight
    again = buffers.snapshot(state, overlap=True)  # the same buffers, refilled
    buffers.close()
    assert again["model"]["w"].data_ptr() == copied["model"]["w"].data_ptr()
    assert torch.equal(again["model"]["w"], weights)
