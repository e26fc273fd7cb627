"""The command line of ``python -m fsdp_resilience.training.launch`` (see the package): validate
the run and this node's place, take the node's launch lock, check the run dir takes writes,
prepare the launcher command, run it (or print it: --dry-run)."""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from fsdp_resilience.training.contract import (
    LAUNCH_UID_ENV,
    ConfigError,
    ExitCode,
    launch_ended_by,
    read_dataset_index,
)
from fsdp_resilience.training.launch.config import (
    CONFIG_ENV,
    load_config,
    node_rank_from_env,
    rdzv_host_from_env,
)
from fsdp_resilience.training.launch.lock import AlreadyRunning, take_launch_lock
from fsdp_resilience.training.launch.node import NodeLauncher
from fsdp_resilience.training.launch.outcome import stop_record
from fsdp_resilience.training.launch.storage import (
    STORAGE_ADVICE,
    StorageError,
    clear_storage_stop,
    create_run_dir,
    storage_problem,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fsdp_resilience.training.launch",
        description="Run one node of a training run under NVRx restarts.",
    )
    parser.add_argument(
        "--config",
        default=None,
        help="run config JSON file (src/fsdp_resilience/training/contract/config.py: RunConfig); "
        f"default: ${CONFIG_ENV}",
    )
    parser.add_argument("--node-rank", type=int, default=None, help="this node's index (default: from env)")
    parser.add_argument("--rdzv-host", default=None, help="rendezvous host: node 0's address (default: from env)")
    parser.add_argument("--dry-run", action="store_true", help="print the launcher command and exit")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config)
        node_rank = node_rank_from_env(args.node_rank)
        if not 0 <= node_rank < cfg.node_rank_limit:
            spares = f" + {cfg.spare_nodes} spare(s) and the indices of spares added later" if cfg.spare_nodes else ""
            raise ConfigError(
                f"node rank {node_rank} is outside the run's {cfg.nodes} node(s){spares}: "
                f"use 0..{cfg.node_rank_limit - 1}"
            )
        rdzv_host = rdzv_host_from_env(args.rdzv_host, cfg)
        read_dataset_index(cfg.dataset_dir)  # a missing or broken dataset fails here, not in every rank
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return int(ExitCode.CONFIG_ERROR)
    launcher = NodeLauncher(cfg, node_rank, rdzv_host)
    layout = cfg.layout
    if not args.dry_run:
        # Read before anything else: a pod the Job recreates after its launch ended (the pods
        # it would rendezvous with are gone, and so is their DNS name) leaves at once, touching
        # nothing; its exit code is one the Job's podFailurePolicy ignores.
        ended = launch_ended_by(cfg.run_dir, launcher.launch_id, os.environ.get(LAUNCH_UID_ENV, ""))
        if ended is not None:
            print(
                f"error: launch {launcher.launch_id} of run {cfg.run_id} had already ended when this launcher "
                f"started: node {ended.get('node_rank')} ended it {ended.get('failure_class')} "
                f"({ended.get('message', '')}); nothing to do (exit {int(ExitCode.LAUNCH_ENDED)}, launch_ended)",
                file=sys.stderr,
            )
            return int(ExitCode.LAUNCH_ENDED)
    try:
        create_run_dir(layout)
        if not args.dry_run:
            # Before anything else touches the run: a second launcher of this node stops here,
            # having written nothing (no event: the run's status is the first one's).
            launcher.lock_fd = take_launch_lock(layout, node_rank, launcher.launch_id)
            problem = storage_problem(layout)
            if problem:
                raise StorageError(f"the run dir cannot take writes: {problem}")
            stop = None if clear_storage_stop(layout) else stop_record(layout)
            if stop is not None:
                return launcher.finish_stopped(stop)
        command = launcher.prepare()
    except AlreadyRunning as e:
        print(f"error: {e}", file=sys.stderr)
        return int(ExitCode.ALREADY_RUNNING)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return int(ExitCode.CONFIG_ERROR)
    except StorageError as e:
        print(f"error: {e}; {STORAGE_ADVICE}", file=sys.stderr)
        return int(ExitCode.STORAGE_ERROR)
    except OSError as e:  # a write of prepare() refused after the probe passed
        print(
            f"error: the run dir cannot take writes: {e.filename or layout.root}: {e.strerror or e}; {STORAGE_ADVICE}",
            file=sys.stderr,
        )
        return int(ExitCode.STORAGE_ERROR)
    if args.dry_run:
        print(shlex.join(command))
        return 0
    return launcher.run(command)
