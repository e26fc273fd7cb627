"""The README's benchmark block (bench/summarize/readme.py) stays short: the headline figures and a
link to docs/benchmarks.md, which holds every target; an empty summary still renders."""

from __future__ import annotations

import json

import pytest

from bench.summarize.readme import README_BEGIN, README_END, readme_block, update_readme
from bench.summarize.targets import targets

from control.support import REPO


def test_the_committed_results_give_a_short_block_with_the_headline_figures():
    latest = REPO / "bench" / "results" / "latest.json"
    if not latest.exists():
        pytest.skip("no committed benchmark results (make bench writes bench/results/latest.json)")
    summary = json.loads(latest.read_text())
    block = readme_block(summary)
    lines = block.splitlines()
    assert lines[0] == README_BEGIN and lines[-1] == README_END and len(lines) <= 14
    met = sum(1 for *_, ok in targets(summary) if ok)
    assert f"**{met} of {len(targets(summary))} targets met**" in block
    assert "ETTR" in block and "[docs/benchmarks.md](docs/benchmarks.md)" in block


def test_an_empty_summary_renders_and_the_readme_keeps_what_is_outside_the_markers(tmp_path):
    block = readme_block({})
    assert "**0 of 0 targets met**" in block
    readme = tmp_path / "README.md"
    readme.write_text(f"# Title\n\n{README_BEGIN}\nold\n{README_END}\n\n## After\n")
    update_readme(readme, {})
    assert readme.read_text() == f"# Title\n\n{block}\n\n## After\n"
    readme.write_text("no markers\n")
    update_readme(readme, {})
    assert readme.read_text() == "no markers\n"
