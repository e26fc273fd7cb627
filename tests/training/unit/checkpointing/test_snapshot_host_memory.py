"""The host-memory estimate the EKS pods' /dev/shm is sized from (contract.host_memory_per_node)
holds what a save really stages: the snapshot of a real model and AdamW state is
``checkpoint_staging`` bytes, all of it in shared memory (/dev/shm)."""

from __future__ import annotations

import torch

from fsdp_resilience.training.checkpointing.snapshot import SnapshotBuffers, app_state
from fsdp_resilience.training.contract import host_memory_per_node
from fsdp_resilience.training.model import PRESETS, build_model


def test_a_saves_snapshot_is_the_estimated_staging_and_lives_in_shared_memory():
    torch.manual_seed(0)
    model = build_model("tiny", device="cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, 256, (2, 16))).float().mean().backward()
    optimizer.step()  # AdamW's moments exist from the first step on

    buffers = SnapshotBuffers()
    buffers.snapshot(app_state(model, optimizer, {"step": 1}))

    estimate = host_memory_per_node(PRESETS["tiny"], nodes=1, procs_per_node=1)["checkpoint_staging"]
    step_counters = 4 * len(optimizer.state)  # AdamW's per-parameter fp32 step: not in the estimate
    assert buffers.nbytes == estimate + step_counters
    assert all(b.is_shared() for b in buffers.buffers if b.numel())
