"""The one command a training pod (or a local process group) runs:

    python -m fsdp_resilience.training.launch --config RUN.json [--node-rank N] [--rdzv-host HOST] [--dry-run]

It validates the run, takes this node's launch lock, checks that the run dir takes writes, builds
the NVRx launcher command for this node, runs it, watches it, and exits with the run contract's
exit code after writing a ``final`` event:

  restart_mode  launcher                                   what restarts what
  layered       ft_launcher + inprocess.Wrapper in workers exceptions/hangs in-process; dead,
                                                           frozen or silent ranks by ft_launcher
  injob         ft_launcher                                any rank failure -> worker group respawn
  inprocess     torchrun --max-restarts 0 + Wrapper        exceptions/hangs in-process only
  none          torchrun --max-restarts 0                  nothing

Exit codes (src/fsdp_resilience/training/contract/failures.py: ExitCode, FailureClass):

  0   success             trained every step; the final checkpoint is committed
  2   (config error)      bad config, arguments, dataset, or a run/dataset dir that is a file or
                          sits under one: one line on stderr, nothing started, no event
  65  non_finite          a rank declared non-finite training state (control/STOP.json)
  73  already_running     another fsdp_resilience.training.launch of this run holds this node's launch lock
                          (control/launch-node<N>.lock): one line, no event, nothing changed
  74  storage_error       the run dir is full or read-only: at start (one line, no event), or as
                          the reason a launch failed (a rank's STOP.json, or a probe after it)
  75  restarts_exhausted  ft_launcher gave up after max_restarts (or a rank failed without
                          in-job restarts): suspect the machine
  78  user_error          a rank declared a user error (the same error at the same step twice)
  93  no_progress         no new committed checkpoint within stall_timeout_s, or NVRx 0.7's
                          progress tracking stopped ft_launcher
  1   unknown             anything else: killed from outside, or the workers never started
                          (ft_launcher failed before any rank began training: read its log)

Processes: one launch per run per node (an exclusive ``flock`` on the node's lock file, held until
every process of the launch is gone). Between this process and ft_launcher sits a small guard
(``supervise``): a child subreaper that outlives every rank, NVRx helper and daemon of the launch
(they are reparented to it, whatever sessions they start), kills them all when ft_launcher exits,
and kills them at once when this process dies, even by SIGKILL (its parent-death signal).

The run config comes from --config (a JSON file), else from TRAINING_RUN_CONFIG (the JSON
itself: how an EKS pod gets it, with no file to ship).

Where this node sits comes from the flags, else the environment:
  node rank      --node-rank, JOB_COMPLETION_INDEX (a Kubernetes Indexed Job), NODE_RANK, 0
  rendezvous     --rdzv-host, TRAINING_RDZV_HOST (e.g. the headless Service name of pod 0),
                 MASTER_ADDR, 127.0.0.1 on a single node

This module does not import torch: it starts in milliseconds and rejects bad input before any
expensive work starts.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import errno
import fcntl
import importlib.metadata
import importlib.util
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from fsdp_resilience.training.contract import (
    CheckpointCatalog,
    ConfigError,
    Event,
    EventLog,
    ExitCode,
    FailureClass,
    RunConfig,
    RunDir,
    atomic_write_text,
    exit_code_for,
    probe_writable,
    read_dataset_index,
    read_events,
    read_stop,
)
from fsdp_resilience.training.faults import LAUNCH_PID_ENV, NODE_RANK_ENV, descendants

#: A node's launcher waits this long after a rank declared a stop (control/STOP.json) for
#: ft_launcher to stop by itself (the failing rank asked it to) before stopping it.
STOP_GRACE_S = 20.0
POLL_S = 1.0
#: How often a spare looks for its launch's training nodes to have started.
SPARE_POLL_S = 0.2
#: How long ft_launcher gets to stop its workers after SIGTERM, and the guard to end its process
#: tree after being told to, before the next, harder step.
TERMINATE_GRACE_S = 15.0
KILL_GRACE_S = 10.0


#: The run config's JSON, when no --config file is given (a Kubernetes pod's env).
CONFIG_ENV = "TRAINING_RUN_CONFIG"


def load_config(path: str | None) -> RunConfig:
    if path:
        return RunConfig.load(path)
    text = os.environ.get(CONFIG_ENV, "").strip()
    if not text:
        raise ConfigError(f"no run config: pass --config RUN.json or set {CONFIG_ENV} to the config's JSON")
    return RunConfig.from_json(text)


def node_rank_from_env(explicit: int | None) -> int:
    if explicit is not None:
        return explicit
    for var in ("JOB_COMPLETION_INDEX", "NODE_RANK"):
        if os.environ.get(var, "").strip():
            return int(os.environ[var])
    return 0


def rdzv_host_from_env(explicit: str | None, cfg: RunConfig) -> str:
    host = explicit or os.environ.get("TRAINING_RDZV_HOST") or os.environ.get("MASTER_ADDR")
    if host:
        return host
    if cfg.nodes == 1:
        return "127.0.0.1"
    raise ConfigError("a multi-node run needs the rendezvous host: pass --rdzv-host or set TRAINING_RDZV_HOST "
                      "(on EKS: the headless Service name of the pod with completion index 0)")


def nvrx_fault_tolerance_config() -> type:
    """The installed NVRx's ``FaultToleranceConfig`` class: what ft_launcher parses its YAML into.

    Loaded from its own file: importing the ``fault_tolerance`` package would import torch, and
    this module starts in milliseconds. The file needs only the standard library and yaml."""
    spec = importlib.util.find_spec("nvidia_resiliency_ext")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("nvidia-resiliency-ext is not installed in this environment: install the training "
                          "requirements (pip install -e '.[training]')")
    path = Path(spec.submodule_search_locations[0]) / "fault_tolerance" / "config.py"
    name = "_nvrx_fault_tolerance_config"
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    try:
        module_spec.loader.exec_module(module)
    finally:
        sys.modules.pop(name, None)
    return module.FaultToleranceConfig


def ft_launcher_config(cfg: RunConfig, known_keys: set[str] | frozenset[str]) -> dict:
    """ft_launcher's ``fault_tolerance:`` section for the installed NVRx (``known_keys``: its
    ``FaultToleranceConfig`` fields). --max-restarts has no key and goes on the command line.

    Workers report heartbeats and sections (src/fsdp_resilience/training/restart.py: RankMonitor). The timeouts here
    are the configured ones (``RunConfig.section_timeouts``): ``setup`` (process group, model,
    restore) and ``final_checkpoint`` may take as long as the first heartbeat; ``step`` and
    ``checkpoint`` (the blocking part of a save) as long as a heartbeat. They hold until the
    workers have run their warm steps and two saves; then they derive tighter heartbeat, ``step``
    and ``checkpoint`` timeouts from what they measured, ``safety_factor`` x the longest interval
    (``RestartTimeouts.derive``), and send them to their rank monitors.

    Where NVRx tracks progress (0.7: exit 93 after restart cycles that commit nothing new), it
    reads the newest committed step from ``RunDir.latest_step``.
    """
    section = {
        "initial_rank_heartbeat_timeout": cfg.initial_heartbeat_timeout_s,
        "rank_heartbeat_timeout": cfg.heartbeat_timeout_s,
        "rank_section_timeouts": cfg.section_timeouts(),
        "rank_out_of_section_timeout": cfg.initial_heartbeat_timeout_s,
        "workload_check_interval": 0.5,  # how often a rank monitor checks its timeouts: detection lag
        "node_health_check_interval": 5.0,
        "safety_factor": cfg.timeout_safety_factor,
        "rank_termination_signal": "SIGKILL",
        "log_level": "INFO",
        "restart_check_interval": 1.0,
    }
    if "checkpoint_iteration_file" in known_keys:
        section["checkpoint_iteration_file"] = str(cfg.layout.latest_step.absolute())
    return {"fault_tolerance": section}


def check_ft_launcher_config(path: Path, written: dict, config_class: type) -> None:
    """Parse ``path`` the way ft_launcher will, refusing unknown keys, and compare what it read
    with what we meant. NVRx ignores a YAML file it cannot parse, and unknown keys, without a word
    (it then runs with its defaults: on 0.7, no hang detection at all), so a mistake here would
    only show as restarts that never come."""
    try:
        parsed = config_class.from_yaml_file(str(path), ignore_not_recognized=False)
    except Exception as e:
        raise ConfigError(f"ft_launcher would not read {path} as written: {e}. This is a bug of fsdp_resilience.training.launch "
                          "with this nvidia-resiliency-ext version; report it with the file") from None
    for key, value in written["fault_tolerance"].items():
        if isinstance(value, (int, float, dict)) and not isinstance(value, bool):
            got = getattr(parsed, key)
            if got != value:
                raise ConfigError(f"ft_launcher would read {key}={got!r} from {path}, not {value!r}")


def _libuv_conf() -> str:
    """Torch builds without libuv (``USE_LIBUV=0``) need the rendezvous store told so too: NVRx
    0.7 reads ``use_libuv`` from --rdzv-conf (default true) and ignores the environment."""
    return ",use_libuv=false" if os.environ.get("USE_LIBUV", "1").strip().lower() in ("0", "false", "no") else ""


def nvrx_version() -> tuple[int, ...]:
    """The installed nvidia-resiliency-ext's version, e.g. (0, 7, 0); () when it is not installed."""
    try:
        text = importlib.metadata.version("nvidia-resiliency-ext")
    except importlib.metadata.PackageNotFoundError:
        return ()
    return tuple(int(p) for p in re.findall(r"\d+", text)[:3])


