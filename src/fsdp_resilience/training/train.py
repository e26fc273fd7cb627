"""The training worker: one process per rank, started by ft_launcher or torchrun.

    python -m fsdp_resilience.training.train --config RUN.json      (normally via ``python -m fsdp_resilience.training.launch``)

One attempt of ``Trainer.run`` = build a process group, shard the model, restore the newest
committed checkpoint that verifies, train to ``cfg.steps`` with asynchronous checkpoints. The
in-process restart layer calls ``run`` again in the same process after a fault; the in-job layer
starts a new process.

Faults no restart can fix stop every layer: the first rank to see one writes the run's stop marker
(``contract.declare_stop``), asks ft_launcher to shut the workload down, and leaves with a
BaseException the in-process Wrapper does not retry:

- a user error: the same exception at the same step on two attempts (``restart.UserErrorAbort``);
- a storage error: the run dir is full or read-only (``StopTraining``, exit 74);
- non-finite state: the loss or gradient norm became NaN/inf again after
  ``cfg.max_nonfinite_rollbacks`` rollbacks (``StopTraining``, exit 65).

Non-finite state is found without a host sync per step: each rank keeps a flag on its device and
the ranks compare flags on logging steps and always before a checkpoint save, so a non-finite
step's state is never saved. Each detection rolls the run back, in place, to the newest verified
checkpoint (the process group stays; no restart budget is spent).

RNG: each rank's torch generator (dropout) starts from ``rank_seed(cfg.seed, rank)`` and its state is
saved per rank in every checkpoint, so a resume replays bitwise; see ``rank_seed``.
"""

import argparse
import contextlib
import datetime
import logging
import os
import sys
import time
import traceback
from dataclasses import dataclass
from typing import NoReturn, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from nvidia_resiliency_ext.inprocess import CallWrapper
from torch.distributed.tensor import DTensor

from fsdp_resilience.training import faults, restart
from fsdp_resilience.training.checkpointing import (
    AsyncCheckpointer,
    CheckpointMismatchError,
    app_state,
    choose_checkpoint,
    restore_app_state,
    restore_checkpoint,
    writer_stall_bound,
)
from fsdp_resilience.training.contract import (
    CheckpointInfo,
    ConfigError,
    Event,
    EventLog,
    ExitCode,
    FailureClass,
    RunConfig,
    declare_stop,
    exit_code_for,
    node_id,
    read_events,
    read_stop,
    record_membership,
    storage_errno,
)
from fsdp_resilience.training.data import BatchSampler, TokenShards
from fsdp_resilience.training.model import cross_entropy_loss, name_seed
from fsdp_resilience.training.parallelize import backend_for, build_optimizer, build_sharded_model, choose_device, device_mesh

#: What a stop marker tells a user to do, per failure class.
WHAT_TO_DO = {
    FailureClass.USER_ERROR: "fix the code or config and start a new run",
    FailureClass.NON_FINITE: "lower the learning rate or fix the data, and start a new run",
    FailureClass.STORAGE_ERROR: "free space or fix the run dir's mount, then relaunch",
}
#: ``fault_detected``'s failure_class for a restore that failed on a checkpoint's files.
CHECKPOINT_FAULT = "checkpoint"


@dataclass(frozen=True)
class WorkerEnv:
    """Where this worker sits, from the variables torchrun / ft_launcher set."""

    rank: int
    local_rank: int
    world_size: int
    #: The node as launched (fsdp_resilience.training.launch's node rank), not rendezvous's join order.
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
                   world_size=int(env.get("WORLD_SIZE", 1)),
                   node_rank=int(env.get(faults.NODE_RANK_ENV, env.get("GROUP_RANK", 0))),
                   attempt=int(env.get("TORCHELASTIC_RESTART_COUNT", 0)))


def fault_signature(exc: BaseException) -> str:
    return f"{type(exc).__module__}.{type(exc).__qualname__}: {str(exc)[:300]}"


