"""Fault drills: deterministic faults, injected from the run config at step S, rank R, attempt A.

Each drill reproduces one way a real run dies, so every restart layer can be proven:

  exception         a Python exception in one rank           -> in-process restart
  hang              a Python-level busy loop (no progress)   -> in-process restart (soft timeout)
  sigstop           the process freezes (SIGSTOP)            -> in-job restart (hard timeout / heartbeat)
  sigkill           the process is killed                    -> in-job restart
  oom               exit 137, as the kernel OOM killer       -> in-job restart
  node_loss         every rank of a node and its launcher die-> in-job restart once the node returns
  checkpoint_crash  the async checkpoint writer dies mid-save-> in-process restart; the save stays torn
  writer_hang       the writer is SIGSTOPped mid-save        -> the checkpointer's stall bound kills and
                                                                replaces it; the save stays torn
  nan               one rank's loss becomes NaN at the step  -> rollback to the newest verified checkpoint
                                                                (attempt null: on every pass, until the
                                                                rollbacks run out -> NON_FINITE)
  user_bug          raises at the same step on every attempt -> USER_ERROR, never retried

Most drills fire before the step's forward; the writer drills right after a save began; a drill
``while_saving`` at the step's save-protocol round (the poll of a pending save, or a save's
settle), where its peers wait in the protocol's collective.

The drill writes a ``fault_injected`` event first, so tests and reports can line faults up with
what the restart layers did.
"""

from __future__ import annotations

import os
import signal
import time
from typing import TYPE_CHECKING, Callable

from fsdp_resilience.training.contract import Event, EventLog, FaultDrill

if TYPE_CHECKING:  # fsdp_resilience.training.launch imports this module and must not pay for torch
    import torch


class InjectedFault(RuntimeError):
    """A transient fault raised by the ``exception`` drill."""


class InjectedUserBug(ValueError):
    """The ``user_bug`` drill: deterministic, so it repeats on every attempt."""


#: Set by fsdp_resilience.training.launch for its workers: the node's launcher, which node_loss takes down too.
LAUNCH_PID_ENV = "TRAINING_LAUNCH_PID"
#: Set by fsdp_resilience.training.launch for its workers: the node's index as launched (the pod's Job index, the
#: local slot's node rank). Rendezvous may number nodes in another order (GROUP_RANK is the order
#: they joined in), and drills and events name the node that was launched.
NODE_RANK_ENV = "TRAINING_NODE_RANK"


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, their children, ...), read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


#: Where in a step a drill fires (``drill_phase``).
BEFORE_STEP, SAVE_PROTOCOL, AFTER_SAVE = "before_step", "save_protocol", "after_save"


def drill_phase(drill: FaultDrill) -> str:
    """Where in its step ``drill`` fires."""
    if drill.kind in ("checkpoint_crash", "writer_hang"):
        return AFTER_SAVE  # they act on the save that just began
    return SAVE_PROTOCOL if drill.while_saving else BEFORE_STEP


def poison_loss(loss: torch.Tensor) -> torch.Tensor:
    """The ``nan`` drill's effect: the loss (and so every gradient of this rank) becomes NaN, as a
    bad batch or an overflow would make it."""
    return loss * float("nan")


def inject(
    drill: FaultDrill, step: int, events: EventLog, *, writer_pids: Callable[[], list[int]] = lambda: []
) -> None:
    """Make ``drill`` happen now. Returns only for drills that let training go on: the writer
    drills (they act on the save that just started) and ``nan``, which the trainer applies to its
    loss with ``poison_loss``."""
    events.emit(Event.FAULT_INJECTED, kind=drill.kind, step=step)
    kind = drill.kind
    if kind == "exception":
        raise InjectedFault(f"injected exception at step {step}")
    if kind == "user_bug":
        raise InjectedUserBug(f"injected user bug at step {step}: this fails on every attempt")
    if kind == "hang":
        # A pure-Python busy loop: the in-process Wrapper's soft timeout can interrupt it
        # (it raises asynchronously into the main thread between bytecodes).
        while True:
            time.sleep(0)  # keeps the loop in Python bytecode, not one long C call
    if kind == "sigstop":
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    if kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "oom":
        os._exit(137)
    if kind == "node_loss":
        # The whole node goes at once, as when an instance dies: fsdp_resilience.training.launch first (so it
        # reports nothing), then every process it started. Found by parentage, not by process
        # group: torchelastic starts each worker in a session of its own, so a group kill would
        # leave the node's ft_launcher running as a ghost agent that rejoins the rendezvous.
        launch_pid = int(os.environ.get(LAUNCH_PID_ENV, "0"))
        node = [launch_pid, *descendants(launch_pid)] if launch_pid > 1 else []
        for pid in [p for p in node if p != os.getpid()]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os.killpg(os.getpgrp(), signal.SIGKILL)
    if kind in ("checkpoint_crash", "writer_hang"):
        # A writer may fork file writers of its own: freeze or kill all of them, as a stuck
        # filesystem or the OOM killer would.
        sig = signal.SIGKILL if kind == "checkpoint_crash" else signal.SIGSTOP
        for pid in writer_pids():
            for target in (pid, *descendants(pid)):
                try:
                    os.kill(target, sig)
                except ProcessLookupError:
                    pass
        return
    if kind == "nan":
        return
    raise ValueError(f"unknown fault kind {kind!r}")
