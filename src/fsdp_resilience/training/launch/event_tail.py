"""Reading the run's events log as it grows (a launcher watching its launch)."""

from __future__ import annotations

import json
from pathlib import Path


class EventTail:
    """Reads the events log incrementally: each ``read`` returns the records appended since the
    last (whole lines only: a line still being written is read next time)."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0

    def read(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self.offset += end
        out = []
        for line in data[:end].splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a torn line of a killed writer
            if isinstance(record, dict):
                out.append(record)
        return out
