"""Reading the events log as it grows (fsdp_resilience.training.launch.event_tail)."""

from __future__ import annotations

from fsdp_resilience.training.launch.event_tail import EventTail


def test_each_read_returns_the_whole_lines_appended_since_the_last(tmp_path):
    path = tmp_path / "events.jsonl"
    tail = EventTail(path)
    assert tail.read() == []  # no log yet
    path.write_text('{"event": "a"}\n{"event": "b"}\n{"event": "c"')
    assert [r["event"] for r in tail.read()] == ["a", "b"]
    with open(path, "a") as f:
        f.write('}\n{torn\n[1, 2]\n{"event": "d"}\n')
    assert [r["event"] for r in tail.read()] == ["c", "d"]  # a torn line and a non-record are skipped
    assert tail.read() == []
