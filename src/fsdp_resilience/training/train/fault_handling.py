"""What a training worker does when something goes wrong: classify a fault and stop every restart
layer when no restart can help, roll back from non-finite state, fire the configured fault drills,
and report the restart an attempt recovers from."""

from __future__ import annotations

import time
from typing import NoReturn

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fsdp_resilience.training import faults
from fsdp_resilience.training.checkpointing.resume import CheckpointMismatchError
from fsdp_resilience.training.contract import (
    Event,
    FailureClass,
    declare_stop,
    node_id,
    read_events,
    storage_errno,
)
from fsdp_resilience.training.restart.fault_kinds import UserErrorAbort, is_platform_fault
from fsdp_resilience.training.restart.gloo_transport import group_transport

#: ``fault_detected``'s failure_class for a restore that failed on a checkpoint's files.
CHECKPOINT_FAULT = "checkpoint"


def fault_signature(exc: BaseException) -> str:
    return f"{type(exc).__module__}.{type(exc).__qualname__}: {str(exc)[:300]}"


class StopTraining(BaseException):
    """A fault no restart can fix (storage, non-finite state) was declared in the stop marker:
    every layer stops. A BaseException, so the in-process Wrapper does not retry it (as
    ``restart.fault_kinds.UserErrorAbort``)."""

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


