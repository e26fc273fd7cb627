"""The launcher command for one node: ft_launcher (restart modes layered, injob) or torchrun
(inprocess, none), and the ``fault_tolerance:`` YAML ft_launcher reads, checked with NVRx's own
parser. Feature-detects the installed NVRx (0.4.1 or 0.6+) where the two differ."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import re
import sys
from pathlib import Path

from fsdp_resilience.training.contract import ConfigError, RunConfig, atomic_write_text
from fsdp_resilience.training.launch.worker_zygote import worker_command


def nvrx_fault_tolerance_config() -> type:
    """The installed NVRx's ``FaultToleranceConfig`` class: what ft_launcher parses its YAML into.

    Loaded from its own file: importing the ``fault_tolerance`` package would import torch, and
    this module starts in milliseconds. The file needs only the standard library and yaml."""
    spec = importlib.util.find_spec("nvidia_resiliency_ext")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "nvidia-resiliency-ext is not installed in this environment: install the training "
            "requirements (pip install -e '.[training]')"
        )
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

    Workers report heartbeats and sections (src/fsdp_resilience/training/restart/rank_monitor.py:
    RankMonitor). The timeouts here are the configured ones (``RunConfig.section_timeouts``):
    ``setup`` (process group, model, restore) and ``final_checkpoint`` may take as long as the first
    heartbeat; ``step`` and ``checkpoint`` (the blocking part of a save) as long as a heartbeat.
    They hold until the workers have run their warm steps and two saves; then they derive tighter
    heartbeat, ``step`` and ``checkpoint`` timeouts from what they measured, ``safety_factor`` x the
    longest interval (``RestartTimeouts.derive``), and send them to their rank monitors.

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
        raise ConfigError(
            f"ft_launcher would not read {path} as written: {e}. This is a bug of "
            "fsdp_resilience.training.launch with this nvidia-resiliency-ext version; report it with "
            "the file"
        ) from None
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


#: ft_launcher, run by this interpreter: what its console script does, without needing the script.
#: In the NGC image the interpreter is /usr/bin/python and pip puts console scripts in
#: /usr/local/bin, so "next to sys.executable" finds nothing, and a PATH lookup may find another
#: environment's. ``python -m`` of the module is no better: NVRx's rendezvous imports the launcher
#: module again under its own name, and its ``except UnhealthyNodeException`` would then miss the
#: other copy's class. ``argv[0]`` is named as the script would be (``ps`` shows ``ft_launcher``).
FT_LAUNCHER = [
    sys.executable,
    "-c",
    "import sys; sys.argv[0] = 'ft_launcher'; "
    "from nvidia_resiliency_ext.fault_tolerance.launcher import main; sys.exit(main())",
]


def build_command(cfg: RunConfig, node_rank: int, rdzv_host: str, ft_cfg_path: Path, log_dir: Path) -> list[str]:
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
    trainer_args = ["--config", str(Path(cfg.run_dir) / "run.json")]
    worker = ["-m", "fsdp_resilience.training.train", *trainer_args]
    if cfg.restart_mode in ("layered", "injob"):
        # Each rank, at every in-job restart, is forked from the node's zygote (torch and NVRx
        # imported once) by the client script; without a zygote it runs the trainer as above.
        worker = worker_command(trainer_args)
        checks = []
        if cfg.spare_nodes and nvrx_version() >= (0, 6):
            # NVRx 0.7 checks a node at every join of its rendezvous, a spare's included: here
            # also that the run's shared storage is there, so a spare whose mount is gone is
            # turned away (its launcher exits, saying why) instead of taking a rank.
            checks = [f"--ft-storage-health-check-path={Path(cfg.run_dir).absolute() / 'checkpoints'}"]
        return [
            *FT_LAUNCHER,
            f"--ft-cfg-path={ft_cfg_path}",
            # 0.4.1 ignores enable_nic_monitor in YAML; both versions accept the flag.
            "--ft-enable-nic-monitor=false",
            *checks,
            f"--max-restarts={cfg.max_restarts}",
            *rdzv,
            *worker,
        ]
    return [sys.executable, "-m", "torch.distributed.run", "--max-restarts=0", *rdzv, *worker]


def write_ft_launcher_config(cfg: RunConfig, path: Path) -> None:
    """Write ft_launcher's YAML for the installed NVRx to ``path``, and read it back the way
    ft_launcher will (``check_ft_launcher_config``)."""
    config_class = nvrx_fault_tolerance_config()
    section = ft_launcher_config(cfg, {f.name for f in dataclasses.fields(config_class)})
    # JSON is YAML: written without a yaml library, read back with NVRx's own parser.
    atomic_write_text(path, json.dumps(section, indent=2) + "\n")
    check_ft_launcher_config(path, section, config_class)
