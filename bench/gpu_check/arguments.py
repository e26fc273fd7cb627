"""The command line of ``python -m bench.gpu_check`` (checks, and a worker's arguments)."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench import gpu_check as package
from bench.common import REPO
from bench.gpu_check.checks import CHECKS, WORKERS
from bench.gpu_check.configs import DOC, JSON_OUT, TIME_LIMIT_S, WORK


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=package.__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="check the wiring only (the default without a GPU)")
    parser.add_argument(
        "--only", default=None, help=f"comma-separated checks (default all): {','.join(c.key for c in CHECKS)}"
    )
    parser.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: every visible one; dry run: 1)")
    parser.add_argument("--work", type=Path, default=WORK, help=f"run dirs and logs (default {WORK.relative_to(REPO)})")
    parser.add_argument("--keep-checkpoints", action="store_true", help="keep the runs' checkpoints (GBs)")
    parser.add_argument(
        "--time-limit",
        type=float,
        default=TIME_LIMIT_S,
        help=f"seconds for the whole command on a GPU (default {TIME_LIMIT_S:g}); a check left without time fails",
    )
    parser.add_argument("--doc", type=Path, default=DOC, help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, default=JSON_OUT, help=argparse.SUPPRESS)
    # A worker process of a check (started by torchrun), not for direct use.
    parser.add_argument("--worker", choices=("probe", *WORKERS), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--config", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)