def nnodes_flag(cfg: RunConfig) -> str:
    """``--nnodes`` for this run. With spares, the training world must stay ``nodes`` nodes:
    - NVRx 0.6+ (its barrier rendezvous): ``N:M``. N is the world; launchers beyond it wait as
      hot spares. M is not an admission cap but the budget of nodes its health checks may turn
      away over the job's life, so it is generous.
    - NVRx 0.4.1 (its fork of torch's c10d rendezvous): ``N``. Launchers beyond N go on the
      rendezvous' redundancy list and join when a participant is gone; ``N:M`` would grow the
      world to M."""
    if cfg.spare_nodes and nvrx_version() >= (0, 6):
        return f"--nnodes={cfg.nodes}:{cfg.node_rank_limit}"
    return f"--nnodes={cfg.nodes}"


def build_command(cfg: RunConfig, node_rank: int, rdzv_host: str, ft_cfg_path: Path,
                  log_dir: Path) -> list[str]:
    """The launcher command for this node."""
    rdzv = [
        nnodes_flag(cfg),
        f"--nproc-per-node={cfg.procs_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={rdzv_host}:{cfg.rdzv_port}",
        f"--rdzv-id={cfg.run_id}",
        # Node 0 hosts the rendezvous store; saying so avoids guessing from host names, which
        # fails when several "nodes" share one machine (the local backend).
        f"--rdzv-conf=is_host={'true' if node_rank == 0 else 'false'},join_timeout=600{_libuv_conf()}",
        "--monitor-interval=0.5",
    ]
    worker = ["-m", "fsdp_resilience.training.train", "--config", str(Path(cfg.run_dir) / "run.json")]
    bindir = Path(sys.executable).parent
    if cfg.restart_mode in ("layered", "injob"):
        checks = []
        if cfg.spare_nodes and nvrx_version() >= (0, 6):
            # NVRx 0.7 checks a node at every join of its rendezvous, a spare's included: here
            # also that the run's shared storage is there, so a spare whose mount is gone is
            # turned away (its launcher exits, saying why) instead of taking a rank.
            checks = [f"--ft-storage-health-check-path={Path(cfg.run_dir).absolute() / 'checkpoints'}"]
        return [str(bindir / "ft_launcher"), f"--ft-cfg-path={ft_cfg_path}",
                # 0.4.1 ignores enable_nic_monitor in YAML; both versions accept the flag.
                "--ft-enable-nic-monitor=false", *checks,
                f"--max-restarts={cfg.max_restarts}", *rdzv, *worker]
    return [sys.executable, "-m", "torch.distributed.run", "--max-restarts=0", *rdzv, *worker]


