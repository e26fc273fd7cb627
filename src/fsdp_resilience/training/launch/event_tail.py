"""Reading the run's events log as it grows (a launcher watching its launch)."""

from __future__ import annotations

from pathlib import Path

from fsdp_resilience.training.contract import read_events_since


class EventTail:
    """Reads the events log incrementally: each ``read`` returns the records appended since the
    last (whole lines only: a line still being written is read next time)."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0

    def read(self) -> list[dict]:
        records, self.offset = read_events_since(self.path, self.offset)
        return records
