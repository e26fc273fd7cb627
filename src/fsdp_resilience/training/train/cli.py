"""The training worker: one process per rank, started by ft_launcher or torchrun.

Its command line (``python -m fsdp_resilience.training.train --config RUN.json``): refuse a run
that a rank already stopped, run the ``Trainer`` under the restart layers its ``restart_mode``
asks for, and exit with the run contract's code for how it ended."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback

from fsdp_resilience.training.contract import (
    ConfigError,
    ExitCode,
    FailureClass,
    RunConfig,
    exit_code_for,
    read_stop,
)
from fsdp_resilience.training.restart.fault_kinds import UserErrorAbort
from fsdp_resilience.training.restart.health_checks import WRAPPER, failed_health_check, record_health_check
from fsdp_resilience.training.restart.wrapper import inprocess_wrapper
from fsdp_resilience.training.train.env import WorkerEnv
from fsdp_resilience.training.train.fault_handling import StopTraining
from fsdp_resilience.training.train.loop import Trainer

#: What a stop marker tells a user to do, per failure class.
WHAT_TO_DO = {
    FailureClass.USER_ERROR: "fix the code or config and start a new run",
    FailureClass.NON_FINITE: "lower the learning rate or fix the data, and start a new run",
    FailureClass.STORAGE_ERROR: "free space or fix the run dir's mount, then relaunch",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fsdp_resilience.training.train", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--config", required=True, help="run config JSON (see src/fsdp_resilience/training/contract/config.py)"
    )
    args = parser.parse_args(argv)
    try:
        cfg = RunConfig.load(args.config)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return ExitCode.CONFIG_ERROR
    env = WorkerEnv.from_environ()
    stop = read_stop(cfg.layout)
    if stop is not None:  # a rank found a fault no restart can fix: never train past it
        failure = FailureClass(stop["failure_class"])
        print(
            f"error: {cfg.layout.stop_marker} says this run stopped with {failure.value} "
            f"(step {stop.get('step')}: {stop.get('error')}); not training again: {WHAT_TO_DO[failure]}.",
            file=sys.stderr,
        )
        return exit_code_for(failure)
    trainer = Trainer(cfg, env)
    try:
        if cfg.restart_mode in ("layered", "inprocess"):
            wrapper = inprocess_wrapper(
                cfg,
                lambda: trainer.events,
                device_type=trainer.device.type,
                on_store_lost=trainer.on_restart_store_lost,
            )
            wrapper(trainer.run)()
        else:
            trainer.run()
    except UserErrorAbort as e:
        print(f"error: user error, not retrying: {e}", file=sys.stderr)
        return ExitCode.USER_ERROR
    except StopTraining as e:
        print(f"error: {e}; not retrying: {WHAT_TO_DO[e.failure]}", file=sys.stderr)
        return exit_code_for(e.failure)
    except Exception as e:
        # What the in-process layer could not recover (its budget spent, or peers gone: a lost
        # node, or a restart health check that failed): ft_launcher restarts the worker group once
        # this process has exited. Exit now: after a node loss, interpreter shutdown waited 90 s
        # on NVRx 0.7's threads (seen), and the in-job restart with it.
        traceback.print_exc()
        health = failed_health_check(e)
        if health is not None:  # evidence against this node, for the control plane's diagnosis
            record_health_check(trainer.events, health[0], WRAPPER, health[1])
        trainer.close()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    finally:
        trainer.close()
    return ExitCode.SUCCESS
