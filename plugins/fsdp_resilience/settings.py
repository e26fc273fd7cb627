"""Where things live for the control plane, from the environment of the Airflow processes.

  FSDP_RUNS_ROOT      run dirs (FSx for Lustre mounted in workers and triggerer on EKS);
                      default <repo>/runs
  FSDP_DATA_ROOT      staged datasets; default <runs root>/data
  FSDP_LOCAL_SLOTS    "nodes" of the local backend; default 4
  TRAINING_PYTHON     the training venv's python (local backend); default <repo>/.venv/bin/python

The EKS backend (``backend_config("eks")``; see README "Run on EKS"):
  FSDP_EKS_IMAGE                 the training image (the DAG's `image` param overrides it)
  FSDP_EKS_NAMESPACE             where jobs run; default fsdp-training (the `namespace` param overrides)
  FSDP_EKS_CLUSTER_NAME          set: kubeconfig from EksHook + the AWS connection; unset: the
                                 Kubernetes connection (in-cluster or its kubeconfig)
  FSDP_KUBERNETES_CONN_ID        default kubernetes_default
  FSDP_AWS_CONN_ID               default aws_default;  FSDP_AWS_REGION: the region (default: the connection's)
  FSDP_EKS_REPLACEMENT           asg (default) | karpenter | cordon
  FSDP_EKS_MAX_UNHEALTHY_SHARE   default 0.2: never replace more of the pool at once
  FSDP_EKS_POOL_SELECTOR         JSON labels of the GPU node pool; default: the pods' nodeSelector
  FSDP_EKS_POD                   JSON pod settings (backends/eks_manifests.py PodTemplateSettings), e.g.
                                 {"gpus_per_node": 8, "efa_per_node": 32, "node_selector": {...}}
  FSDP_FSX_MOUNT_PATH            where FSx is mounted, in the pods and the Airflow workers; default /fsx
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def runs_root() -> Path:
    return Path(os.environ.get("FSDP_RUNS_ROOT", REPO / "runs")).resolve()


def data_root() -> Path:
    return Path(os.environ.get("FSDP_DATA_ROOT", runs_root() / "data")).resolve()


def training_python() -> str:
    return os.environ.get("TRAINING_PYTHON", str(REPO / ".venv" / "bin" / "python"))


def backend_config(name: str, **overrides: Any) -> dict[str, Any]:
    """The kwargs of ``fsdp_resilience.backends.get_backend`` for a backend name: JSON-safe, so
    they travel in XCom and trigger kwargs and any process can rebuild the same backend."""
    if name == "local":
        config = {"name": "local", "state_dir": str(runs_root() / ".local-backend"),
                  "slots": int(os.environ.get("FSDP_LOCAL_SLOTS", "4")), "training_python": training_python()}
    elif name == "eks":
        config = eks_backend_config()
    else:
        config = {"name": name}
    config.update(overrides)
    return config


def _json_env(var: str) -> Any:
    text = os.environ.get(var, "").strip()
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError as e:
        raise ValueError(f"{var} is not valid JSON ({e}): {text[:200]}") from None


def eks_backend_config() -> dict[str, Any]:
    env = os.environ.get
    pod = dict(_json_env("FSDP_EKS_POD") or {})
    if env("FSDP_FSX_MOUNT_PATH"):
        pod.setdefault("fsx_mount_path", env("FSDP_FSX_MOUNT_PATH"))
    config: dict[str, Any] = {
        "name": "eks", "image": env("FSDP_EKS_IMAGE", ""), "namespace": env("FSDP_EKS_NAMESPACE", "fsdp-training"),
        "kubernetes_conn_id": env("FSDP_KUBERNETES_CONN_ID", "kubernetes_default"),
        "cluster_name": env("FSDP_EKS_CLUSTER_NAME") or None, "aws_conn_id": env("FSDP_AWS_CONN_ID", "aws_default"),
        "region_name": env("FSDP_AWS_REGION") or None, "replacement": env("FSDP_EKS_REPLACEMENT", "asg"),
        "max_unhealthy_share": float(env("FSDP_EKS_MAX_UNHEALTHY_SHARE", "0.2")), "pod": pod}
    pool = _json_env("FSDP_EKS_POOL_SELECTOR")
    if pool is not None:
        config["pool_selector"] = pool
    return config