# --------------------------------------------------------------------------------------------
# Process lifetime: nothing of a launch outlives it (Linux prctl)
# --------------------------------------------------------------------------------------------

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
#: The guard's parent-death signal, and fsdp_resilience.training.launch's "end everything now" to the guard.
END_NOW_SIGNAL = signal.SIGUSR1


_LIBC: ctypes.CDLL | None = None


def _libc() -> ctypes.CDLL:
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
    return _LIBC


def _prctl(option: int, value: int) -> None:
    if _libc().prctl(option, value, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}, {value}): {os.strerror(err)}")


def become_subreaper() -> None:
    """Orphans below this process (a rank whose ft_launcher died, a daemon that double-forked into
    a session of its own) are reparented to it, not to init, so it can find and end them."""
    _prctl(PR_SET_CHILD_SUBREAPER, 1)


def parent_death_signal(sig: int) -> Callable[[], None]:
    """A ``preexec_fn``: the child gets ``sig`` when this process dies (even by SIGKILL). If this
    process is already gone by the time the child sets it, the child exits at once."""
    parent = os.getpid()
    _libc()  # loaded here, not in the forked child

    def preexec() -> None:
        _prctl(PR_SET_PDEATHSIG, int(sig))
        if os.getppid() != parent:
            os._exit(128 + int(sig))

    return preexec


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True  # gone


