"""``NodeLauncher``: runs one node's launcher (ft_launcher or torchrun, under the guard) and watches
it: progress (committed checkpoints), a rank's stop marker, a spare's wait for the training nodes;
then writes the node's ``final`` record and returns the run contract's exit code."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from fsdp_resilience.training.contract import (
    LAUNCH_ENDING_FAILURES,
    LAUNCH_UID_ENV,
    CheckpointCatalog,
    Event,
    EventLog,
    FailureClass,
    RunConfig,
    atomic_write_text,
    exit_code_for,
    read_events,
)
from fsdp_resilience.training.faults import LAUNCH_PID_ENV, NODE_RANK_ENV, descendants
from fsdp_resilience.training.launch.command import build_command, nvrx_version, write_ft_launcher_config
from fsdp_resilience.training.launch.event_tail import EventTail
from fsdp_resilience.training.launch.guard import (
    END_NOW_SIGNAL,
    KILL_GRACE_S,
    become_subreaper,
    end_process_tree,
    guard_command,
    parent_death_signal,
)
from fsdp_resilience.training.launch.membership_watch import MembershipWatch
from fsdp_resilience.training.launch.outcome import (
    classify,
    describe_stop,
    dropped_spare_reason,
    launcher_log_hint,
    launcher_log_lines,
    stop_record,
)
from fsdp_resilience.training.launch.worker_client import ZYGOTE_ENV, ZYGOTE_OFF
from fsdp_resilience.training.launch.worker_zygote import CLIENT_SCRIPT, new_socket_path
from fsdp_resilience.training.restart.health_checks import LAUNCHER, launcher_refusal, record_health_check

#: A node's launcher waits this long after a rank declared a stop (control/STOP.json) for
#: ft_launcher to stop by itself (the failing rank asked it to) before stopping it.
STOP_GRACE_S = 20.0
POLL_S = 1.0
#: How often a spare looks for its launch's training nodes to have started.
SPARE_POLL_S = 0.2
#: How long ft_launcher gets to stop its workers after SIGTERM, and the guard to end its process
#: tree after being told to (``guard.KILL_GRACE_S``), before the next, harder step.
TERMINATE_GRACE_S = 15.0


class NodeLauncher:
    """Runs and watches the launcher of one node."""

    def __init__(self, cfg: RunConfig, node_rank: int, rdzv_host: str):
        self.cfg = cfg
        self.node_rank = node_rank
        self.rdzv_host = rdzv_host
        self.layout = cfg.layout
        self.launch_id = os.environ.get("TRAINING_LAUNCH_ID", "")
        #: The launch's incarnation (on EKS its Job's UID; "" locally), recorded in ``final``.
        self.launch_uid = os.environ.get(LAUNCH_UID_ENV, "")
        self.events = EventLog(
            self.layout.events, run_id=cfg.run_id, node_rank=node_rank, launch_id=self.launch_id, role="launcher"
        )
        self.proc: subprocess.Popen | None = None
        self.zygote_socket: str | None = None  # where the guard's worker_zygote listens
        self.terminated_by: int | None = None
        self.began: dict | None = None  # this launch's launch_begin record
        self.lock_fd: int | None = None
        self.standby = False  # a spare: decided in run()

    def prepare(self) -> list[str]:
        self.layout.create()
        if self.node_rank == 0:
            atomic_write_text(self.layout.config, self.cfg.to_json() + "\n")
        else:  # other nodes wait for node 0's copy rather than racing it
            deadline = time.time() + 120
            while not self.layout.config.exists() and time.time() < deadline:
                time.sleep(POLL_S)
            if not self.layout.config.exists():
                atomic_write_text(self.layout.config, self.cfg.to_json() + "\n")
        ft_cfg = self.layout.logs / f"ft-launcher-node{self.node_rank}.yaml"
        if self.cfg.restart_mode in ("layered", "injob"):
            write_ft_launcher_config(self.cfg, ft_cfg)
        return build_command(self.cfg, self.node_rank, self.rdzv_host, ft_cfg, self.layout.logs)

    def _forward_signal(self, signum, _frame) -> None:
        # Kubernetes deletes a pod with SIGTERM: pass it on to ft_launcher's process group, then exit.
        self.terminated_by = signum
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)

    def launch_state(self, tail: "EventTail") -> dict | None:
        """What the records ``tail`` reads next say of this launch: a ``final`` that ended it
        (``LAUNCH_ENDING_FAILURES``) first, wherever it is among them, else the first
        ``train_begin``, else None. A ``final`` of an earlier incarnation of the launch id (its
        ``launch_uid`` another) is not this launch's."""
        began = None
        for record in tail.read():
            if record.get("launch_id", "") != self.launch_id:
                continue
            event = record.get("event")
            if event == Event.FINAL.value and record.get("failure_class") in LAUNCH_ENDING_FAILURES:
                if not self.launch_uid or record.get("launch_uid") in (None, self.launch_uid):
                    return record
            elif event == Event.TRAIN_BEGIN.value and began is None:
                began = record
        return began

    def wait_for_training_nodes(self, tail: "EventTail") -> dict | None:
        """A spare joins the rendezvous once this launch's training nodes have: the rendezvous
        admits whoever comes first, so a spare that started early could take a training node's
        place (harmless, but the spare would then be an observed fact, not the launch's plan).
        Returns the ``final`` record of a launch that ended before training began (then this
        spare has nothing to wait for)."""
        while True:
            state = self.launch_state(tail)
            if state is not None:
                return state if state["event"] == Event.FINAL.value else None
            if self.terminated_by is not None:
                return {"failure_class": FailureClass.UNKNOWN.value}
            time.sleep(SPARE_POLL_S)

    def run(self, command: list[str]) -> int:
        cfg = self.cfg
        # A spare: beyond the launch's training nodes, or (a pod recreated for a lost node's
        # index) started once the launch trains; it parks in the rendezvous either way.
        tail = EventTail(self.layout.events)
        state = self.launch_state(tail) if cfg.spare_nodes else None
        self.standby = bool(cfg.spare_nodes) and (self.node_rank >= cfg.nodes or state is not None)
        self.began = self.events.emit(
            Event.LAUNCH_BEGIN,
            nodes=cfg.nodes,
            spare_nodes=cfg.spare_nodes,
            procs_per_node=cfg.procs_per_node,
            restart_mode=cfg.restart_mode,
            rdzv_host=self.rdzv_host,
            command=shlex.join(command),
            standby=self.standby,
        )
        signal.signal(signal.SIGTERM, self._forward_signal)
        signal.signal(signal.SIGINT, self._forward_signal)
        if self.standby:
            ended = (
                self.wait_for_training_nodes(tail)
                if state is None
                else (state if state["event"] == Event.FINAL.value else None)
            )
            if ended is not None:
                failure = FailureClass(ended.get("failure_class") or FailureClass.UNKNOWN.value)
                if self.terminated_by is not None:
                    return self.finish(0, False)
                return self._final(failure, "standby: the launch ended before this spare was needed", None)
        env = dict(os.environ)
        env[LAUNCH_PID_ENV] = str(os.getpid())
        env[NODE_RANK_ENV] = str(self.node_rank)
        env.setdefault("PYTHONUNBUFFERED", "1")
        if self.cfg.nodes > 1 and self.rdzv_host in ("127.0.0.1", "localhost", "::1"):
            # Several "nodes" on one host (the local backend): NVRx 0.7's rendezvous otherwise
            # refuses the second launcher as a duplicate participant.
            env.setdefault("NVRX_ENABLE_MULTI_LAUNCHERS_PER_NODE", "1")
        if cfg.spare_nodes and nvrx_version() >= (0, 6):
            # NVRx 0.7 orders nodes by their infrastructure rank (GROUP_RANK in the launcher's
            # environment): training nodes keep their places across restarts, a spare ranks after
            # them, and the round waits briefly for a node that trained before.
            env["GROUP_RANK"] = str(self.node_rank)
        # The worker (and the guard) import this package from wherever this one came from (an
        # installed package, or a source tree on PYTHONPATH).
        pkg_root = str(Path(__file__).resolve().parents[3])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH", "")) if p)
        # If the guard is killed, what it leaves comes back here to be ended (_reap).
        become_subreaper()
        if cfg.restart_mode in ("layered", "injob") and env.get(ZYGOTE_ENV, "") != ZYGOTE_OFF:
            # The ranks of every in-job restart are forked from one interpreter that imported
            # torch and NVRx once (worker_zygote, which the guard starts); ft_launcher's worker
            # command asks it for them.
            self.zygote_socket = env[ZYGOTE_ENV] = new_socket_path()
        # The guard gets its own session (ft_launcher shares it, so a group SIGTERM stops it
        # gracefully) and the parent-death signal: if this process dies, the launch dies with it.
        lock = () if self.lock_fd is None else (self.lock_fd,)
        self.proc = subprocess.Popen(
            guard_command(lock[0] if lock else -1, command),
            env=env,
            start_new_session=True,
            pass_fds=lock,
            preexec_fn=parent_death_signal(END_NOW_SIGNAL),
        )
        stalled = False
        lost: str | None = None  # why the launch ended for nodes no spare or replacement covers
        watch = (
            MembershipWatch(
                self.layout,
                self.events,
                self.launch_id,
                self.node_rank,
                standby=self.standby,
                workers_alive=self.workers_alive,
            )
            if cfg.spare_nodes and cfg.restart_mode in ("layered", "injob")
            else None
        )
        stop_seen: float | None = None
        catalog = CheckpointCatalog(self.layout)
        last_progress = time.time()
        last_step = -1
        while self.proc.poll() is None:
            time.sleep(POLL_S)
            latest = catalog.latest()
            if latest is not None and latest.step != last_step:
                last_step, last_progress = latest.step, time.time()
            if time.time() - last_progress > cfg.stall_timeout_s:
                stalled = True
                self._stop("no progress")
            if watch is not None and lost is None:
                lost = watch.poll()
                if lost is not None:
                    self._stop(lost)
            if self.layout.stop_marker.exists():
                stop_seen = stop_seen or time.time()
                if time.time() - stop_seen > STOP_GRACE_S:
                    self._stop(f"a rank declared {(stop_record(self.layout) or {}).get('failure_class')}")
        rc = self.proc.returncode
        self._reap()
        if self.zygote_socket is not None:
            shutil.rmtree(Path(self.zygote_socket).parent, ignore_errors=True)
        return self.finish(rc, stalled, lost)

    def workers_alive(self) -> bool:
        """Whether any worker of this node runs now: ft_launcher's worker command (the zygote's
        client, or the trainer it became when no zygote answered)."""
        for pid in descendants(self.proc.pid) if self.proc is not None else ():  # noqa: SIM110
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read()
            except OSError:
                continue
            head = cmd.split(b"\0")[1:4]  # interpreter flags, then the script or module
            if head[:1] == [b"-c"]:
                continue  # ft_launcher (or the guard), whose own command line ends with the worker's
            if str(CLIENT_SCRIPT).encode() in head or b"fsdp_resilience.training.train" in head:
                return True
        return False

    def _stop(self, why: str) -> None:
        """SIGTERM to ft_launcher's group (it stops its workers), then the guard ends the tree,
        then SIGKILL to the group; each step only if the one before did not end it in time."""
        print(f"[launch] stopping the launcher: {why}", flush=True)
        for send, grace in (
            (lambda: os.killpg(self.proc.pid, signal.SIGTERM), TERMINATE_GRACE_S),
            (lambda: os.kill(self.proc.pid, END_NOW_SIGNAL), KILL_GRACE_S),
            (lambda: os.killpg(self.proc.pid, signal.SIGKILL), KILL_GRACE_S),
        ):
            try:
                send()
                self.proc.wait(timeout=grace)
                return
            except subprocess.TimeoutExpired:
                continue
            except ProcessLookupError:
                return

    def _reap(self) -> None:
        """End whatever the launch left behind: nothing, unless the guard itself was killed (its
        orphans then came here). Only once the guard is reaped: this reaps every child."""
        left = end_process_tree()
        if left:
            print(f"[launch] processes of this launch that would not die: {left}", file=sys.stderr, flush=True)

    def workers_started(self, this_node: bool = False) -> bool:
        """Whether any rank of this launch (``this_node``: of this node) began training: a
        ``train_begin`` of this launch id after this launcher's ``launch_begin`` (one launcher
        per node: the lock)."""
        if self.began is None:
            return False
        return any(
            r.get("ts", 0) >= self.began["ts"]
            and r.get("launch_id", "") == self.launch_id
            and (not this_node or r.get("node_rank") == self.node_rank)
            for r in read_events(self.layout.events, Event.TRAIN_BEGIN)
        )

    def finish(self, rc: int, stalled: bool, lost: str | None = None) -> int:
        if rc not in (0, None) and self.terminated_by is None:
            self.record_refusal()
        if lost is not None and self.terminated_by is None:
            failure, message = FailureClass.RESTARTS_EXHAUSTED, lost
        elif self.terminated_by is not None:
            failure, message = FailureClass.UNKNOWN, f"terminated by signal {self.terminated_by} (pod deleted?)"
        elif self.standby and rc != 0 and not self.workers_started(this_node=True) and stop_record(self.layout) is None:
            # A spare that leaves without training never decides the run: the others do.
            failure, message = FailureClass.UNKNOWN, f"spare dropped before it trained: {dropped_spare_reason(rc)}"
        else:
            failure, message = classify(self.cfg, rc, stalled, self.workers_started(), launcher_log_hint())
        return self._final(failure, message, rc)

    def record_refusal(self) -> None:
        """When ft_launcher's rendezvous turned this node away for a failed health check (its log
        says so), record it as evidence against this node. Only where the log is a file here (the
        local backend); on EKS the launcher's output is the pod's log."""
        refusal = launcher_refusal(launcher_log_lines())
        if refusal is not None:
            record_health_check(self.events, refusal[0], LAUNCHER, refusal[1])

    def finish_stopped(self, stop: dict) -> int:
        """The run already has a stop (a user error, non-finite state) that no relaunch fixes."""
        failure, message = describe_stop(stop)
        return self._final(
            failure, f"not launching again: {message} (control/STOP.json); fix it and start a new run", None
        )

    def _final(self, failure: FailureClass, message: str, rc: int | None) -> int:
        code = exit_code_for(failure)
        latest = CheckpointCatalog(self.layout).latest()
        self.events.emit(
            Event.FINAL,
            failure_class=failure.value,
            exit_code=int(code),
            launcher_exit_code=rc,
            step=latest.step if latest else 0,
            checkpoint_id=latest.checkpoint_id if latest else None,
            message=message,
            host=socket.gethostname(),
            **({"launch_uid": self.launch_uid} if self.launch_uid else {}),
        )
        print(f"[launch] node {self.node_rank}: {failure.value} (exit {int(code)}): {message}", flush=True)
        return int(code)
