"""The training worker: one process per rank, started by ft_launcher or torchrun.

    python -m training.train --config RUN.json      (normally via ``python -m training.launch``)

One attempt of ``Trainer.run`` = build a process group, shard the model, restore the newest
committed checkpoint, train to ``cfg.steps`` with asynchronous checkpoints. The in-process restart
layer calls ``run`` again in the same process after a fault; the in-job layer starts a new process.
"""

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from nvidia_resiliency_ext.inprocess import CallWrapper

from training import faults, restart
from training.checkpoint import AsyncCheckpointer, app_state, choose_checkpoint, load_checkpoint, restore_app_state
from training.contract import ConfigError, Event, EventLog, ExitCode, RunConfig, node_id, read_events
from training.data import BatchSampler, TokenShards
from training.model import cross_entropy_loss
from training.parallelize import backend_for, build_optimizer, build_sharded_model, choose_device, device_mesh


@dataclass(frozen=True)
class WorkerEnv:
    """Where this worker sits, from the variables torchrun / ft_launcher set."""

    rank: int
    local_rank: int
    world_size: int
    node_rank: int
    #: This node agent's TORCHELASTIC_RESTART_COUNT: 0 on the first launch. NVRx 0.7 sets it to the
    #: job's rendezvous round (the same on every node, kept by a node that joins late); 0.4.1 to the
    #: restarts of this node's agent, so a replacement node that joins a running job starts at 0
    #: while the others count on. The trainer agrees on the job's round (the largest count of any
    #: rank: ``Trainer.attempt``), which both versions then give alike.
    attempt: int

    @classmethod
    def from_environ(cls) -> "WorkerEnv":
        env = os.environ
        return cls(rank=int(env.get("RANK", 0)), local_rank=int(env.get("LOCAL_RANK", 0)),
                   world_size=int(env.get("WORLD_SIZE", 1)), node_rank=int(env.get("GROUP_RANK", 0)),
                   attempt=int(env.get("TORCHELASTIC_RESTART_COUNT", 0)))


def fault_signature(exc: BaseException) -> str:
    return f"{type(exc).__module__}.{type(exc).__qualname__}: {str(exc)[:300]}"