def _reap_exited() -> None:
    """Collect every exited child (adopted orphans included), so none stays a zombie. Only call
    it where no child's exit status still matters to anyone (``subprocess`` would lose it)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def end_process_tree(timeout_s: float = KILL_GRACE_S) -> list[int]:
    """SIGKILL every process below this one until none is left (ranks and NVRx daemons may have
    started sessions of their own: found by parentage, not by process group), reaping them.
    Returns those still there after ``timeout_s`` (stuck in the kernel, e.g. on a hung mount)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = descendants(os.getpid())
        for pid in left:
            if not _is_zombie(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        _reap_exited()
        if not left:
            return []
        if time.monotonic() > deadline:
            return [p for p in left if not _is_zombie(p)]
        time.sleep(0.05)


def supervise(lock_fd: int, command: list[str]) -> int:
    """The guard: fsdp_resilience.training.launch's child, the parent of ft_launcher (or torchrun).

    It is a subreaper, so every process of the launch stays below it whatever sessions they
    start. It ignores the SIGTERM that fsdp_resilience.training.launch sends to the process group to stop
    ft_launcher gracefully, and outlives ft_launcher: then it ends what is left and exits with
    ft_launcher's status. On ``END_NOW_SIGNAL`` (its parent-death signal: fsdp_resilience.training.launch died;
    or fsdp_resilience.training.launch's hard stop) it kills the whole tree at once. It holds the launch lock
    (inherited from fsdp_resilience.training.launch), so the lock is free only when the launch's processes are
    gone; ft_launcher does not inherit it."""
    if lock_fd >= 0:
        os.set_inheritable(lock_fd, False)
    become_subreaper()

    def end_now(signum, _frame) -> None:
        end_process_tree()
        os._exit(128 + signum)

    signal.signal(END_NOW_SIGNAL, end_now)
    for sig in (signal.SIGTERM, signal.SIGINT):
        # A handler, not SIG_IGN: an ignored signal would stay ignored in ft_launcher after exec.
        signal.signal(sig, lambda *_: None)
    try:
        child = subprocess.Popen(command, preexec_fn=parent_death_signal(signal.SIGKILL))
    except OSError as e:
        print(f"error: cannot start {command[0]}: {e.strerror or e}", file=sys.stderr, flush=True)
        return 127
    while True:  # wait for ft_launcher, reaping adopted orphans meanwhile
        pid, status = os.waitpid(-1, 0)
        if pid == child.pid:
            break
    child.returncode = os.waitstatus_to_exitcode(status)  # so Popen.__del__ does not wait on it
    left = end_process_tree()
    if left:
        print(f"[launch] processes that would not die: {left}", file=sys.stderr, flush=True)
    if child.returncode < 0:  # pass a death by signal on as one
        sig = -child.returncode
        if sig != signal.SIGKILL:
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        return 128 + sig  # a signal whose default is to be ignored
    return child.returncode


def guard_command(lock_fd: int, command: list[str]) -> list[str]:
    return [sys.executable, "-c", "import sys; from fsdp_resilience.training.launch import supervise; "
            "sys.exit(supervise(int(sys.argv[1]), sys.argv[2:]))", str(lock_fd), *command]


# --------------------------------------------------------------------------------------------
# One launch per run per node
# --------------------------------------------------------------------------------------------


class AlreadyRunning(Exception):
    """Another fsdp_resilience.training.launch of this run and node holds the launch lock."""


class StorageError(Exception):
    """The run dir cannot take writes."""


#: How long a node's launcher waits for the launch lock held by a dead predecessor of the same
#: launch on another machine: a pod the Job recreated for a lost index, while the lost machine's
#: storage client still holds the lock (Lustre releases a dead client's locks when it evicts it).
PREDECESSOR_LOCK_WAIT_S = 300.0


def take_launch_lock(layout: RunDir, node_rank: int, launch_id: str = "",
                     predecessor_wait_s: float = PREDECESSOR_LOCK_WAIT_S) -> int | None:
    """Hold this node's launch lock (an exclusive ``flock``) for the life of the launch; returns
    its descriptor (close-on-exec: no rank or NVRx helper ever holds it), or None where the file
    system has no ``flock`` (a warning says a second launcher then goes undetected). Records who
    holds it in the file. Raises ``AlreadyRunning`` at once if another launcher holds it, unless
    the holder is this launch's node on another host (a lost node's launcher, whose lock outlives
    it until its storage client is evicted): that one is waited for, up to ``predecessor_wait_s``."""
    path = layout.launch_lock(node_rank)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise StorageError(f"the run dir cannot take writes: cannot open the launch lock {path}: "
                           f"{e.strerror or e}") from None
    deadline = time.monotonic() + predecessor_wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            try:
                holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
            except (OSError, ValueError):
                holder = {}
            predecessor = bool(launch_id) and holder.get("launch_id") == launch_id and \
                holder.get("host") not in (None, socket.gethostname())
            if predecessor and time.monotonic() < deadline:
                time.sleep(POLL_S)
                continue
            os.close(fd)
            who = (f"fsdp_resilience.training.launch pid {holder.get('pid')} on {holder.get('host')}" if holder.get("pid")
                   else "another fsdp_resilience.training.launch (pid not recorded yet)")
            raise AlreadyRunning(f"node {node_rank} of this run is already being launched: {path} is held by {who}. "
                                 "Not starting a second launcher; stop that one, or let it finish") from None
        except OSError as e:  # e.g. a Lustre client mounted with noflock
            print(f"warning: cannot lock {path} ({e.strerror or e}): a second launcher of this node would go "
                  "undetected", file=sys.stderr, flush=True)
            os.close(fd)
            return None
    try:  # who holds it, for the refusal message; best effort (a full disk may refuse even this)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(),
                                  "launch_id": launch_id}).encode(), 0)
    except OSError:
        pass
    return fd