class StopTraining(BaseException):
    """A fault no restart can fix (storage, non-finite state) was declared in the stop marker:
    every layer stops. A BaseException, so the in-process Wrapper does not retry it (as
    ``restart.UserErrorAbort``)."""

    def __init__(self, failure: FailureClass, message: str):
        super().__init__(failure, message)
        self.failure = failure
        self.message = message

    def __str__(self) -> str:
        return f"{self.failure.value}: {self.message}"


class NonFiniteState(Exception):
    """Internal: the ranks agreed that training state became NaN/inf; ``run`` rolls back."""

    def __init__(self, step: int, message: str, ts: float):
        super().__init__(step, message, ts)
        self.step, self.message, self.ts = step, message, ts

    def __str__(self) -> str:
        return self.message


def rank_seed(seed: int, rank: int, step: int = 0) -> int:
    """The seed of ``rank``'s torch RNG (dropout) when no saved state applies: derived from the run's
    ``seed``, the global rank and the step training starts at (0 for a fresh run), through
    SHA-256 (``model.name_seed``), so every rank draws its own stream and runs replay exactly.

    A checkpoint holds each rank's RNG state, restored on resume. When the world size changed
    since the save, no saved state belongs to a rank any more, and every rank re-seeds with the
    step it resumes at: deterministic, and not a replay of the streams of step 0."""
    return name_seed(seed, f"torch-rng/rank{rank}/step{step}")


def rank_rng_key(rank: int) -> str:
    """A rank's RNG entry under ``trainer.rng``. DCP stores one copy of a key that every rank
    saves (it treats it as replicated), so each rank's state lives under its own key."""
    return f"rank_{rank:05d}"


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def saved_rng_ranks(checkpoint: CheckpointInfo) -> set[int]:
    """The ranks whose RNG state checkpoint ``checkpoint`` holds (read from its DCP metadata)."""
    metadata = dcp.FileSystemReader(str(checkpoint.path)).read_metadata()
    ranks = set()
    for key in metadata.state_dict_metadata:
        parts = key.split(".")
        if parts[:2] == ["trainer", "rng"] and len(parts) > 2 and parts[2].startswith("rank_"):
            ranks.add(int(parts[2][len("rank_"):]))
    return ranks