class Trainer:
    """Holds what survives an in-process restart (config, checkpoint writer, stores); ``run`` holds
    what does not (process group, model, optimizer)."""

    def __init__(self, cfg: RunConfig, env: WorkerEnv):
        self.cfg = cfg
        self.env = env
        self.layout = cfg.layout
        self.events = EventLog(self.layout.events, run_id=cfg.run_id, rank=env.rank, node_rank=env.node_rank,
                               attempt=env.attempt, launch_id=os.environ.get("TRAINING_LAUNCH_ID", ""))
        self.device = setup_device(cfg, env)
        self.backend = backend_for(self.device)
        self.timeouts = cfg.timeouts(self.backend)
        self.monitor = restart.RankMonitor()
        self.store = restart.app_store()  # outlives in-process restarts; process groups do not
        self.fired: set[tuple[int, int | None, str]] = set()  # drills fire once per process
        self.iteration = 0
        self.attempt = env.attempt  # the job's restart round, agreed by every rank in run()
        self.shards = TokenShards(cfg.dataset_dir, "train")
        # Start the checkpoint writer now: its first start costs seconds we'd rather not stall on.
        self.checkpointer = AsyncCheckpointer(cfg.run_dir, rank=env.rank, world_size=env.world_size,
                                              events=self.events, keep=cfg.keep_checkpoints)

    # -- one attempt --------------------------------------------------------------------------
    def run(self, call_wrapper: Optional[CallWrapper] = None) -> None:
        # The annotation is how the in-process Wrapper finds where to pass its CallWrapper.
        cfg, env = self.cfg, self.env
        self.iteration = call_wrapper.iteration if call_wrapper is not None else 0
        events = self.events = self.events.bind(iteration=self.iteration)
        self.monitor.start()
        self.monitor.enter("setup")
        try:
            restart.init_process_group(self.backend, self.iteration, self.timeouts.collective_s,
                                       cfg.initial_heartbeat_timeout_s, self.store, self.device)
            mesh = device_mesh(self.device, cfg.nodes, cfg.procs_per_node)
            self.checkpointer.rebind(dist.group.WORLD)
            self.attempt = job_restart_round(env.attempt, self.device)
            events = self.events = events.bind(attempt=self.attempt)

            # Which checkpoint to resume from is agreed before the model exists, so weights a
            # checkpoint is about to overwrite are never randomly initialised.
            resumed = choose_checkpoint(cfg.run_dir, events=events if env.rank == 0 else None)
            model = build_sharded_model(cfg.model, mesh, self.device, seed=cfg.seed,
                                        init_weights=resumed is None, max_seq_len=cfg.seq_len)
            optimizer = build_optimizer(model, self.device, lr=cfg.lr, weight_decay=cfg.weight_decay)
            sampler = BatchSampler(self.shards, cfg.seq_len, cfg.batch_size, env.rank, env.world_size, cfg.seed)
            trainer_state = {"step": 0, "sampler": sampler.state_dict(), "rng": torch.get_rng_state()}
            state = app_state(model, optimizer, trainer_state)
            if resumed is not None:
                load_checkpoint(resumed, state)
                restore_app_state(model, optimizer, state)
                sampler.load_state_dict(state["trainer"]["sampler"])
                torch.set_rng_state(state["trainer"]["rng"])
            start = int(state["trainer"]["step"]) if resumed else 0
            events.emit(Event.TRAIN_BEGIN, start_step=start, world_size=env.world_size,
                        device=str(self.device), model=cfg.model,
                        resumed_from=resumed.checkpoint_id if resumed else None)
            self._train(model, optimizer, sampler, start, call_wrapper)
        except Exception:  # not a BaseException such as UserErrorAbort or the Wrapper's interrupt
            self.checkpointer.abandon_pending()
            raise
        finally:
            self.monitor.stop()
            if dist.is_initialized():
                dist.destroy_process_group()

    def _train(self, model, optimizer, sampler, start: int, call_wrapper) -> None:
        cfg, env, events = self.cfg, self.env, self.events
        tokens_per_step = cfg.batch_size * cfg.seq_len * env.world_size
        step = start
        recovering = self._restart_pending()
        for step in range(start + 1, cfg.steps + 1):
            self.monitor.enter("step")
            t0 = time.perf_counter()
            try:
                self._maybe_inject(step, before_save=True)
                inputs, targets = (t.to(self.device, non_blocking=True) for t in sampler.next_batch())
                loss = cross_entropy_loss(model(inputs), targets)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                log_step = step % cfg.log_interval == 0 or step == cfg.steps
                if log_step:  # the only host sync of a step: on the logging interval
                    loss = loss.detach()
                    dist.all_reduce(loss, op=dist.ReduceOp.AVG)
                    loss_value = loss.item()
            except Exception as exc:
                self._on_fault(exc, step)
                raise
            step_s = time.perf_counter() - t0
            self.monitor.heartbeat()
            if call_wrapper is not None:
                call_wrapper.ping()
            if recovering is not None:
                layer, fault_ts = recovering
                events.emit(Event.RESTART_END, layer=layer, step=step, latency_s=round(time.time() - fault_ts, 3))
            recovering = None
            if env.rank == 0 and log_step:
                events.emit(Event.STEP, step=step, loss=loss_value, step_s=round(step_s, 4),
                            tokens_per_s=round(tokens_per_step / step_s, 1))
            if step % cfg.checkpoint_interval == 0 or step == cfg.steps:
                self.monitor.enter("checkpoint")
                trainer_state = {"step": step, "sampler": sampler.state_dict(), "rng": torch.get_rng_state()}
                try:
                    self.checkpointer.save(step, app_state(model, optimizer, trainer_state))
                    self._maybe_inject(step, before_save=False)
                except Exception as exc:
                    self._on_fault(exc, step)
                    raise
            else:
                try:
                    self.checkpointer.poll()  # commits saves that every rank finished
                except Exception as exc:
                    self._on_fault(exc, step)
                    raise
        self.monitor.enter("checkpoint")
        self.checkpointer.wait()  # the final checkpoint is committed before we report success
        self.monitor.leave()
        if env.rank == 0:
            events.emit(Event.TRAIN_END, step=step, status="completed")

    # -- faults -------------------------------------------------------------------------------
    def _maybe_inject(self, step: int, *, before_save: bool) -> None:
        drill = self.cfg.fault_at(step, self.env.rank, self.attempt, self.env.node_rank, node_id())
        if drill is None or (drill.kind == "checkpoint_crash") == before_save:
            return
        key = (step, drill.attempt, drill.kind)
        if drill.kind != "user_bug":
            if key in self.fired:
                return
            self.fired.add(key)
        faults.inject(drill, step, self.events, writer_pids=self.checkpointer.writer_pids)

    def _on_fault(self, exc: Exception, step: int) -> None:
        """Log the fault; if this rank already failed the same way at the same step, and the error
        does not come from the platform (I/O, collectives, the checkpoint writer), it is the user's
        bug, not the machine's: stop every restart layer."""
        signature = fault_signature(exc)
        layer = "inprocess" if self.cfg.restart_mode in ("layered", "inprocess") else "injob"
        repeated = (not restart.is_platform_fault(exc)) and any(
            r.get("signature") == signature and r.get("step") == step and r.get("rank") == self.env.rank
            for r in read_events(self.layout.events, Event.FAULT_DETECTED))
        self.events.emit(Event.FAULT_DETECTED, layer=layer, kind=type(exc).__name__, step=step,
                         error=str(exc)[:500], signature=signature, repeated=repeated)
        if repeated:
            self._declare_user_error(signature, step)

    def _declare_user_error(self, signature: str, step: int) -> None:
        marker = self.layout.user_error_marker
        marker.parent.mkdir(parents=True, exist_ok=True)
        try:  # first rank wins; O_EXCL keeps the first diagnosis
            fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            with os.fdopen(fd, "w") as f:
                json.dump({"rank": self.env.rank, "step": step, "error": signature, "ts": time.time()}, f)
        except FileExistsError:
            pass
        self.monitor.shutdown_workload(f"user error at step {step}: {signature}")
        raise restart.UserErrorAbort(signature)

    def _restart_pending(self) -> tuple[str, float] | None:
        """(layer, fault time) when this attempt recovers from a fault, so the first step can
        report the restart's latency; rank 0 only.

        The layer: ``inprocess`` for a Wrapper iteration; ``injob`` when this launch already
        trained (steps logged since node 0's launcher started: ft_launcher's restart counter is
        per node, so it cannot tell); ``relaunch`` when only an earlier launch did (the control
        plane started the job again). The fault time is the first fault logged after the last
        completed step, else that step's end (a SIGKILL logs nothing: the latency is then over-
        rather than under-stated).
        """
        if self.env.rank != 0:
            return None
        records = read_events(self.layout.events)
        last_step = max((i for i, r in enumerate(records) if r.get("event") == Event.STEP.value), default=-1)
        if last_step < 0:
            return None  # nothing trained yet: a first start
        if self.iteration > 0:
            layer = "inprocess"
        else:
            launch = max((i for i, r in enumerate(records)
                          if r.get("event") == Event.LAUNCH_BEGIN.value and r.get("node_rank") == 0), default=-1)
            layer = "injob" if last_step > launch else "relaunch"
        faults = [r for r in records[last_step + 1:]
                  if r.get("event") in (Event.FAULT_INJECTED.value, Event.FAULT_DETECTED.value)]
        fault_ts = faults[0]["ts"] if faults else records[last_step]["ts"]
        if layer != "inprocess":
            self.events.emit(Event.RESTART_BEGIN, layer=layer, reason=f"{layer}: training processes started again",
                             fault_ts=fault_ts)
        return layer, fault_ts

    def close(self) -> None:
        self.checkpointer.close(wait=False)  # a clean run has nothing pending; a failed one has no group


