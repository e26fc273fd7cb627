"""The docs hold together: every relative link and anchor in README.md and docs/**/*.md resolves,
every repository path they name in backticks exists, and the README stays short."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
README_MAX_LINES = 200

#: Top-level folders of the repository: a backticked word that starts with one of these and a
#: slash is taken to be a path in the repository.
REPO_FOLDERS = ("src", "dags", "deploy", "images", "bench", "tests", "plugins", "docs", "requirements", ".ci")

#: Paths the docs name that a command writes and nobody commits (make gpu-check's report and
#: results, the deployment test's screenshots).
WRITTEN_BY_COMMANDS = {"docs/gpu.md", "bench/results/gpu.json", "tests/control/artifacts/"}

LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def doc_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of the lines outside fenced code blocks."""
    lines, fence = [], None
    for number, line in enumerate(path.read_text().splitlines(), 1):
        marker = re.match(r"^\s*(`{3,}|~{3,})", line)
        if marker:
            if fence is None:
                fence = marker.group(1)[0]
            elif marker.group(1)[0] == fence:
                fence = None
            continue
        if fence is None:
            lines.append((number, line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the text (links and code spans as their text) lowercased,
    punctuation dropped except hyphens and underscores, spaces as hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for _, line in prose_lines(path):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path: Path) -> list[tuple[int, str]]:
    found = []
    for number, line in prose_lines(path):
        for match in LINK.finditer(CODE_SPAN.sub("", line)):
            found.append((number, match.group(1)))
    return found


def backticked_paths(path: Path) -> list[tuple[int, str]]:
    found = []
    for number, line in prose_lines(path):
        for match in CODE_SPAN.finditer(line):
            word = match.group(2).strip()
            if " " in word or not word.startswith(tuple(f"{folder}/" for folder in REPO_FOLDERS)):
                continue
            if re.search(r"[<>$*{}…]|\.\.\.|\[", word):  # a pattern or a placeholder, not a path
                continue
            found.append((number, word.split("::")[0]))
    return found


def test_the_docs_exist():
    assert (REPO / "README.md").is_file()
    assert len(doc_files()) > 5


@pytest.mark.parametrize("doc", doc_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_and_anchors_resolve(doc: Path):
    broken = []
    for number, target in links(doc):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        if file_part.startswith("/"):  # GitHub resolves these from the repository root
            linked = (REPO / file_part.lstrip("/")).resolve()
        else:
            linked = (doc.parent / file_part).resolve() if file_part else doc
        where = f"{doc.relative_to(REPO)}:{number}: {target}"
        if not linked.exists():
            broken.append(f"{where} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{where} (no heading with that anchor in {linked.relative_to(REPO)})")
    assert not broken, "broken links:\n" + "\n".join(broken)


@pytest.mark.parametrize("doc", doc_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_repository_paths_named_exist(doc: Path):
    missing = [
        f"{doc.relative_to(REPO)}:{number}: `{name}`"
        for number, name in backticked_paths(doc)
        if name not in WRITTEN_BY_COMMANDS and not (REPO / name.rstrip("/")).exists()
    ]
    assert not missing, "paths named in the docs that do not exist:\n" + "\n".join(missing)


def test_readme_is_short():
    lines = len((REPO / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail into docs/ (≤ {README_MAX_LINES})"


def test_slug_matches_github():
    assert (
        slug("Run Airflow as it is deployed, and trigger a run from the form")
        == "run-airflow-as-it-is-deployed-and-trigger-a-run-from-the-form"
    )
    assert (
        slug("`make gpu-check`: the training plane on a CUDA machine")
        == "make-gpu-check-the-training-plane-on-a-cuda-machine"
    )
    assert slug("4a. Install Airflow in the cluster") == "4a-install-airflow-in-the-cluster"
    assert slug("Timeouts, in order") == "timeouts-in-order"
