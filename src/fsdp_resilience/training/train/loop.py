"""The Trainer: one attempt of training (``run``): a process group, the model sharded, the newest
verified checkpoint restored, then the loop (``_train``) to ``cfg.steps`` with asynchronous
checkpoints. What goes wrong is handled in ``fault_handling`` (the Trainer inherits it).

No ``from __future__ import annotations`` here: the in-process Wrapper finds where to pass its
``CallWrapper`` from ``run``'s annotation, which must be the class itself."""

import os
import threading
import time
from typing import Optional

import torch
import torch.distributed as dist
from nvidia_resiliency_ext.inprocess import CallWrapper

from fsdp_resilience.training import faults
from fsdp_resilience.training.checkpointing.checkpointer import AsyncCheckpointer
from fsdp_resilience.training.checkpointing.resume import choose_checkpoint, restore_checkpoint
from fsdp_resilience.training.checkpointing.snapshot import app_state, restore_app_state
from fsdp_resilience.training.checkpointing.writer import writer_stall_bound
from fsdp_resilience.training.contract import (
    CheckpointInfo,
    Event,
    EventLog,
    RunConfig,
    node_id,
    record_membership,
)
from fsdp_resilience.training.data import BatchSampler, TokenShards
from fsdp_resilience.training.model import cross_entropy_loss
from fsdp_resilience.training.parallelize import (
    backend_for,
    build_optimizer,
    build_sharded_model,
    device_mesh,
    mesh_groups,
)
from fsdp_resilience.training.restart.gloo_transport import group_transport
from fsdp_resilience.training.restart.process_group import (
    app_store,
    check_collective_timeouts,
    init_process_group,
    set_collective_timeout,
)
from fsdp_resilience.training.restart.rank_monitor import RankMonitor
from fsdp_resilience.training.train.env import WorkerEnv
from fsdp_resilience.training.train.fault_handling import FaultHandling, NonFiniteState, nonfinite_flags
from fsdp_resilience.training.train.rng import rank_rng_key, restore_rng, rng_state
from fsdp_resilience.training.train.startup import job_restart_round, restore_timeout, setup_device


