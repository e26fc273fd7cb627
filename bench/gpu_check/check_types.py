"""What every check shares: its definition (Check), what it is given (Context), what it yields
(CheckResult), and the helpers that turn a finished command into a result."""

from __future__ import annotations

import math
import shlex
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from bench.gpu_check.processes import log_tail
from fsdp_resilience.training.contract import RunConfig


@dataclass
class CheckResult:
    key: str
    title: str
    passed: bool | None  # None: not run (dry run, or skipped)
    seconds: float = 0.0
    summary: str = ""  # the main figures in one line: the report's table
    figures: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)  # why it failed
    command: str = ""
    log: str = ""
    log_tail: str = ""


@dataclass
class Context:
    work: Path
    gpus: int
    configs: dict[str, RunConfig]
    config_paths: dict[str, Path]
    #: time.monotonic() by which every check must have ended (None: no limit)
    deadline: float | None = None
    keep_checkpoints: bool = False

    def logs(self, key: str) -> Path:
        return self.work / "logs" / f"{key}.log"


@dataclass(frozen=True)
class Check:
    key: str
    title: str
    timeout_s: float
    run: Callable[[Context, "Check"], CheckResult]


def check_result(
    check: Check,
    ctx: Context,
    command: list[str],
    rc: int | None,
    wall: float,
    problems: list[str],
    figures: dict[str, Any],
    summary: str,
) -> CheckResult:
    """The row of a check that ran one command; a timeout or a non-zero exit is always a problem."""
    if rc is None:
        problems.insert(0, f"timed out after {check.timeout_s:.0f} s and was stopped")
    elif rc != 0:
        problems.insert(0, f"exited {rc}")
    figures = {"exit_code": rc, "wall_s": round(wall, 1), **figures}
    log_path = ctx.logs(check.key)
    return CheckResult(
        check.key,
        check.title,
        passed=not problems,
        seconds=round(wall, 1),
        summary=summary,
        figures=figures,
        problems=problems,
        command=shlex.join(command),
        log=str(log_path),
        log_tail=log_tail(log_path) if problems else "",
    )


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def nccl_timeouts(cfg: RunConfig) -> dict[str, float]:
    """The restart-layer timeouts a run gets on NCCL (the contract derives the collective one)."""
    t = cfg.timeouts("nccl")
    return {
        "hang_timeout_s": t.soft_s,
        "hard_timeout_s": t.hard_s,
        "collective_timeout_s": t.collective_s,
        "heartbeat_timeout_s": t.heartbeat_s,
    }
