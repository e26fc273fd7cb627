"""What the training and control-plane tests share: real text as a dataset, and run settings
that make fault drills resolve in seconds. (A module of its own: both test folders have a
conftest.py, and ``import conftest`` would be ambiguous.)"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

#: Run config fields for tests: short sequences and timeouts, so drills resolve in seconds on a
#: loaded 2-core machine.
FAST_RUN = {"seq_len": 64, "batch_size": 4, "collective_timeout_s": 3.0, "heartbeat_timeout_s": 30.0,
            "initial_heartbeat_timeout_s": 90.0, "hang_timeout_s": 15.0, "device": "cpu", "eval_batches": 4}


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