def nonfinite_flags(loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
    """[loss is NaN/inf, gradient norm is NaN/inf]: a device tensor, no host sync. (Under FSDP
    the norm is a replicated DTensor holding the global norm.)"""
    norm = grad_norm.to_local() if isinstance(grad_norm, DTensor) else grad_norm
    return torch.stack([~torch.isfinite(loss.detach()), ~torch.isfinite(norm.detach())])


#: How long a thread about to log a fault waits for the other thread's record of it (a write to the
#: events log, normally milliseconds): a rank exiting for its lost in-process store waits for the
#: main thread's.
FAULT_RECORD_WAIT_S = 5.0


class FaultHandling:
    """The Trainer's fault paths (``loop.Trainer`` inherits them). They use the Trainer's ``cfg``,
    ``env``, ``layout``, ``events``, ``monitor``, ``checkpointer`` and ``device``, and the state of
    its attempt: ``attempt``, ``iteration``, ``step``, ``fault_logged`` (under ``fault_lock``), ``fired``
    and ``loss_target``."""

    def _maybe_inject(self, step: int, phase: str, *, since: int | None = None):
        """Fire the drill configured for this step and rank if it fires in ``phase`` of the step
        (``faults.drill_phase``); returns it when training goes on (the writer drills, ``nan``),
        else None. ``since``: also a drill of a step after ``since`` (the save protocol's rounds
        run at logged steps only, so a drill ``while_saving`` fires at the first round at or
        after its step)."""
        drill = None
        for at in range(step if since is None else since + 1, step + 1):
            found = self.cfg.fault_at(at, self.env.rank, self.attempt, self.env.node_rank, node_id(), self.loss_target)
            if found is not None and faults.drill_phase(found) == phase:
                drill = found
                break
        if drill is None:
            return None
        step = drill.step  # fired once, and recorded as the step it was configured for
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
            return any(
                r.get("kind") == drill.kind
                and r.get("step") == step
                and (where[1] is None or r.get(where[0]) == where[1])
                for r in read_events(self.layout.events, Event.FAULT_INJECTED)
            )
        return any(
            r.get("kind") == drill.kind and r.get("step") == step and r.get("attempt") == self.attempt
            for r in read_events(self.layout.events, Event.FAULT_INJECTED)
        )

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
        collective timeout (``restart.gloo_transport.GroupTransport``: its gloo groups, which on
        CUDA are the save protocol's).
        """
        group_transport.shut_down()
        signature = fault_signature(exc)
        layer = "inprocess" if self.cfg.restart_mode in ("layered", "inprocess") else "injob"
        storage = storage_errno(exc) is not None
        mismatch = isinstance(exc, CheckpointMismatchError)
        repeated = (
            (not storage)
            and (restoring or not is_platform_fault(exc))
            and any(
                r.get("signature") == signature and r.get("step") == step and r.get("rank") == self.env.rank
                for r in read_events(self.layout.events, Event.FAULT_DETECTED)
            )
        )
        if storage:
            failure = FailureClass.STORAGE_ERROR.value
        elif repeated or mismatch:
            failure = FailureClass.USER_ERROR.value
        elif restoring:
            failure = CHECKPOINT_FAULT
        else:
            failure = FailureClass.RESTARTS_EXHAUSTED.value
        self._log_fault(exc, step, layer, failure, signature, repeated=repeated, restoring=restoring)
        if storage:
            self._stop(FailureClass.STORAGE_ERROR, step, f"the run dir cannot take writes: {exc}")
        if repeated or mismatch:
            self._declare_user_error(signature, step)

    def on_restart_store_lost(self, exc: BaseException) -> None:
        """The in-process layer lost its store, which lives with rank 0: rank 0's process or node
        is gone, and this rank exits next so that ft_launcher restarts it in-job
        (``restart.wrapper.exit_when_the_monitor_thread_dies``). Log that fault unless this rank
        already logged one in this iteration: when the store's connection breaks before any
        collective of this rank fails, it is the only record of the fault this rank ever writes
        (ft_launcher ends it before it reaches one). Both break at once when rank 0 dies: a
        record the main thread is writing is waited for, as the exit would cut it off."""
        self._log_fault(
            exc,
            self.step,
            "injob",
            FailureClass.RESTARTS_EXHAUSTED.value,
            fault_signature(exc),
            error=f"the in-process restart layer lost its store with rank 0 (rank 0 is gone): {exc}",
            unless_logged=True,
        )

    def _log_fault(
        self,
        exc: BaseException,
        step: int,
        layer: str,
        failure: str,
        signature: str,
        *,
        error: str | None = None,
        repeated: bool = False,
        restoring: bool = False,
        unless_logged: bool = False,
    ) -> None:
        """This rank's ``fault_detected``, under ``fault_lock``: the main thread and the Wrapper's
        monitor thread both log faults, and the monitor thread's exit must not cut a record off.
        ``unless_logged``: not if this iteration logged one already."""
        if not self.fault_lock.acquire(timeout=FAULT_RECORD_WAIT_S):
            return  # the other thread is stuck in its record: going on matters more
        try:
            if unless_logged and self.fault_logged:
                return
            self.fault_logged = True
            self.events.emit(
                Event.FAULT_DETECTED,
                layer=layer,
                kind=type(exc).__name__,
                step=step,
                error=(error or str(exc))[:500],
                signature=signature,
                repeated=repeated,
                failure_class=failure,
                restoring=restoring,
            )
        finally:
            self.fault_lock.release()

    def _on_nonfinite(self, step: int, first_bad: list[list[int]]) -> NoReturn:
        """Every rank, after the ranks agreed that state went NaN/inf (``first_bad``: per rank, the
        first step its loss / gradient norm did): roll back to the newest verified checkpoint
        (``NonFiniteState``), or stop once ``cfg.max_nonfinite_rollbacks`` rollbacks of this run
        did not help (``StopTraining``). Rank 0 counts the run's earlier rollbacks in the events
        log and decides for everyone."""
        cfg, env = self.cfg, self.env
        first = min(s for bad in first_bad for s in bad if s)
        ranks = [r for r, (loss_step, _) in enumerate(first_bad) if loss_step == first]
        what = (
            f"NaN/inf loss at step {first} on rank(s) {ranks}"
            if ranks
            else f"NaN/inf gradient norm at step {first} (every loss finite)"
        )
        message = f"non-finite training state found at step {step}: {what}"
        decision = torch.zeros(1, dtype=torch.int64, device=self.device)
        if env.rank == 0:
            before = sum(
                1
                for r in read_events(self.layout.events, Event.FAULT_DETECTED)
                if r.get("failure_class") == FailureClass.NON_FINITE.value
            )
            roll_back = before < cfg.max_nonfinite_rollbacks
            self.events.emit(
                Event.FAULT_DETECTED,
                layer="rollback" if roll_back else "none",
                kind=NonFiniteState.__name__,
                step=step,
                error=message,
                signature=f"{__name__}.NonFiniteState: {what}",
                repeated=not roll_back,
                failure_class=FailureClass.NON_FINITE.value,
                first_step=first,
                ranks=ranks,
                rollbacks_before=before,
                max_rollbacks=cfg.max_nonfinite_rollbacks,
            )
            decision[0] = int(roll_back)
        dist.broadcast(decision, src=0)
        # The pending save holds the last state that passed this check: commit it, so the rollback
        # (or a later relaunch) starts from the newest finite state.
        self.checkpointer.wait()
        if decision.item():
            raise NonFiniteState(step, message, time.time())
        self._stop(
            FailureClass.NON_FINITE,
            step,
            f"{message}, after {cfg.max_nonfinite_rollbacks} rollback(s) to a verified checkpoint",
        )

    def _stop(self, failure: FailureClass, step: int, message: str) -> NoReturn:
        """Stop every restart layer on every node: the stop marker (first rank wins; best effort,
        as the run dir may be what failed), then ft_launcher, then this process's Wrapper."""
        declare_stop(self.layout, failure, rank=self.env.rank, step=step, error=message[:1000])
        self.monitor.shutdown_workload(f"{failure.value} at step {step}: {message}"[:500])
        raise StopTraining(failure, f"at step {step}: {message}")

    def _declare_user_error(self, signature: str, step: int) -> NoReturn:
        declare_stop(self.layout, FailureClass.USER_ERROR, rank=self.env.rank, step=step, error=signature)
        self.monitor.shutdown_workload(f"user error at step {step}: {signature}")
        raise UserErrorAbort(signature)

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
            self.events.emit(
                Event.RESTART_BEGIN,
                layer="rollback",
                fault_ts=rollback.ts,
                reason=f"{rollback.message}: rolled back to the newest verified checkpoint",
            )
            return "rollback", rollback.ts
        records = read_events(self.layout.events)
        last_step = max((i for i, r in enumerate(records) if r.get("event") == Event.STEP.value), default=-1)
        if last_step < 0:
            return None  # nothing trained yet: a first start
        if self.iteration > 0:
            layer = "inprocess"
        else:
            launch = max(
                (
                    i
                    for i, r in enumerate(records)
                    if r.get("event") == Event.LAUNCH_BEGIN.value and r.get("node_rank") == 0
                ),
                default=-1,
            )
            layer = "injob" if last_step > launch else "relaunch"
        faults = [
            r
            for r in records[last_step + 1 :]
            if r.get("event") in (Event.FAULT_INJECTED.value, Event.FAULT_DETECTED.value)
        ]
        fault_ts = faults[0]["ts"] if faults else records[last_step]["ts"]
        if layer != "inprocess":
            self.events.emit(
                Event.RESTART_BEGIN, layer=layer, reason=f"{layer}: training processes started again", fault_ts=fault_ts
            )
        return layer, fault_ts