class Trainer(FaultHandling):
    """Holds what survives an in-process restart (config, checkpoint writer, stores); ``run`` holds
    what does not (process group, model, optimizer)."""

    def __init__(self, cfg: RunConfig, env: WorkerEnv):
        self.cfg = cfg
        self.env = env
        self.layout = cfg.layout
        self.events = EventLog(
            self.layout.events,
            run_id=cfg.run_id,
            rank=env.rank,
            node_rank=env.node_rank,
            attempt=env.attempt,
            launch_id=os.environ.get("TRAINING_LAUNCH_ID", ""),
        )
        self.device = setup_device(cfg, env)
        self.backend = backend_for(self.device)
        self.timeouts = cfg.timeouts(self.backend)
        # The checkpoint writer, forked now: before the stores, the process group or CUDA start
        # threads, a fork is safe, and it costs milliseconds where spawning one (a second
        # interpreter importing torch) would take seconds of CPU from this start and restore.
        self.checkpointer = AsyncCheckpointer(
            cfg.run_dir,
            rank=env.rank,
            world_size=env.world_size,
            events=self.events,
            keep=cfg.keep_checkpoints,
            writer_stall_s=writer_stall_bound(cfg.hang_timeout_s),
            fork_writer=True,
        )
        self.monitor = RankMonitor(cfg, self.timeouts)
        self.store = app_store()  # outlives in-process restarts; process groups do not
        self.fired: set[tuple[int, int | None, str]] = set()  # drills fire once per process
        self.iteration = 0
        self.step = 0  # the step this rank is on (what a fault seen outside the loop is logged at)
        self.fault_logged = False  # this iteration logged its fault_detected already
        self.fault_lock = threading.Lock()  # the main thread and the Wrapper's monitor thread log faults
        self.loss_target: int | None = None  # see _record_membership
        self.attempt = env.attempt  # the job's restart round, agreed by every rank in run()
        self.shards = TokenShards(cfg.dataset_dir, "train")

    def run(self, call_wrapper: Optional[CallWrapper] = None) -> None:
        # The annotation is how the in-process Wrapper finds where to pass its CallWrapper.
        cfg, env = self.cfg, self.env
        self.iteration = call_wrapper.iteration if call_wrapper is not None else 0
        self.events = self.events.bind(iteration=self.iteration)
        self.fault_logged = False
        self.monitor.start()
        self.monitor.enter("setup")
        try:
            init_process_group(
                self.backend,
                self.iteration,
                self.timeouts.collective_s,
                cfg.initial_heartbeat_timeout_s,
                self.store,
                self.device,
            )
            mesh = device_mesh(self.device, cfg.nodes, cfg.procs_per_node)
            groups = mesh_groups(mesh)
            set_collective_timeout(self.timeouts.collective_s, groups)
            check_collective_timeouts(self.timeouts.collective_s, groups)
            if self.backend != "gloo":
                group_transport.mark()  # the save protocol's gloo group is this attempt's only one
            self.checkpointer.rebind(
                dist.group.WORLD,
                timeout_s=self.timeouts.collective_s,
                progress=call_wrapper.ping if call_wrapper is not None else None,
            )
            group_transport.seal()  # a fault breaks these connections, and only these
            self.attempt = job_restart_round(env.attempt, self.device)
            self.events = self.events.bind(attempt=self.attempt)
            if cfg.spare_nodes and self.iteration == 0:
                self._record_membership()
            rollback: NonFiniteState | None = None
            while True:  # one pass per rollback from non-finite state
                self.monitor.enter("setup")  # a restore: the configured (long) timeouts
                with restore_timeout(
                    self.timeouts.collective_s,
                    max(self.timeouts.collective_s, cfg.initial_heartbeat_timeout_s),
                    groups,
                ):
                    model, optimizer, sampler, start = self._restore(mesh)
                try:
                    self._train(model, optimizer, sampler, start, call_wrapper, rollback)
                    return
                except NonFiniteState as e:
                    rollback = e
                    del model, optimizer  # before the next pass builds their replacements
        except BaseException:  # a fault, a peer's (the Wrapper's interrupt), or a stop
            # The pending save stays torn, and the save protocol's group goes with the attempt
            # (the next one makes its own): after a fault its connections are broken.
            self.checkpointer.unbind()
            raise
        finally:
            self.monitor.stop()
            if dist.is_initialized():
                dist.destroy_process_group()

    def _record_membership(self) -> None:
        """Which nodes train in this attempt, agreed by one gather: rank 0 records it and names a
        spare that took a lost node's place (``spare_promoted``)."""
        members: list = [None] * self.env.world_size
        dist.all_gather_object(members, (self.env.node_rank, node_id()))
        # A node_loss drill with node null takes down the node of the highest rank off node 0.
        self.loss_target = max(((r, n) for r, (n, _) in enumerate(members) if n != 0), default=(None, None))[1]
        if self.env.rank == 0:
            record_membership(self.layout, self.events, os.environ.get("TRAINING_LAUNCH_ID", ""), self.attempt, members)

    def _restore(self, mesh) -> tuple[torch.nn.Module, torch.optim.Optimizer, BatchSampler, int]:
        """Model, optimizer and sampler at the newest committed checkpoint that verifies (every
        rank agrees on it), or fresh when there is none; returns them and the step to start after.
        A fault here is a restore fault (``fault_detected`` class "checkpoint")."""
        cfg, env = self.cfg, self.env
        chosen: CheckpointInfo | None = None
        try:
            # Which checkpoint to resume from is agreed before the model exists, so weights a
            # checkpoint is about to overwrite are never randomly initialised.
            chosen = choose_checkpoint(cfg.run_dir, events=self.events)
            model, optimizer = self._build(mesh, init_weights=chosen is None)
            sampler = BatchSampler(self.shards, cfg.seq_len, cfg.batch_size, env.rank, env.world_size, cfg.seed)
            resumed = None
            if chosen is not None:
                state = app_state(model, optimizer, {"step": 0, "sampler": sampler.state_dict()})
                # Falls back to earlier verified checkpoints (quarantining what fails to load).
                resumed = restore_checkpoint(cfg.run_dir, state, chosen, events=self.events)
                if resumed is None:  # nothing loaded: start afresh, exactly as a first run does
                    del model, optimizer, state
                    model, optimizer = self._build(mesh, init_weights=True)
                else:
                    restore_app_state(model, optimizer, state)
                    sampler.load_state_dict(state["trainer"]["sampler"])
            start = int(state["trainer"]["step"]) if resumed is not None else 0
            rng = restore_rng(
                resumed, start, seed=cfg.seed, rank=env.rank, world_size=env.world_size, device=self.device
            )
            if resumed is not None:
                self.checkpointer.trust(resumed.step)  # retention keeps it until a newer commit
        except Exception as exc:
            self._on_fault(exc, chosen.step if chosen is not None else 0, restoring=True)
            raise
        self.events.emit(
            Event.TRAIN_BEGIN,
            start_step=start,
            world_size=env.world_size,
            device=str(self.device),
            model=cfg.model,
            resumed_from=resumed.checkpoint_id if resumed else None,
            rng=rng,
        )
        return model, optimizer, sampler, start

    def _build(self, mesh, *, init_weights: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        cfg = self.cfg
        model = build_sharded_model(
            cfg.model, mesh, self.device, seed=cfg.seed, init_weights=init_weights, max_seq_len=cfg.seq_len
        )
        optimizer = build_optimizer(model, self.device, lr=cfg.lr, weight_decay=cfg.weight_decay)
        return model, optimizer

    def _train(self, model, optimizer, sampler, start: int, call_wrapper, rollback: NonFiniteState | None) -> None:
        cfg, env, events = self.cfg, self.env, self.events
        tokens_per_step = cfg.batch_size * cfg.seq_len * env.world_size
        step = start
        recovering = self._restart_pending(rollback)
        # The first step since the ranks last compared at which this rank's loss / gradient norm
        # was NaN or inf (0: none): a device tensor, so keeping it costs no host sync.
        nonfinite = torch.zeros(2, dtype=torch.int64, device=self.device)
        log_every = cfg.log_every(self.backend)
        protocol_round = start  # the last step that ran a round of the save protocol
        for step in range(start + 1, cfg.steps + 1):
            self.step = step
            self.monitor.enter("step")
            t0 = time.perf_counter()
            log_step = step % log_every == 0 or step == cfg.steps
            save_step = step % cfg.checkpoint_interval == 0 or step == cfg.steps
            try:
                drill = self._maybe_inject(step, faults.BEFORE_STEP)
                inputs, targets = (t.to(self.device, non_blocking=True) for t in sampler.next_batch())
                loss = cross_entropy_loss(model(inputs), targets)
                if drill is not None and drill.kind == "nan":
                    loss = faults.poison_loss(loss)
                loss.backward()
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
                nonfinite = torch.where((nonfinite == 0) & nonfinite_flags(loss, grad_norm), step, nonfinite)
                # The last save's snapshot copy ran during this forward and backward, which only
                # read the parameters and optimizer state; the optimizer step writes them.
                self.checkpointer.wait_snapshot()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if log_step or save_step:  # the only host sync of a step; always before a save
                    loss_value, first_bad = self._compare_ranks(loss, nonfinite)
                    nonfinite.zero_()
                    if any(any(bad) for bad in first_bad):
                        self._on_nonfinite(step, first_bad)  # raises
            except NonFiniteState:
                raise
            except Exception as exc:
                self._on_fault(exc, step)
                raise
            step_s = time.perf_counter() - t0
            self.monitor.heartbeat()
            self.monitor.derive_when_warm(step, events)  # once, at the same step on every rank
            if call_wrapper is not None:
                call_wrapper.ping()
            if recovering is not None:
                layer, fault_ts = recovering
                events.emit(Event.RESTART_END, layer=layer, step=step, latency_s=round(time.time() - fault_ts, 3))
            recovering = None
            if env.rank == 0 and log_step:
                events.emit(
                    Event.STEP,
                    step=step,
                    loss=loss_value,
                    step_s=round(step_s, 4),
                    tokens_per_s=round(tokens_per_step / step_s, 1),
                )
            if save_step:
                self.monitor.enter("checkpoint")
                trainer_state = {
                    "step": step,
                    "sampler": sampler.state_dict(),
                    "rng": {rank_rng_key(env.rank): rng_state(self.device)},
                }
                try:
                    self._maybe_inject(step, faults.SAVE_PROTOCOL, since=protocol_round)
                    protocol_round = step
                    self.checkpointer.save(step, app_state(model, optimizer, trainer_state), overlap_snapshot=True)
                    self._maybe_inject(step, faults.AFTER_SAVE)
                except Exception as exc:
                    self._on_fault(exc, step)
                    raise
            elif log_step:  # a pending save's round rides with the step's host sync
                try:
                    self._maybe_inject(step, faults.SAVE_PROTOCOL, since=protocol_round)
                    protocol_round = step
                    self.checkpointer.poll()  # commits saves that every rank finished
                except Exception as exc:
                    self._on_fault(exc, step)
                    raise
        self.monitor.enter("final_checkpoint")
        try:
            self.checkpointer.wait()  # the final checkpoint is committed before we report success
        except Exception as exc:
            self._on_fault(exc, step)
            raise
        self.monitor.leave()
        if env.rank == 0:
            events.emit(Event.TRAIN_END, step=step, status="completed")

    def _compare_ranks(self, loss: torch.Tensor, nonfinite: torch.Tensor) -> tuple[float, list[list[int]]]:
        """The mean loss over ranks, and for each rank the first step its loss and its gradient
        norm went NaN/inf since the last comparison (0: never): one all-reduce."""
        world, rank = self.env.world_size, self.env.rank
        stats = torch.zeros(1 + 2 * world, dtype=torch.float64, device=self.device)
        stats[0] = loss.detach()
        stats[1 + 2 * rank : 3 + 2 * rank] = nonfinite
        dist.all_reduce(stats)
        values = stats.tolist()
        return values[0] / world, [[int(values[1 + 2 * r]), int(values[2 + 2 * r])] for r in range(world)]

    def close(self) -> None:
        self.checkpointer.close(wait=False)  # a clean run has nothing pending; a failed one has no group