def create_run_dir(layout: RunDir) -> None:
    """The run dir's folders. A path that cannot be a folder (a part of it is a file or a broken
    link) is a config error; anything else that refuses the writes is storage."""
    try:
        layout.create()
    except OSError as e:
        where = Path(e.filename or layout.root)
        if e.errno in (errno.ENOTDIR, errno.EEXIST):
            what = "is a link to nothing" if where.is_symlink() and not where.exists() else "is not a folder"
            raise ConfigError(f"run_dir={layout.root} cannot be created: {where} {what}; choose a folder path") from None
        if e.errno in (errno.ENAMETOOLONG, errno.ELOOP):
            raise ConfigError(f"run_dir={layout.root} cannot be created: {e.strerror}; choose a folder path") from None
        raise StorageError(f"the run dir {layout.root} cannot be created: {e.strerror or e} (errno {e.errno})") from None


def storage_problem(layout: RunDir) -> str | None:
    """Why the run dir cannot take a write now (full, read-only, no permission), or None."""
    return probe_writable(layout.checkpoints)


STORAGE_ADVICE = "free space or fix the mount, then launch again"


# --------------------------------------------------------------------------------------------
# What a launch's end means
# --------------------------------------------------------------------------------------------


def stop_record(layout: RunDir) -> dict | None:
    """The stop a rank declared (control/STOP.json), or None. A marker left empty or torn on a full
    disk (its file created, its content refused) is the storage fault it stands for."""
    stop = read_stop(layout)
    if stop is not None and "ts" not in stop:  # unreadable: declare_stop always records ts
        problem = storage_problem(layout)
        if problem:
            return {"failure_class": FailureClass.STORAGE_ERROR.value, "error": problem}
    return stop


