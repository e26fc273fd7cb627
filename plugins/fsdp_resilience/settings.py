"""Where things live for the control plane, from the environment of the Airflow processes.

  FSDP_RUNS_ROOT      run dirs (FSx for Lustre mounted in workers and triggerer on EKS);
                      default <repo>/runs
  FSDP_DATA_ROOT      staged datasets; default <runs root>/data
  FSDP_LOCAL_SLOTS    "nodes" of the local backend; default 4
  TRAINING_PYTHON     the training venv's python (local backend); default <repo>/.venv/bin/python
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def runs_root() -> Path:
    return Path(os.environ.get("FSDP_RUNS_ROOT", REPO / "runs")).resolve()


def data_root() -> Path:
    return Path(os.environ.get("FSDP_DATA_ROOT", runs_root() / "data")).resolve()


def training_python() -> str:
    return os.environ.get("TRAINING_PYTHON", str(REPO / ".venv" / "bin" / "python"))


def backend_config(name: str, **overrides: Any) -> dict[str, Any]:
    """The kwargs of ``fsdp_resilience.backends.get_backend`` for a backend name: JSON-safe, so
    they travel in XCom and trigger kwargs and any process can rebuild the same backend."""
    if name == "local":
        config = {"name": "local", "state_dir": str(runs_root() / ".local-backend"),
                  "slots": int(os.environ.get("FSDP_LOCAL_SLOTS", "4")), "training_python": training_python()}
    else:
        config = {"name": name}
    config.update(overrides)
    return config