def job_restart_round(local_count: int, device: torch.device) -> int:
    """The job's restart round: the largest TORCHELASTIC_RESTART_COUNT of any rank (a collective).

    A node that joined after a restart (a replacement pod) counts from 0 on NVRx 0.4.1, while
    the nodes that were there count every round; on 0.7 every node already has the job's round.
    Fault drills select their ``attempt`` by it, so a drill fires once per round on both."""
    count = torch.tensor([local_count], dtype=torch.int64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count.item())


def setup_device(cfg: RunConfig, env: WorkerEnv) -> torch.device:
    """This rank's device, made current. On CUDA this runs before anything of NVRx's starts (the
    in-process Wrapper forks its monitor process; the checkpoint writer spawns), so none of them
    starts from a process whose device is still unset."""
    device = choose_device(cfg.device, env.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.train", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="run config JSON (see training/contract.py)")
    args = parser.parse_args(argv)
    try:
        cfg = RunConfig.load(args.config)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return ExitCode.CONFIG_ERROR
    env = WorkerEnv.from_environ()
    if cfg.layout.user_error_marker.exists():
        print(f"error: {cfg.layout.user_error_marker} says this run has a user error; not training again. "
              "Fix the code or config and start a new run.", file=sys.stderr)
        return ExitCode.USER_ERROR
    trainer = Trainer(cfg, env)
    try:
        if cfg.restart_mode in ("layered", "inprocess"):
            wrapper = restart.inprocess_wrapper(cfg, lambda: trainer.events, device_type=trainer.device.type)
            wrapper(trainer.run)()
        else:
            trainer.run()
    except restart.UserErrorAbort as e:
        print(f"error: user error, not retrying: {e}", file=sys.stderr)
        return ExitCode.USER_ERROR
    finally:
        trainer.close()
    return ExitCode.SUCCESS


if __name__ == "__main__":  # the guard NVRx's async checkpoint workers need (they spawn)
    sys.exit(main())
