"""ruff runs the same everywhere: pre-commit's hook pins the version both venvs install, and
`make test` lints first."""

from __future__ import annotations

import re

from control.support import REPO


def test_pre_commit_pins_the_ruff_the_venvs_install():
    hook = re.search(r"ruff-pre-commit\s+rev:\s*v(\S+)", (REPO / ".pre-commit-config.yaml").read_text())
    assert hook, ".pre-commit-config.yaml has no ruff-pre-commit hook"
    for constraints in ("constraints.txt", "constraints-airflow.txt"):
        pinned = re.search(r"^ruff==(\S+)$", (REPO / "requirements" / constraints).read_text(), re.M)
        assert pinned and pinned.group(1) == hook.group(1), constraints


def test_make_test_lints_first():
    makefile = (REPO / "Makefile").read_text()
    prerequisites = re.search(r"^test:(.*)$", makefile, re.M).group(1).split()
    assert prerequisites[0] == "lint"
    assert re.search(r"^lint:.*\n(\t.*\n)*\t\S*ruff check \.\n\t\S*ruff format --check \.", makefile, re.M)
