"""Main: parse the command line, run a worker, or run the checks (on the GPUs, or dry)."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import ensure_dataset, log
from bench.gpu_check.arguments import parse_args
from bench.gpu_check.checks import CHECKS, Check, Context, run_check
from bench.gpu_check.configs import build_configs, write_configs
from bench.gpu_check.dry_run import dry_run
from bench.gpu_check.processes import run_bounded
from bench.gpu_check.report import new_report, write_report
from bench.gpu_check.workers import worker_checkpoint, worker_memory, worker_probe
from fsdp_resilience.training.contract import ConfigError, RunConfig


def probe_versions(work: Path, timeout_s: float = 180) -> dict[str, Any]:
    result = work / "results" / "probe.json"
    result.unlink(missing_ok=True)
    rc, _ = run_bounded(
        [sys.executable, "-m", "bench.gpu_check", "--worker", "probe", "--result", str(result)],
        work / "logs" / "probe.log",
        timeout_s=timeout_s,
    )
    try:
        return json.loads(result.read_text())
    except (OSError, ValueError):
        return {"error": f"the version probe failed (exit {rc}); see {work / 'logs' / 'probe.log'}"}


def run_on_gpus(args: argparse.Namespace, gpus: int, checks: tuple[Check, ...]) -> int:
    started = time.time()
    # Report-writing and the final lines take seconds: the checks get the rest of the limit.
    deadline = time.monotonic() + args.time_limit - 10
    work = args.work.resolve()
    log(f"gpu-check on {gpus} GPU(s): {', '.join(c.key for c in checks)}; work dir {work}")
    dataset = ensure_dataset(work / "dataset", sys.executable)
    try:
        configs = build_configs(work, dataset, gpus)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ctx = Context(work, gpus, configs, write_configs(configs, work / "configs"), deadline, args.keep_checkpoints)
    versions = probe_versions(work, timeout_s=min(180, max(10, deadline - time.monotonic())))
    log(f"versions: {versions}")
    results = [run_check(ctx, check) for check in checks]
    if not args.keep_checkpoints:  # GBs per run; logs and events stay for diagnosis
        for cfg in configs.values():
            shutil.rmtree(cfg.layout.checkpoints, ignore_errors=True)
    report = new_report(versions, results, started, False, work)
    write_report(report, args.doc, args.json)
    failed = [r.key for r in results if not r.passed]
    for r in results:  # one line per check, whatever the log above says
        why = "; ".join(r.problems)
        detail = f"{r.summary} ({why})" if r.summary and why else r.summary or why
        print(f"{'PASS' if r.passed else 'FAIL'} {r.key}: {detail}")
    print(
        f"gpu-check: {report['passed']} of {len(results)} checks passed on {gpus} × {versions.get('gpu')} "
        f"in {report['wall_s'] / 60:.1f} min"
        + (f"; failed: {', '.join(failed)}" if failed else "")
        + f". Wrote {args.doc} and {args.json}."
    )
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker == "probe":
        worker_probe(args.result)
        return 0
    if args.worker is not None:
        worker = {"checkpoint": worker_checkpoint, "memory": worker_memory}[args.worker]
        worker(RunConfig.load(args.config), args.result)
        return 0
    wanted = [k.strip() for k in (args.only or "").split(",") if k.strip()]
    unknown = sorted(set(wanted) - {c.key for c in CHECKS})
    if unknown:
        print(f"error: unknown check(s) {unknown}; choose from {', '.join(c.key for c in CHECKS)}", file=sys.stderr)
        return 2
    checks = tuple(c for c in CHECKS if not wanted or c.key in wanted)
    import torch

    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible == 0 or args.dry_run:
        reason = (
            f"--dry-run given ({visible} GPU(s) visible)"
            if visible
            else "found no GPU (torch.cuda.is_available() is False), so ran dry"
        )
        return dry_run(args.gpus or visible or 1, reason, checks)
    gpus = args.gpus or visible
    if not 1 <= gpus <= visible:
        print(f"error: --gpus {gpus}: this machine has {visible} visible GPU(s)", file=sys.stderr)
        return 2
    return run_on_gpus(args, gpus, checks)