def describe_stop(stop: dict) -> tuple[FailureClass, str]:
    failure = FailureClass(stop["failure_class"])
    what = failure.value.replace("_", " ")
    where = f" at step {stop['step']}" if stop.get("step") is not None else ""
    why = next((str(stop[k]) for k in ("error", "reason", "message") if stop.get(k)), "no details recorded")
    advice = f"; {STORAGE_ADVICE}" if failure is FailureClass.STORAGE_ERROR else ""
    return failure, f"{what}{where}: {why}{advice}"


def classify(cfg: RunConfig, rc: int, stalled: bool, workers_started: bool = True,
             log_hint: str = "this node's launcher log") -> tuple[FailureClass, str]:
    """What the launcher's exit means, in the run contract's terms. ``workers_started``: whether
    any rank of this launch began training (a ``train_begin`` after its ``launch_begin``)."""
    layout = cfg.layout
    stop = stop_record(layout)
    if stop is not None:
        return describe_stop(stop)
    latest = CheckpointCatalog(layout).latest()
    if rc == 0 and not stalled and latest is not None and latest.step >= cfg.steps:
        return FailureClass.SUCCESS, f"trained {cfg.steps} steps; final checkpoint {latest.checkpoint_id}"
    problem = storage_problem(layout)
    if problem:
        return FailureClass.STORAGE_ERROR, f"{problem}; {STORAGE_ADVICE}"
    if stalled:
        return FailureClass.NO_PROGRESS, f"no new committed checkpoint for {cfg.stall_timeout_s:.0f}s"
    if rc == ExitCode.NO_PROGRESS:
        return FailureClass.NO_PROGRESS, ("ft_launcher stopped restarting: its last restart cycles committed no "
                                          f"checkpoint past step {latest.step if latest else 0}")
    if rc == 0:
        return FailureClass.UNKNOWN, "the launcher exited 0 before the final checkpoint was committed"
    if rc < 0:
        return FailureClass.UNKNOWN, f"the launcher was killed by signal {-rc}"
    launcher = "ft_launcher" if cfg.restart_mode in ("layered", "injob") else "torchrun"
    if not workers_started:
        return FailureClass.UNKNOWN, (f"the workers never started: {launcher} exited {rc} before any rank began "
                                      f"training (nothing was restarted); read {log_hint}")
    if cfg.restart_mode in ("layered", "injob"):
        return FailureClass.RESTARTS_EXHAUSTED, f"ft_launcher gave up after max_restarts={cfg.max_restarts} (exit {rc})"
    return FailureClass.RESTARTS_EXHAUSTED, f"a rank failed and restart_mode={cfg.restart_mode} has no in-job restarts (exit {rc})"


