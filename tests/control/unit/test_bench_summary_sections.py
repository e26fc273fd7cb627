"""The sections of docs/benchmarks.md (bench/summarize/sections/): each is empty without its
part's results, and from the committed summary each opens with its numbered heading."""

from __future__ import annotations

from bench.common import RESULTS, read_json
from bench.summarize.benchmarks_md import render_markdown
from bench.summarize.sections.chaos import chaos_section
from bench.summarize.sections.control_plane import control_plane_section
from bench.summarize.sections.evaluation import evaluation_section
from bench.summarize.sections.recovery import recovery_section
from bench.summarize.sections.scale import scale_section
from bench.summarize.sections.stall import stall_section


def test_a_section_without_its_results_is_left_out():
    assert stall_section({}) == []
    assert recovery_section({}, {}) == []
    assert chaos_section({}) == []
    assert control_plane_section({}) == []
    assert evaluation_section({}) == []
    assert scale_section({}) == []
    page = render_markdown({})
    assert page.startswith("## Benchmarks") and "### Reproduce" in page and "### 1." not in page


def test_each_section_of_the_committed_summary_opens_with_its_heading_and_is_on_the_page():
    summary = read_json(RESULTS / "latest.json")
    tp, cp = summary.get("training_plane") or {}, summary.get("control_plane") or {}
    page = render_markdown(summary)
    sections = {
        "### 1. Checkpoint stall": stall_section(tp),
        "### 2. Recovery per rung": recovery_section(tp, cp, summary.get("training_plane_nvrx07")),
        "### 3. Goodput under chaos": chaos_section(summary),
        "### 4. Control-plane overhead": control_plane_section(cp),
        "### 5. Evaluation load": evaluation_section(tp),
        "### 6. The EKS backend at scale (simulated p5 nodes, real control plane)": scale_section(cp),
    }
    for heading, lines in sections.items():
        assert lines[0] == heading
        assert "\n".join(lines) in page
