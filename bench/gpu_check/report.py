"""The report: docs/gpu.md and bench/results/gpu.json."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.common import REPO, machine, write_json
from bench.gpu_check.checks import CheckResult

#: docs/gpu.md is written by hand but for this block, which a run on a GPU replaces.
BEGIN = "<!-- gpu-check:begin (make gpu-check writes this block) -->"
END = "<!-- gpu-check:end -->"


def render_markdown(report: dict[str, Any]) -> str:
    """The block of docs/gpu.md a run writes: what ran where, a line per check, then the details."""
    v = report["versions"]
    checks = report["checks"]
    passed = sum(c["passed"] is True for c in checks)
    when = report["started_at"][:16].replace("T", " ")
    lines = [
        f"Written by `make gpu-check` (`python -m bench.gpu_check`) on {when} in "
        f"{report['wall_s'] / 60:.1f} min: **{passed} of {len(checks)} checks passed**"
        + (" (dry run: nothing ran on a GPU)" if report["dry_run"] else "")
        + ". "
        "Raw figures: `bench/results/gpu.json`; logs and run dirs: `runs/gpu-check/` on that machine.",
        "",
        "| | |",
        "|---|---|",
        f"| GPUs | {v.get('gpu_count', 0)} × {v.get('gpu') or 'none'} ({v.get('gpu_memory', '?')}) |",
        f"| driver | {v.get('driver', '?')} |",
        f"| CUDA (torch build) | {v.get('cuda')} |",
        f"| NCCL | {v.get('nccl', '?')} |",
        f"| torch | {v.get('torch')} |",
        f"| nvidia-resiliency-ext | {v.get('nvidia-resiliency-ext')} |",
        f"| host | {report['machine'].get('cores')} cores, {report['machine'].get('memory_gb')} GB, "
        f"python {report['machine'].get('python')} |",
        "",
        "| # | check | result | figures | time |",
        "|---|---|---|---|---|",
    ]
    for i, c in enumerate(checks, 1):
        result = {True: "passed", False: "**failed**", None: "not run"}[c["passed"]]
        lines.append(f"| {i} | {c['title']} | {result} | {c['summary']} | {c['seconds']:.0f} s |")
    lines += ["", "### Details", ""]
    for i, c in enumerate(checks, 1):
        lines += [f"#### {i}. {c['title']}", ""]
        if c["command"]:
            lines += [f"`{c['command'].replace(str(REPO) + '/', '')}`", ""]
        lines += [f"- {k}: {json.dumps(val, default=str, ensure_ascii=False)}" for k, val in c["figures"].items()]
        if c["problems"]:
            lines += ["", "Failed: " + "; ".join(c["problems"]) + f". Log: `{c['log']}`."]
        if c["log_tail"]:
            lines += ["", "```", c["log_tail"], "```"]
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def write_report(report: dict[str, Any], md_path: Path, json_path: Path) -> None:
    """bench/results/gpu.json whole, and the block between BEGIN and END in ``md_path`` (a page of
    the block alone where there is none yet): the page's hand-written parts stay."""
    write_json(json_path, report)
    page = md_path.read_text() if md_path.exists() else f"# GPU check\n\n{BEGIN}\n{END}\n"
    if BEGIN not in page or END not in page or page.index(BEGIN) > page.index(END):
        raise ValueError(f"{md_path} has no {BEGIN} ... {END} block to write the run into")
    head, rest = page.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    md_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = md_path.with_name(f".{md_path.name}.tmp.{os.getpid()}")
    tmp.write_text(f"{head}{BEGIN}\n{render_markdown(report)}{END}{tail}")
    os.replace(tmp, md_path)


def new_report(
    versions: dict[str, Any], results: list[CheckResult], started: float, dry_run: bool, work: Path
) -> dict[str, Any]:
    return {
        "command": "python -m bench.gpu_check " + " ".join(sys.argv[1:]),
        "dry_run": dry_run,
        "started_at": datetime.fromtimestamp(started).astimezone().isoformat(timespec="seconds"),
        "wall_s": round(time.time() - started, 1),
        "machine": machine(),
        "versions": versions,
        "work_dir": str(work),
        "passed": sum(r.passed is True for r in results),
        "total": len(results),
        "checks": [asdict(r) for r in results],
    }
