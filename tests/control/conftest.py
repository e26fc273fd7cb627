"""Control-plane test environment: a private AIRFLOW_HOME (SQLite), this repo's dags/ and
plugins/, and run/data roots in a temp folder. Runs in .venv-airflow, which has no torch (the
control plane is installed there as a package). Shared helpers: control/support/, doubles:
control/fakes/."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from control.support import MEASURED, REPO, TRAINING_PYTHON

_home = Path(tempfile.mkdtemp(prefix="airflow-home-"))
os.environ.update(
    {
        "AIRFLOW_HOME": str(_home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__UNIT_TEST_MODE": "True",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{_home / 'airflow.db'}",
        "FSDP_RUNS_ROOT": str(_home / "runs"),
        "FSDP_DATA_ROOT": str(_home / "data"),
        "TRAINING_PYTHON": TRAINING_PYTHON,
    }
)

# The EKS path's fixtures: a real Kubernetes control plane (``control_plane``, once per run; ``kube``,
# empty for each test; ``cluster``, with the deploy kit applied), Karpenter on it (``karpenter``, once
# per run, for the tests that ask for it) and moto's AWS server (``aws``).
from control.fakes.eks_cluster import aws, cluster, permissive_cluster  # noqa: E402, F401
from control.kube.fixtures import control_plane, kube  # noqa: E402, F401
from control.kube.karpenter import gpu_pool, karpenter  # noqa: E402, F401


def pytest_sessionstart(session):
    """Create this session's Airflow metadata database (dag.test() needs one)."""
    airflow = Path(sys.executable).with_name("airflow")
    subprocess.run([str(airflow), "db", "migrate"], check=True, capture_output=True, env=os.environ.copy())


def pytest_terminal_summary(terminalreporter):
    if MEASURED:
        terminalreporter.section("measured")
        for line in MEASURED:
            terminalreporter.write_line(line)
