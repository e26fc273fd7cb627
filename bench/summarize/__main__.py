"""Merge the benchmark results into one summary JSON, draw the plots, and write the Markdown
table of the latest figures (docs/benchmarks.md, and its headline figures in the README).

    .venv-airflow/bin/python -m bench.summarize [--out bench/results] [--quick] [--docs docs/benchmarks.md]
    .venv-airflow/bin/python -m bench.summarize --from-latest   # re-render the pages from latest.json only
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.common import REPO, RESULTS, read_json, write_json
from bench.summarize.benchmarks_md import render_markdown
from bench.summarize.plots import plot_recovery, plot_stall, plot_young_daly
from bench.summarize.readme import update_readme
from bench.summarize.results import SUMMARY, build_summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.summarize", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--quick", action="store_true", help="summarise the *.quick.json files into OUT/quick/")
    parser.add_argument(
        "--docs",
        type=Path,
        default=None,
        help="where the Markdown goes (default: docs/benchmarks.md; quick: OUT/quick/benchmarks.md)",
    )
    parser.add_argument(
        "--from-latest",
        action="store_true",
        help="only re-render docs/benchmarks.md and the README block from OUT/latest.json (the "
        "committed summary): no merging of the parts, no plots",
    )
    args = parser.parse_args(argv)
    args.out = args.out.resolve()  # absolute: subprocesses (and an SQLite URL) must not depend on the cwd
    target_dir = args.out / "quick" if args.quick else args.out
    if args.from_latest:
        summary = read_json(target_dir / SUMMARY)
    else:
        summary = build_summary(args.out, args.quick)
        target_dir.mkdir(parents=True, exist_ok=True)
        summary = read_json(write_json(target_dir / SUMMARY, summary))  # render exactly what is committed
        tp, cp, chaos = summary.get("training_plane") or {}, summary.get("control_plane") or {}, summary.get("chaos")
        if tp.get("stall"):
            plot_stall(tp["stall"], target_dir / "stall.png")
        if tp.get("recovery") or cp.get("relaunch") or cp.get("spare"):
            plot_recovery(tp, cp, target_dir / "recovery.png")
        if chaos:
            plot_young_daly(chaos, target_dir / "young_daly.png")
    docs = args.docs or (target_dir / "benchmarks.md" if args.quick else REPO / "docs" / "benchmarks.md")
    docs.write_text(render_markdown(summary))
    if not args.quick and args.docs is None:
        update_readme(REPO / "README.md", summary)
    print(f"[bench] summary {target_dir / SUMMARY}; table {docs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
