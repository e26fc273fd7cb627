"""The error every rank raises when a save fails anywhere (checkpointing/rounds.py)."""

from __future__ import annotations

import copy
import pickle

from fsdp_resilience.training.checkpointing.rounds import CheckpointWriterError


def test_writer_error_survives_copy_and_pickle():
    """Restart layers (NVRx's in-process Wrapper) copy and re-raise exceptions as cls(*args)."""
    error = CheckpointWriterError(6, "rank 0: writer process died", (0,))
    for clone in (copy.copy(error), pickle.loads(pickle.dumps(error))):
        assert (clone.step, clone.failed_ranks, str(clone)) == (6, (0,), str(error))
    assert str(error) == "checkpoint step 6 failed: rank 0: writer process died"
