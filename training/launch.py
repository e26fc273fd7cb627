"""The one command a training pod (or a local process group) runs:

    python -m training.launch --config RUN.json [--node-rank N] [--rdzv-host HOST] [--dry-run]

It validates the run, builds the NVRx launcher command for this node, runs it in its own process
session, watches it, and exits with the run contract's exit code after writing a ``final`` event:

  restart_mode  launcher                                   what restarts what
  layered       ft_launcher + inprocess.Wrapper in workers exceptions/hangs in-process; dead,
                                                           frozen or silent ranks by ft_launcher
  injob         ft_launcher                                any rank failure -> worker group respawn
  inprocess     torchrun --max-restarts 0 + Wrapper        exceptions/hangs in-process only
  none          torchrun --max-restarts 0                  nothing

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
import dataclasses
import importlib.util
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from training.contract import (
    CheckpointCatalog,
    ConfigError,
    Event,
    EventLog,
    ExitCode,
    FailureClass,
    RunConfig,
    atomic_write_text,
    exit_code_for,
    read_dataset_index,
)
from training.faults import LAUNCH_PID_ENV

#: A node's launcher waits this long after the user-error marker appears for ft_launcher to stop
#: by itself (the failing rank asked it to) before stopping it.
USER_ERROR_GRACE_S = 20.0
POLL_S = 1.0


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

    Workers report heartbeats and sections (training/restart.py: RankMonitor): ``setup``
    (process group, model, restore) may take as long as the first heartbeat; ``step`` and
    ``checkpoint`` (the blocking part of a save) as long as a heartbeat.

    Where NVRx tracks progress (0.7: exit 93 after restart cycles that commit nothing new), it
    reads the newest committed step from ``RunDir.latest_step``.
    """
    section = {
        "initial_rank_heartbeat_timeout": cfg.initial_heartbeat_timeout_s,
        "rank_heartbeat_timeout": cfg.heartbeat_timeout_s,
        "rank_section_timeouts": {
            "setup": cfg.initial_heartbeat_timeout_s,
            "step": cfg.heartbeat_timeout_s,
            "checkpoint": cfg.heartbeat_timeout_s,
        },
        "rank_out_of_section_timeout": cfg.initial_heartbeat_timeout_s,
        "workload_check_interval": 1.0,
        "node_health_check_interval": 5.0,
        "safety_factor": 5.0,
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
        raise ConfigError(f"ft_launcher would not read {path} as written: {e}. This is a bug of training.launch "
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


def build_command(cfg: RunConfig, node_rank: int, rdzv_host: str, ft_cfg_path: Path,
                  log_dir: Path) -> list[str]:
    """The launcher command for this node."""
    rdzv = [
        f"--nnodes={cfg.nodes}",
        f"--nproc-per-node={cfg.procs_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={rdzv_host}:{cfg.rdzv_port}",
        f"--rdzv-id={cfg.run_id}",
        # Node 0 hosts the rendezvous store; saying so avoids guessing from host names, which
        # fails when several "nodes" share one machine (the local backend).
        f"--rdzv-conf=is_host={'true' if node_rank == 0 else 'false'},join_timeout=600{_libuv_conf()}",
        "--monitor-interval=0.5",
    ]
    worker = ["-m", "training.train", "--config", str(Path(cfg.run_dir) / "run.json")]
    bindir = Path(sys.executable).parent
    if cfg.restart_mode in ("layered", "injob"):
        return [str(bindir / "ft_launcher"), f"--ft-cfg-path={ft_cfg_path}",
                # 0.4.1 ignores enable_nic_monitor in YAML; both versions accept the flag.
                "--ft-enable-nic-monitor=false",
                f"--max-restarts={cfg.max_restarts}", *rdzv, *worker]
    return [sys.executable, "-m", "torch.distributed.run", "--max-restarts=0", *rdzv, *worker]


def classify(cfg: RunConfig, rc: int, stalled: bool) -> tuple[FailureClass, str]:
    """What the launcher's exit means, in the run contract's terms."""
    layout = cfg.layout
    if layout.user_error_marker.exists():
        info = json.loads(layout.user_error_marker.read_text() or "{}")
        return FailureClass.USER_ERROR, f"user error at step {info.get('step')}: {info.get('error')}"
    if stalled:
        return FailureClass.NO_PROGRESS, f"no new committed checkpoint for {cfg.stall_timeout_s:.0f}s"
    if rc == ExitCode.NO_PROGRESS:
        latest = CheckpointCatalog(layout).latest()
        return FailureClass.NO_PROGRESS, ("ft_launcher stopped restarting: its last restart cycles committed no "
                                          f"checkpoint past step {latest.step if latest else 0}")
    latest = CheckpointCatalog(layout).latest()
    if rc == 0:
        if latest is not None and latest.step >= cfg.steps:
            return FailureClass.SUCCESS, f"trained {cfg.steps} steps; final checkpoint {latest.checkpoint_id}"
        return FailureClass.UNKNOWN, "the launcher exited 0 before the final checkpoint was committed"
    if rc < 0:
        return FailureClass.UNKNOWN, f"the launcher was killed by signal {-rc}"
    if cfg.restart_mode in ("layered", "injob"):
        return FailureClass.RESTARTS_EXHAUSTED, f"ft_launcher gave up after max_restarts={cfg.max_restarts} (exit {rc})"
    return FailureClass.RESTARTS_EXHAUSTED, f"a rank failed and restart_mode={cfg.restart_mode} has no in-job restarts (exit {rc})"


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
        # Kubernetes deletes a pod with SIGTERM: pass it on to the whole session, then exit.
        self.terminated_by = signum
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)

    def run(self, command: list[str]) -> int:
        cfg = self.cfg
        self.events.emit(Event.LAUNCH_BEGIN, nodes=cfg.nodes, procs_per_node=cfg.procs_per_node,
                         restart_mode=cfg.restart_mode, rdzv_host=self.rdzv_host,
                         command=shlex.join(command))
        env = dict(os.environ)
        env[LAUNCH_PID_ENV] = str(os.getpid())
        env.setdefault("PYTHONUNBUFFERED", "1")
        if self.cfg.nodes > 1 and self.rdzv_host in ("127.0.0.1", "localhost", "::1"):
            # Several "nodes" on one host (the local backend): NVRx 0.7's rendezvous otherwise
            # refuses the second launcher as a duplicate participant.
            env.setdefault("NVRX_ENABLE_MULTI_LAUNCHERS_PER_NODE", "1")
        # The worker imports the ``training`` package from wherever this one came from.
        pkg_root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH", "")) if p)
        signal.signal(signal.SIGTERM, self._forward_signal)
        signal.signal(signal.SIGINT, self._forward_signal)
        # Own session: ft_launcher, its workers and NVRx's checkpoint/monitor helpers share one
        # process group, so nothing is orphaned when we clean up.
        self.proc = subprocess.Popen(command, env=env, start_new_session=True)
        stalled = False
        user_error_seen: float | None = None
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
            if self.layout.user_error_marker.exists():
                user_error_seen = user_error_seen or time.time()
                if time.time() - user_error_seen > USER_ERROR_GRACE_S:
                    self._stop("user error")
        rc = self.proc.returncode
        self._reap()
        return self.finish(rc, stalled)

    def _stop(self, why: str) -> None:
        print(f"[launch] stopping the launcher: {why}", flush=True)
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _reap(self) -> None:
        """Kill whatever the launcher left behind in its session (NVRx helpers can outlive it)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def finish(self, rc: int, stalled: bool) -> int:
        if self.terminated_by is not None:
            failure, message = FailureClass.UNKNOWN, f"terminated by signal {self.terminated_by} (pod deleted?)"
        else:
            failure, message = classify(self.cfg, rc, stalled)
        code = exit_code_for(failure)
        latest = CheckpointCatalog(self.layout).latest()
        self.events.emit(Event.FINAL, failure_class=failure.value, exit_code=int(code),
                         launcher_exit_code=rc, step=latest.step if latest else 0,
                         checkpoint_id=latest.checkpoint_id if latest else None, message=message,
                         host=socket.gethostname())
        print(f"[launch] node {self.node_rank}: {failure.value} (exit {int(code)}): {message}", flush=True)
        return int(code)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.launch",
                                     description="Run one node of a training run under NVRx restarts.")
    parser.add_argument("--config", default=None,
                        help=f"run config JSON file (training/contract.py: RunConfig); default: ${CONFIG_ENV}")
    parser.add_argument("--node-rank", type=int, default=None, help="this node's index (default: from env)")
    parser.add_argument("--rdzv-host", default=None, help="rendezvous host: node 0's address (default: from env)")
    parser.add_argument("--dry-run", action="store_true", help="print the launcher command and exit")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config)
        node_rank = node_rank_from_env(args.node_rank)
        if not 0 <= node_rank < cfg.nodes:
            raise ConfigError(f"node rank {node_rank} is outside the run's {cfg.nodes} node(s)")
        rdzv_host = rdzv_host_from_env(args.rdzv_host, cfg)
        read_dataset_index(cfg.dataset_dir)  # a missing or broken dataset fails here, not in every rank
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return int(ExitCode.CONFIG_ERROR)
    launcher = NodeLauncher(cfg, node_rank, rdzv_host)
    try:
        command = launcher.prepare()
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return int(ExitCode.CONFIG_ERROR)
    if args.dry_run:
        print(shlex.join(command))
        return 0
    if cfg.layout.user_error_marker.exists():
        return launcher.finish(rc=1, stalled=False)
    return launcher.run(command)


if __name__ == "__main__":
    sys.exit(main())
