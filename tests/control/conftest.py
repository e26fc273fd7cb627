"""Control-plane test environment: a private AIRFLOW_HOME (SQLite), this repo's dags/ and
plugins/, and run/data roots in a temp folder. Runs in .venv-airflow, which has no torch."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

#: Figures the tests measured, printed at the end of the run (pytest -q hides test output).
MEASURED: list[str] = []
TRAINING_PYTHON = str(REPO / ".venv" / "bin" / "python")

_home = Path(tempfile.mkdtemp(prefix="airflow-home-"))
os.environ.update({
    "AIRFLOW_HOME": str(_home),
    "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
    "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
    "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
    "AIRFLOW__CORE__UNIT_TEST_MODE": "True",
    "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{_home / 'airflow.db'}",
    "FSDP_RUNS_ROOT": str(_home / "runs"),
    "FSDP_DATA_ROOT": str(_home / "data"),
    "TRAINING_PYTHON": TRAINING_PYTHON,
})
sys.path.insert(0, str(REPO / "plugins"))

# The EKS path's fixtures: a fake apiserver (``cluster``) and moto's AWS server (``aws``).
from eks_cluster import aws, cluster  # noqa: E402, F401


def make_dataset(dst: Path) -> Path:
    """The shared test dataset (tests/shared.py), made with the training venv's prepare_data."""
    from shared import make_dataset as build

    return build(dst, python=TRAINING_PYTHON)


def pytest_sessionstart(session):
    """Create this session's Airflow metadata database (dag.test() needs one)."""
    airflow = Path(sys.executable).with_name("airflow")
    subprocess.run([str(airflow), "db", "migrate"], check=True, capture_output=True, env=os.environ.copy())


def pytest_terminal_summary(terminalreporter):
    if MEASURED:
        terminalreporter.section("measured")
        for line in MEASURED:
            terminalreporter.write_line(line)


def script_backend(folder: Path, script: str, **kwargs):
    """A ``LocalProcessBackend`` whose "training Python" is the shell ``script`` (a stand-in
    launcher: it gets the same arguments ``training.launch`` would), with its state in ``folder``."""
    from fsdp_resilience.backends import LocalProcessBackend

    folder.mkdir(parents=True, exist_ok=True)
    python = folder / "stand-in-python"
    python.write_text(script)
    python.chmod(0o755)
    return LocalProcessBackend(folder / "state", training_python=str(python), **kwargs)
