"""Write results from the writer to the trainer, tagged with their save's number
(checkpointing/write_results.py). Single process: the writer's side is only refused here."""

from __future__ import annotations

import pickle
import queue

import pytest

from fsdp_resilience.training.checkpointing.write_results import _WriteResultsChannel


def test_a_late_write_result_is_never_read_as_a_newer_saves():
    """Write results come back over the writer's completion queue, tagged with their save's own
    number: an abandoned save's result arriving late is not the next save's, and is dropped."""
    channel = _WriteResultsChannel()
    try:
        abandoned, current = channel.new_queue(), channel.new_queue()
        travelled = pickle.loads(pickle.dumps(current))  # what the writer process gets: the number only
        assert travelled.number == current.number != abandoned.number
        with pytest.raises(RuntimeError, match="writer process"):
            travelled.put({})  # only the writer process sends results
        with pytest.raises(queue.Empty):
            current.get_nowait()  # nothing arrived yet
        channel.file(current.number, "current's result")
        channel.file(abandoned.number, "abandoned save's late result")
        assert current.get_nowait() == "current's result"
        with pytest.raises(queue.Empty):
            abandoned.get_nowait()  # dropped once a newer save's result was read
    finally:
        channel.close()
