"""Choosing a checkpoint to resume from (checkpointing/resume.py), single process."""

from __future__ import annotations

import torch

from fsdp_resilience.training.checkpointing.resume import load_latest
from fsdp_resilience.training.contract import Event, EventLog, RunDir, read_events


def test_load_latest_with_nothing_committed(tmp_path):
    layout = RunDir(tmp_path / "run")
    layout.create()
    layout.checkpoint_dir(5).mkdir()  # torn: no marker
    events = EventLog(layout.events)
    assert load_latest(layout.root, {"x": torch.zeros(1)}, events=events) is None
    skips = read_events(layout.events, Event.CHECKPOINT_SKIP)
    assert [r["checkpoint_id"] for r in skips] == ["step_00000005"]