class EventTail:
    """Reads the events log incrementally: each ``read`` returns the records appended since the
    last (whole lines only: a line still being written is read next time)."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0

    def read(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self.offset += end
        out = []
        for line in data[:end].splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a torn line of a killed writer
            if isinstance(record, dict):
                out.append(record)
        return out


#: What NVRx logs when its rendezvous turns a node away (0.7: the health checks at every join;
#: both versions: a rank's ExcludeThisNode request, a GPU check).
_REFUSAL_MARKS = ("health check failed", "UnhealthyNodeException", "excluded from the training", "unhealthy")


def dropped_spare_reason(rc: int, log_path: str | None = None) -> str:
    """Why a spare's ft_launcher left the rendezvous before its node trained: the last line of
    its log where NVRx turned the node away (a failed health check), else its exit code."""
    path = log_path or launcher_log_hint()
    reason = ""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - (256 << 10)))
            for line in f.read().decode(errors="replace").splitlines():
                if any(mark.lower() in line.lower() for mark in _REFUSAL_MARKS):
                    reason = line.strip()[-400:]
    except OSError:
        pass
    where = f"; read {path}" if path.startswith("/") else ""
    return (f"NVRx turned the node away: {reason}" if reason else f"ft_launcher exited {rc}") + where


def launcher_log_hint() -> str:
    """Where this process's output goes, for messages that send the reader there: the file our
    stdout is (the local backend's logs/<job>-node<N>.log), else the pod's log."""
    try:
        target = os.readlink("/proc/self/fd/1")
        if target.startswith("/") and Path(target).is_file():
            return target
    except OSError:
        pass
    return "this node's launcher output (on EKS: kubectl logs of the node's pod)"


class NodeLauncher:
    """Runs and watches the launcher of one node."""

    def __init__(self, cfg: RunConfig, node_rank: int, rdzv_host: str):
        self.cfg = cfg
        self.node_rank = node_rank
        self.rdzv_host = rdzv_host
        self.layout = cfg.layout
        self.launch_id = os.environ.get("TRAINING_LAUNCH_ID", "")
        self.events = EventLog(self.layout.events, run_id=cfg.run_id, node_rank=node_rank,
                               launch_id=self.launch_id, role="launcher")
        self.proc: subprocess.Popen | None = None
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
            config_class = nvrx_fault_tolerance_config()
            section = ft_launcher_config(self.cfg, {f.name for f in dataclasses.fields(config_class)})
            # JSON is YAML: written without a yaml library, read back with NVRx's own parser.
            atomic_write_text(ft_cfg, json.dumps(section, indent=2) + "\n")
            check_ft_launcher_config(ft_cfg, section, config_class)
        return build_command(self.cfg, self.node_rank, self.rdzv_host, ft_cfg, self.layout.logs)

    def _forward_signal(self, signum, _frame) -> None:
        # Kubernetes deletes a pod with SIGTERM: pass it on to ft_launcher's process group, then exit.
        self.terminated_by = signum
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)

    def launch_state(self, tail: "EventTail") -> dict | None:
        """This launch's first ``train_begin`` or ``final`` among the records ``tail`` reads next."""
        for record in tail.read():
            if record.get("launch_id", "") == self.launch_id and \
                    record.get("event") in (Event.TRAIN_BEGIN.value, Event.FINAL.value):
                return record
        return None

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
        self.began = self.events.emit(Event.LAUNCH_BEGIN, nodes=cfg.nodes, spare_nodes=cfg.spare_nodes,
                                      procs_per_node=cfg.procs_per_node, restart_mode=cfg.restart_mode,
                                      rdzv_host=self.rdzv_host, command=shlex.join(command), standby=self.standby)
        signal.signal(signal.SIGTERM, self._forward_signal)
        signal.signal(signal.SIGINT, self._forward_signal)
        if self.standby:
            ended = self.wait_for_training_nodes(tail) if state is None else \
                (state if state["event"] == Event.FINAL.value else None)
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
        pkg_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH", "")) if p)
        # If the guard is killed, what it leaves comes back here to be ended (_reap).
        become_subreaper()
        # The guard gets its own session (ft_launcher shares it, so a group SIGTERM stops it
        # gracefully) and the parent-death signal: if this process dies, the launch dies with it.
        lock = () if self.lock_fd is None else (self.lock_fd,)
        self.proc = subprocess.Popen(guard_command(lock[0] if lock else -1, command), env=env,
                                     start_new_session=True, pass_fds=lock,
                                     preexec_fn=parent_death_signal(END_NOW_SIGNAL))
        stalled = False
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
            if self.layout.stop_marker.exists():
                stop_seen = stop_seen or time.time()
                if time.time() - stop_seen > STOP_GRACE_S:
                    self._stop(f"a rank declared {(stop_record(self.layout) or {}).get('failure_class')}")
        rc = self.proc.returncode
        self._reap()
        return self.finish(rc, stalled)

    def _stop(self, why: str) -> None:
        """SIGTERM to ft_launcher's group (it stops its workers), then the guard ends the tree,
        then SIGKILL to the group; each step only if the one before did not end it in time."""
        print(f"[launch] stopping the launcher: {why}", flush=True)
        for send, grace in ((lambda: os.killpg(self.proc.pid, signal.SIGTERM), TERMINATE_GRACE_S),
                            (lambda: os.kill(self.proc.pid, END_NOW_SIGNAL), KILL_GRACE_S),
                            (lambda: os.killpg(self.proc.pid, signal.SIGKILL), KILL_GRACE_S)):
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
        return any(r.get("ts", 0) >= self.began["ts"] and r.get("launch_id", "") == self.launch_id
                   and (not this_node or r.get("node_rank") == self.node_rank)
                   for r in read_events(self.layout.events, Event.TRAIN_BEGIN))

    def finish(self, rc: int, stalled: bool) -> int:
        if self.terminated_by is not None:
            failure, message = FailureClass.UNKNOWN, f"terminated by signal {self.terminated_by} (pod deleted?)"
        elif self.standby and rc != 0 and not self.workers_started(this_node=True) and stop_record(self.layout) is None:
            # A spare that leaves without training never decides the run: the others do.
            failure, message = FailureClass.UNKNOWN, f"spare dropped before it trained: {dropped_spare_reason(rc)}"
        else:
            failure, message = classify(self.cfg, rc, stalled, self.workers_started(), launcher_log_hint())
        return self._final(failure, message, rc)

    def finish_stopped(self, stop: dict) -> int:
        """The run already has a stop (a user error, non-finite state) that no relaunch fixes."""
        failure, message = describe_stop(stop)
        return self._final(failure, f"not launching again: {message} (control/STOP.json); fix it and start "
                                     "a new run", None)

    def _final(self, failure: FailureClass, message: str, rc: int | None) -> int:
        code = exit_code_for(failure)
        latest = CheckpointCatalog(self.layout).latest()
        self.events.emit(Event.FINAL, failure_class=failure.value, exit_code=int(code),
                         launcher_exit_code=rc, step=latest.step if latest else 0,
                         checkpoint_id=latest.checkpoint_id if latest else None, message=message,
                         host=socket.gethostname())
        print(f"[launch] node {self.node_rank}: {failure.value} (exit {int(code)}): {message}", flush=True)
        return int(code)


def clear_storage_stop(layout: RunDir) -> bool:
    """A storage stop from an earlier launch no longer holds once the run dir takes writes again
    (space was freed, the mount fixed): move the marker aside (kept for the record) and go on."""
    stop = read_stop(layout)
    if stop is None or stop.get("failure_class") != FailureClass.STORAGE_ERROR.value:
        return False
    try:
        os.rename(layout.stop_marker, layout.control / f"STOP.cleared.{int(time.time() * 1000)}.json")
    except FileNotFoundError:
        pass  # another node's launcher cleared it
    print(f"[launch] {layout.stop_marker} recorded a storage error; the run dir takes writes again: cleared",
          flush=True)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fsdp_resilience.training.launch",
                                     description="Run one node of a training run under NVRx restarts.")
    parser.add_argument("--config", default=None,
                        help="run config JSON file (src/fsdp_resilience/training/contract/config.py: RunConfig); "
                             f"default: ${CONFIG_ENV}")
    parser.add_argument("--node-rank", type=int, default=None, help="this node's index (default: from env)")
    parser.add_argument("--rdzv-host", default=None, help="rendezvous host: node 0's address (default: from env)")
    parser.add_argument("--dry-run", action="store_true", help="print the launcher command and exit")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config)
        node_rank = node_rank_from_env(args.node_rank)
        if not 0 <= node_rank < cfg.node_rank_limit:
            spares = f" + {cfg.spare_nodes} spare(s) and the indices of spares added later" if cfg.spare_nodes else ""
            raise ConfigError(f"node rank {node_rank} is outside the run's {cfg.nodes} node(s){spares}: "
                              f"use 0..{cfg.node_rank_limit - 1}")
        rdzv_host = rdzv_host_from_env(args.rdzv_host, cfg)
        read_dataset_index(cfg.dataset_dir)  # a missing or broken dataset fails here, not in every rank
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return int(ExitCode.CONFIG_ERROR)
    launcher = NodeLauncher(cfg, node_rank, rdzv_host)
    layout = cfg.layout
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
        print(f"error: the run dir cannot take writes: {e.filename or layout.root}: {e.strerror or e}; "
              f"{STORAGE_ADVICE}", file=sys.stderr)
        return int(ExitCode.STORAGE_ERROR)
    if args.dry_run:
        print(shlex.join(command))
        return 0
    return launcher.run(command)


if __name__ == "__main__":
    sys.exit(main())
