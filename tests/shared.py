"""What the training and control-plane tests share: real text as a dataset, run settings that
make fault drills resolve in seconds, and a 2-rank scenario runner. (A module of its own: both
test folders have a conftest.py, and ``import conftest`` would be ambiguous. Torch-free at import:
the control-plane venv has no torch.)"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import sysconfig
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

#: Run config fields for tests: short sequences and timeouts, so drills resolve in seconds on a
#: loaded 2-core machine.
FAST_RUN = {
    "seq_len": 64,
    "batch_size": 4,
    "collective_timeout_s": 3.0,
    "heartbeat_timeout_s": 30.0,
    "initial_heartbeat_timeout_s": 90.0,
    "hang_timeout_s": 15.0,
    "device": "cpu",
    "eval_batches": 4,
}


def make_dataset(dst: Path, python: str = sys.executable) -> Path:
    """Build the dataset at ``dst`` with ``python -m fsdp_resilience.training.prepare_data`` (it needs numpy: the
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
    subprocess.run(
        [python, "-m", "fsdp_resilience.training.prepare_data", str(src), str(dst), "--val-fraction", "0.1"],
        check=True,
        cwd=REPO,
        capture_output=True,
    )
    return dst


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(scenario: Callable[[int, int, Path], dict[str, Any]], rank: int, port: int, tmp: str) -> None:
    """One spawned rank: its results go to <tmp>/rank<r>.json, its traceback to rank<r>.error."""
    try:
        results = scenario(rank, port, Path(tmp))
        Path(tmp, f"rank{rank}.json").write_text(json.dumps(results, indent=1, default=str))
    except BaseException:
        Path(tmp, f"rank{rank}.error").write_text(traceback.format_exc())
        raise


def run_on_two_ranks(
    scenario: Callable[[int, int, Path], dict[str, Any]], tmp: Path, timeout_s: float
) -> dict[int, dict[str, Any]]:
    """Run ``scenario(rank, port, tmp)`` in two spawned processes (a module-level function: they
    import it), which join a gloo group at 127.0.0.1:``port``; returns each rank's results by rank.
    Starting ranks and writer processes is what costs time, so a test module runs one scenario
    with many phases and checks each phase in a test of its own."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = free_port()
    began = time.monotonic()
    procs = [ctx.Process(target=_rank_main, args=(scenario, r, port, str(tmp))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=max(1.0, timeout_s - (time.monotonic() - began)))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    errors = "\n".join(f.read_text() for f in sorted(tmp.glob("rank*.error")))
    assert all(p.exitcode == 0 for p in procs), f"ranks exited {[p.exitcode for p in procs]}:\n{errors}"
    print(f"\n[{scenario.__module__} scenario] 2 ranks, {time.monotonic() - began:.1f}s")
    return {r: json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)}
