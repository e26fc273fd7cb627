"""Real text for tests: the standard library's json/, email/ and collections/ sources (~1 MB) as
byte-token shards. Shared by the training and control-plane tests (a module of its own: both
test folders have a conftest.py, and ``import conftest`` would be ambiguous)."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def make_dataset(dst: Path, python: str = sys.executable) -> Path:
    """Build the dataset at ``dst`` with ``python -m training.prepare_data`` (it needs numpy: the
    control-plane tests pass the training venv's python). A no-op if it is already there."""
    if (dst / "index.json").exists():
        return dst
    src = dst.parent / f"{dst.name}-corpus"
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for pkg in ("json", "email", "collections"):
        for f in sorted((stdlib / pkg).rglob("*.py")):
            out = src / pkg / f.relative_to(stdlib / pkg)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(f.read_bytes())
    subprocess.run([python, "-m", "training.prepare_data", str(src), str(dst), "--val-fraction", "0.1"],
                   check=True, cwd=REPO, capture_output=True)
    return dst
