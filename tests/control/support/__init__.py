"""What the control-plane tests share: where things are, the figures they measured, and the
dataset (made with the training venv, the one with numpy)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

#: Figures the tests measured, printed at the end of the run (pytest -q hides test output).
MEASURED: list[str] = []
TRAINING_PYTHON = str(REPO / ".venv" / "bin" / "python")


def make_dataset(dst: Path) -> Path:
    """The shared test dataset (tests/shared.py), made with the training venv's prepare_data."""
    from shared import make_dataset as build

    return build(dst, python=TRAINING_PYTHON)