def nonfinite_flags(loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
    """[loss is NaN/inf, gradient norm is NaN/inf]: a device tensor, no host sync. (Under FSDP
    the norm is a replicated DTensor holding the global norm.)"""
    norm = grad_norm.to_local() if isinstance(grad_norm, DTensor) else grad_norm
    return torch.stack([~torch.isfinite(loss.detach()), ~torch.isfinite(norm.detach())])


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
        # The checkpoint writer, forked now: before the stores, the process group or CUDA start
        # threads, a fork is safe, and it costs milliseconds where spawning one (a second
        # interpreter importing torch) would take seconds of CPU from this start and restore.
        self.checkpointer = AsyncCheckpointer(cfg.run_dir, rank=env.rank, world_size=env.world_size,
                                              events=self.events, keep=cfg.keep_checkpoints,
                                              writer_stall_s=writer_stall_bound(cfg.hang_timeout_s),
                                              fork_writer=True)
        self.monitor = restart.RankMonitor(cfg, self.timeouts)
        self.store = restart.app_store()  # outlives in-process restarts; process groups do not
        self.fired: set[tuple[int, int | None, str]] = set()  # drills fire once per process
        self.iteration = 0
        self.loss_target: int | None = None  # see _record_membership
        self.attempt = env.attempt  # the job's restart round, agreed by every rank in run()
        self.shards = TokenShards(cfg.dataset_dir, "train")

    # -- one attempt --------------------------------------------------------------------------
    def run(self, call_wrapper: Optional[CallWrapper] = None) -> None:
        # The annotation is how the in-process Wrapper finds where to pass its CallWrapper.
        cfg, env = self.cfg, self.env
        self.iteration = call_wrapper.iteration if call_wrapper is not None else 0
        self.events = self.events.bind(iteration=self.iteration)
        self.monitor.start()
        self.monitor.enter("setup")
        try:
            restart.init_process_group(self.backend, self.iteration, self.timeouts.collective_s,
                                       cfg.initial_heartbeat_timeout_s, self.store, self.device)
            mesh = device_mesh(self.device, cfg.nodes, cfg.procs_per_node)
            self.checkpointer.rebind(dist.group.WORLD)
            self.attempt = job_restart_round(env.attempt, self.device)
            self.events = self.events.bind(attempt=self.attempt)
            if cfg.spare_nodes and self.iteration == 0:
                self._record_membership()
            rollback: NonFiniteState | None = None
            while True:  # one pass per rollback from non-finite state
                self.monitor.enter("setup")  # a restore: the configured (long) timeouts
                with restore_timeout(self.timeouts.collective_s, max(self.timeouts.collective_s,
                                                                     cfg.initial_heartbeat_timeout_s)):
                    model, optimizer, sampler, start = self._restore(mesh)
                try:
                    self._train(model, optimizer, sampler, start, call_wrapper, rollback)
                    return
                except NonFiniteState as e:
                    rollback = e
                    del model, optimizer  # before the next pass builds their replacements
        except Exception:  # not a BaseException such as StopTraining or the Wrapper's interrupt
            self.checkpointer.abandon_pending()
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
            record_membership(self.layout, self.events, os.environ.get("TRAINING_LAUNCH_ID", ""), self.attempt,
                              members)

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
            rng = self._restore_rng(resumed, start)
            if resumed is not None:
                self.checkpointer.trust(resumed.step)  # retention keeps it until a newer commit
        except Exception as exc:
            self._on_fault(exc, chosen.step if chosen is not None else 0, restoring=True)
            raise
        self.events.emit(Event.TRAIN_BEGIN, start_step=start, world_size=env.world_size,
                         device=str(self.device), model=cfg.model,
                         resumed_from=resumed.checkpoint_id if resumed else None, rng=rng)
        return model, optimizer, sampler, start

    def _build(self, mesh, *, init_weights: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        cfg = self.cfg
        model = build_sharded_model(cfg.model, mesh, self.device, seed=cfg.seed,
                                    init_weights=init_weights, max_seq_len=cfg.seq_len)
        optimizer = build_optimizer(model, self.device, lr=cfg.lr, weight_decay=cfg.weight_decay)
        return model, optimizer

    def _restore_rng(self, resumed: CheckpointInfo | None, start: int) -> str:
        """Set this rank's torch RNG: its saved state when ``resumed`` holds one for every rank of
        this world size ("restored"), else ``rank_seed`` ("seeded"). Every rank decides alike
        (from the same metadata), so the load below is entered by all of them or none."""
        cfg, env = self.cfg, self.env
        if resumed is not None and saved_rng_ranks(resumed) == set(range(env.world_size)):
            key = rank_rng_key(env.rank)
            state = {"trainer": {"rng": {key: rng_state(self.device)}}}
            dcp.load(state, checkpoint_id=str(resumed.path))
            set_rng_state(state["trainer"]["rng"][key], self.device)
            return "restored"
        torch.manual_seed(rank_seed(cfg.seed, env.rank, start))  # seeds CUDA's generators too
        return "seeded" if resumed is None else "reseeded"

    def _train(self, model, optimizer, sampler, start: int, call_wrapper,
               rollback: NonFiniteState | None) -> None:
        cfg, env, events = self.cfg, self.env, self.events
        tokens_per_step = cfg.batch_size * cfg.seq_len * env.world_size
        step = start
        recovering = self._restart_pending(rollback)
        # The first step since the ranks last compared at which this rank's loss / gradient norm
        # was NaN or inf (0: none): a device tensor, so keeping it costs no host sync.
        nonfinite = torch.zeros(2, dtype=torch.int64, device=self.device)
        for step in range(start + 1, cfg.steps + 1):
            self.monitor.enter("step")
            t0 = time.perf_counter()
            log_step = step % cfg.log_interval == 0 or step == cfg.steps
            save_step = step % cfg.checkpoint_interval == 0 or step == cfg.steps
            try:
                drill = self._maybe_inject(step, before_save=True)
                inputs, targets = (t.to(self.device, non_blocking=True) for t in sampler.next_batch())
                loss = cross_entropy_loss(model(inputs), targets)
                if drill is not None and drill.kind == "nan":
                    loss = faults.poison_loss(loss)
                loss.backward()
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
                nonfinite = torch.where((nonfinite == 0) & nonfinite_flags(loss, grad_norm), step, nonfinite)
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
                events.emit(Event.STEP, step=step, loss=loss_value, step_s=round(step_s, 4),
                            tokens_per_s=round(tokens_per_step / step_s, 1))
            if save_step:
                self.monitor.enter("checkpoint")
                trainer_state = {"step": step, "sampler": sampler.state_dict(),
                                 "rng": {rank_rng_key(env.rank): rng_state(self.device)}}
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
        stats[1 + 2 * rank: 3 + 2 * rank] = nonfinite
        dist.all_reduce(stats)
        values = stats.tolist()
        return values[0] / world, [[int(values[1 + 2 * r]), int(values[2 + 2 * r])] for r in range(world)]

    # -- faults -------------------------------------------------------------------------------
    def _maybe_inject(self, step: int, *, before_save: bool):
        """Fire the drill configured for this step and rank, if any; returns it when training
        goes on (the writer drills, ``nan``), else None. The writer drills act on the save that
        just started (``before_save=False``), every other drill before the step."""
        drill = self.cfg.fault_at(step, self.env.rank, self.attempt, self.env.node_rank, node_id(), self.loss_target)
        if drill is None or (drill.kind in ("checkpoint_crash", "writer_hang")) == before_save:
            return None
        key = (step, drill.attempt, drill.kind)
        # A user bug fires on every attempt by definition; a nan drill with attempt null on every
        # pass (after each rollback too), so the rollback bound can be reached.
        every_pass = drill.kind == "user_bug" or (drill.kind == "nan" and drill.attempt is None)
        if not every_pass:
            if key in self.fired or ((drill.attempt is not None or drill.once) and self._fired_before(drill, step)):
                return None
            self.fired.add(key)
        faults.inject(drill, step, self.events, writer_pids=self.checkpointer.writer_pids)
        return drill

    def _fired_before(self, drill, step: int) -> bool:
        """Whether an earlier process already fired this drill in this round (``once``: in any
        round, on the rank or node it names). A node that leaves and rejoins is a membership
        change, which ft_launcher restarts without counting a restart round on NVRx 0.4.1, so the
        round alone cannot keep a drill to once per round."""
        if drill.once:
            where = ("node_rank", drill.node) if drill.kind == "node_loss" else ("rank", drill.rank)
            return any(r.get("kind") == drill.kind and r.get("step") == step
                       and (where[1] is None or r.get(where[0]) == where[1])
                       for r in read_events(self.layout.events, Event.FAULT_INJECTED))
        return any(r.get("kind") == drill.kind and r.get("step") == step and r.get("attempt") == self.attempt
                   for r in read_events(self.layout.events, Event.FAULT_INJECTED))

    def _on_fault(self, exc: Exception, step: int, *, restoring: bool = False) -> None:
        """Log the fault with its class (``fault_detected``'s ``failure_class``), and stop every
        restart layer when no restart can help:

        - a storage error (the run dir is full or read-only): at once, as ``storage_error``;
        - a checkpoint that holds another model than the config's (``CheckpointMismatchError``):
          at once, as a user error;
        - the same error at the same step in this rank as on an earlier attempt: a user error,
          unless the platform (I/O, collectives, the checkpoint writer) raised it;
        - a restore that failed the same way twice: the resume code already quarantined and fell
          back past every checkpoint that failed to load, so what is left is not the node's
          fault: a user error, whatever raised it (``restoring``).

        Anything else is the platform's, as far as a rank can tell (``restarts_exhausted``),
        except restore faults (``checkpoint``): those never point at the node.

        First of all, this attempt is over for this rank: it breaks its process groups'
        connections, so peers blocked in a collective with it fail now instead of at their
        collective timeout (``restart.GroupTransport``; gloo only).
        """
        restart.group_transport.shut_down()
        signature = fault_signature(exc)
        layer = "inprocess" if self.cfg.restart_mode in ("layered", "inprocess") else "injob"
        storage = storage_errno(exc) is not None
        mismatch = isinstance(exc, CheckpointMismatchError)
        repeated = (not storage) and (restoring or not restart.is_platform_fault(exc)) and any(
            r.get("signature") == signature and r.get("step") == step and r.get("rank") == self.env.rank
            for r in read_events(self.layout.events, Event.FAULT_DETECTED))
        if storage:
            failure = FailureClass.STORAGE_ERROR.value
        elif repeated or mismatch:
            failure = FailureClass.USER_ERROR.value
        elif restoring:
            failure = CHECKPOINT_FAULT
        else:
            failure = FailureClass.RESTARTS_EXHAUSTED.value
        self.events.emit(Event.FAULT_DETECTED, layer=layer, kind=type(exc).__name__, step=step,
                         error=str(exc)[:500], signature=signature, repeated=repeated, failure_class=failure,
                         restoring=restoring)
        if storage:
            self._stop(FailureClass.STORAGE_ERROR, step, f"the run dir cannot take writes: {exc}")
        if repeated or mismatch:
            self._declare_user_error(signature, step)

    def _on_nonfinite(self, step: int, first_bad: list[list[int]]) -> NoReturn:
        """Every rank, after the ranks agreed that state went NaN/inf (``first_bad``: per rank, the
        first step its loss / gradient norm did): roll back to the newest verified checkpoint
        (``NonFiniteState``), or stop once ``cfg.max_nonfinite_rollbacks`` rollbacks of this run
        did not help (``StopTraining``). Rank 0 counts the run's earlier rollbacks in the events
        log and decides for everyone."""
        cfg, env = self.cfg, self.env
        first = min(s for bad in first_bad for s in bad if s)
        ranks = [r for r, (loss_step, _) in enumerate(first_bad) if loss_step == first]
        what = (f"NaN/inf loss at step {first} on rank(s) {ranks}" if ranks
                else f"NaN/inf gradient norm at step {first} (every loss finite)")
        message = f"non-finite training state found at step {step}: {what}"
        decision = torch.zeros(1, dtype=torch.int64, device=self.device)
        if env.rank == 0:
            before = sum(1 for r in read_events(self.layout.events, Event.FAULT_DETECTED)
                         if r.get("failure_class") == FailureClass.NON_FINITE.value)
            roll_back = before < cfg.max_nonfinite_rollbacks
            self.events.emit(Event.FAULT_DETECTED, layer="rollback" if roll_back else "none",
                             kind=NonFiniteState.__name__, step=step, error=message,
                             signature=f"{__name__}.NonFiniteState: {what}", repeated=not roll_back,
                             failure_class=FailureClass.NON_FINITE.value, first_step=first, ranks=ranks,
                             rollbacks_before=before, max_rollbacks=cfg.max_nonfinite_rollbacks)
            decision[0] = int(roll_back)
        dist.broadcast(decision, src=0)
        # The pending save holds the last state that passed this check: commit it, so the rollback
        # (or a later relaunch) starts from the newest finite state.
        self.checkpointer.wait()
        if decision.item():
            raise NonFiniteState(step, message, time.time())
        self._stop(FailureClass.NON_FINITE, step,
                   f"{message}, after {cfg.max_nonfinite_rollbacks} rollback(s) to a verified checkpoint")

    def _stop(self, failure: FailureClass, step: int, message: str) -> NoReturn:
        """Stop every restart layer on every node: the stop marker (first rank wins; best effort,
        as the run dir may be what failed), then ft_launcher, then this process's Wrapper."""
        declare_stop(self.layout, failure, rank=self.env.rank, step=step, error=message[:1000])
        self.monitor.shutdown_workload(f"{failure.value} at step {step}: {message}"[:500])
        raise StopTraining(failure, f"at step {step}: {message}")

    def _declare_user_error(self, signature: str, step: int) -> NoReturn:
        declare_stop(self.layout, FailureClass.USER_ERROR, rank=self.env.rank, step=step, error=signature)
        self.monitor.shutdown_workload(f"user error at step {step}: {signature}")
        raise restart.UserErrorAbort(signature)

    def _restart_pending(self, rollback: NonFiniteState | None = None) -> tuple[str, float] | None:
        """(layer, fault time) when this attempt recovers from a fault, so the first step can
        report the restart's latency; rank 0 only.

        The layer: ``rollback`` after non-finite state (in place: same processes, same group);
        ``inprocess`` for a Wrapper iteration; ``injob`` when this launch already trained (steps
        logged since node 0's launcher started: ft_launcher's restart counter is per node, so it
        cannot tell); ``relaunch`` when only an earlier launch did (the control plane started the
        job again). The fault time is the first fault logged after the last completed step, else
        that step's end (a SIGKILL logs nothing: the latency is then over- rather than
        under-stated).
        """
        if self.env.rank != 0:
            return None
        if rollback is not None:
            self.events.emit(Event.RESTART_BEGIN, layer="rollback", fault_ts=rollback.ts,
                             reason=f"{rollback.message}: rolled back to the newest verified checkpoint")
            return "rollback", rollback.ts
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


@contextlib.contextmanager
def restore_timeout(collective_s: float, restore_s: float):
    """Run a restore under the default group's longer ``restore_s`` timeout, then return to
    ``collective_s``.

    The short collective timeout detects a failed peer during training steps, where ranks move in
    lockstep. In a restore they do not: each rank checksums its own share of the files, rank 0
    alone quarantines a checkpoint that fails (moves it, writes and fsyncs records), and loads
    read unequal amounts, so healthy ranks may reach the next collective seconds apart (minutes
    for a large model). ``restore_s`` is the bound the run config gives a start and restore
    (``initial_heartbeat_timeout_s``); a rank that dies meanwhile is still found by ft_launcher's
    process monitoring."""
    set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if set_timeout is None or restore_s <= collective_s:
        yield
        return
    set_timeout(datetime.timedelta(seconds=restore_s))
    try:
        yield
    finally:
        if dist.is_initialized():
            set_timeout(datetime.timedelta(seconds=collective_s))


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
    in-process Wrapper forks its monitor process; the checkpoint writer is forked or spawned), so
    none of them starts from a process whose device is still unset. (A process with a CUDA
    context spawns its writer: ``fork_is_safe``.)"""
    device = choose_device(cfg.device, env.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fsdp_resilience.training.train", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="run config JSON (see src/fsdp_resilience/training/contract.py)")
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
        print(f"error: {cfg.layout.stop_marker} says this run stopped with {failure.value} "
              f"(step {stop.get('step')}: {stop.get('error')}); not training again: {WHAT_TO_DO[failure]}.",
              file=sys.stderr)
        return exit_code_for(failure)
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
    except StopTraining as e:
        print(f"error: {e}; not retrying: {WHAT_TO_DO[e.failure]}", file=sys.stderr)
        return exit_code_for(e.failure)
    except Exception:
        # What the in-process layer could not recover (its budget spent, or peers gone: a lost
        # node): ft_launcher restarts the worker group once this process has exited. Exit now:
        # after a node loss, interpreter shutdown waited 90 s on NVRx 0.7's threads (seen), and
        # the in-job restart with it.
        traceback.print_exc()
        trainer.close()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    finally:
        trainer.close()
    return ExitCode.SUCCESS


if __name__ == "__main__":  # the guard NVRx's async checkpoint workers need (they spawn)
    sys.exit(main())
