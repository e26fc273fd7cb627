"""Where a node's launcher gets its run config, its node rank and the rendezvous host: the flags,
else the environment (an EKS pod's)."""

from __future__ import annotations

import os

from fsdp_resilience.training.contract import ConfigError, RunConfig

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
    raise ConfigError(
        "a multi-node run needs the rendezvous host: pass --rdzv-host or set TRAINING_RDZV_HOST "
        "(on EKS: the headless Service name of the pod with completion index 0)"
    )
