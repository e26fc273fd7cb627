"""Dry run: the wiring, without a GPU (configs validate, commands resolve, the report writer works)."""

from __future__ import annotations

import contextlib
import io
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import REPO, ensure_dataset
from bench.gpu_check.arguments import parse_args
from bench.gpu_check.checks import LAUNCHED, WORKERS, Check, CheckResult, nccl_timeouts
from bench.gpu_check.configs import (
    CHECKPOINT_MODEL,
    DOC,
    MEMORY_TOLERANCE,
    STALL_TARGET,
    build_configs,
    launch_command,
    worker_command,
    write_configs,
)
from bench.gpu_check.report import BEGIN, END, new_report, write_report
from bench.gpu_check.worker_checks import checkpoint_space, memory_estimate
from bench.gpu_check.workers import training_api
from fsdp_resilience.training.contract import ConfigError


def dry_run(gpus: int, reason: str, checks: tuple[Check, ...]) -> int:
    """Everything short of running on a GPU; returns the exit code."""
    import importlib
    import importlib.metadata

    started = time.time()
    done: list[str] = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-dry-") as tmp:
        work = Path(tmp)
        dataset = ensure_dataset(work / "dataset", sys.executable)
        try:
            configs = build_configs(work, dataset, gpus)
        except ConfigError as e:
            print(
                f"error: a gpu-check run config is invalid: {e}. Fix GPU_RUN / the scenarios in "
                "bench/gpu_check/configs.py to match RunConfig.validate "
                "(src/fsdp_resilience/training/contract/config.py).",
                file=sys.stderr,
            )
            return 1
        paths = write_configs(configs, work / "configs")
        t = nccl_timeouts(configs["hang"])
        done.append(
            f"{len(configs)} run configs valid for {gpus} GPU(s) (NCCL: hang {t['hang_timeout_s']:g} s, "
            f"hard {t['hard_timeout_s']:g} s, collective {t['collective_timeout_s']:g} s, "
            f"heartbeat {t['heartbeat_timeout_s']:g} s)"
        )
        # What the worker checks will judge against, for this GPU count.
        estimate = memory_estimate(configs["memory"], gpus)
        state, _ = checkpoint_space(work, gpus)
        expected_gib = estimate["total"] - estimate["overhead"]
        print(
            f"[dry-run] judging: memory within ±{MEMORY_TOLERANCE:.0%} of {expected_gib:.1f} GiB "
            f"a GPU (1b, {gpus} GPU(s)); checkpoint stall ≤ {STALL_TARGET:g}× a pinned memcpy of "
            f"{state / 1e9:.1f} GB ({CHECKPOINT_MODEL}) in all"
        )
        for name in LAUNCHED:  # what `fsdp_resilience.training.launch` would start, without starting it
            proc = subprocess.run(
                launch_command(paths[name], dry_run=True), cwd=REPO, capture_output=True, text=True, timeout=60
            )
            # The worker: the trainer itself, or (with in-job restarts) the client that has the
            # node's zygote fork it.
            worker = any(w in proc.stdout for w in ("fsdp_resilience.training.train", "worker_client.py"))
            if proc.returncode != 0 or not worker:
                print(
                    f"error: `fsdp_resilience.training.launch --dry-run` failed for scenario {name} (exit "
                    f"{proc.returncode}):\n"
                    f"{proc.stdout}{proc.stderr}",
                    file=sys.stderr,
                )
                return 1
            print(f"[dry-run] {name}: {proc.stdout.strip().replace(str(REPO) + '/', '')}")
        done.append(f"launcher commands for {', '.join(LAUNCHED)}")
        import torch.distributed.run as torchrun

        for name in WORKERS:  # torchrun and the worker parse their command lines as built
            command = worker_command(name, paths[name], work / f"{name}.json", gpus)
            torchrun.get_args_parser().parse_args(command[3:])
            parse_args(command[command.index("bench.gpu_check") + 1 :])
            print(f"[dry-run] {name}: {shlex.join(command).replace(str(REPO) + '/', '')}")
        done.append(f"torchrun workers {', '.join(WORKERS)}")
        training_api()
        for module in (
            "fsdp_resilience.training.train.cli",
            "fsdp_resilience.training.evaluate",
            "nvidia_resiliency_ext.inprocess",
        ):
            importlib.import_module(module)
        evaluate_help = io.StringIO()
        with contextlib.redirect_stdout(evaluate_help), contextlib.suppress(SystemExit):
            importlib.import_module("fsdp_resilience.training.evaluate").main(["--help"])
        if "--config" not in evaluate_help.getvalue() or "--device" not in evaluate_help.getvalue():
            print(
                "error: `python -m fsdp_resilience.training.evaluate` no longer takes --config and --device; update "
                "check_evaluate",
                file=sys.stderr,
            )
            return 1
        done.append("modules import")
        results = [CheckResult(c.key, c.title, passed=None, summary="dry run: wired, not run") for c in checks]
        versions = {
            "torch": importlib.import_module("torch").__version__,
            "cuda": importlib.import_module("torch").version.cuda,
            "nvidia-resiliency-ext": importlib.metadata.version("nvidia-resiliency-ext"),
            "gpu_count": 0,
        }
        report = new_report(versions, results, started, True, work)
        # Into a copy of docs/gpu.md: its hand-written parts must come through the run's block intact.
        page = DOC.read_text() if DOC.exists() else ""
        if page:
            (work / "gpu.md").write_text(page)
        write_report(report, work / "gpu.md", work / "gpu.json")
        text = (work / "gpu.md").read_text()
        if not all(c.title in text for c in checks) or json.loads((work / "gpu.json").read_text())["total"] != len(
            checks
        ):
            print("error: the report writer left out checks; see render_markdown", file=sys.stderr)
            return 1
        if page and (text.split(BEGIN)[0] != page.split(BEGIN)[0] or text.split(END)[1] != page.split(END)[1]):
            print(f"error: the report writer changed {DOC} outside its block", file=sys.stderr)
            return 1
        done.append("report writer (into a copy of docs/gpu.md; the page itself untouched)")
    print(
        f"gpu-check dry run: {reason}; wired {len(checks)} checks ({', '.join(c.key for c in checks)}): "
        f"{'; '.join(done)}; in {time.time() - started:.1f} s. Run `make gpu-check` on a CUDA machine for figures."
    )
    return 0
