"""``python -m fsdp_resilience.control.report RUN_DIR``: build RUN_DIR/report/report.md and its
figures, and print the Markdown's path."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fsdp_resilience.control.report.build import build_report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fsdp_resilience.control.report", description="Build RUN_DIR/report/report.md and its figures."
    )
    parser.add_argument("run_dir", help="the run's folder (holds events.jsonl)")
    args = parser.parse_args(argv)
    if not Path(args.run_dir).is_dir():
        print(f"error: run dir {args.run_dir} does not exist", file=sys.stderr)
        return 2
    print(build_report(args.run_dir).markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
