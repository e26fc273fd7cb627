"""Checks the report tests share: the goodput parts add up, and a built report's files are there."""

from __future__ import annotations

import json

import pytest

from fsdp_resilience.control.report.build import ReportPaths

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_adds_up(accounting: dict) -> None:
    parts = accounting["productive_s"] + sum(accounting["badput_s"].values())
    assert parts == pytest.approx(accounting["wall_s"], abs=1e-6)
    assert all(seconds >= 0 for seconds in accounting["badput_s"].values())
    assert 0 < accounting["ettr"] <= 1


def assert_report_files(paths: ReportPaths) -> str:
    assert paths.markdown.is_file()
    for png in paths.pngs:
        data = png.read_bytes()
        assert data.startswith(PNG_MAGIC), png
        assert len(data) > 8_000, f"{png} is suspiciously small ({len(data)} bytes)"
    assert set(paths.to_dict()) == {"markdown", "loss_png", "timeline_png", "goodput_png"}
    json.dumps(paths.to_dict())
    text = paths.markdown.read_text()
    for png in paths.pngs:
        assert f"]({png.name})" in text  # embedded with a relative link
    return text
