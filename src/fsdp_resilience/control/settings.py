"""Where things live for the control plane, from the environment of the Airflow processes.

  FSDP_RUNS_ROOT      run dirs (FSx for Lustre mounted in workers and triggerer on EKS);
                      default <repo>/runs
  FSDP_DATA_ROOT      staged datasets; default <runs root>/data
  FSDP_LOCAL_SLOTS    "nodes" of the local backend; default 4
  TRAINING_PYTHON     the training venv's python (local backend); default <repo>/.venv/bin/python
  FSDP_SOURCE_ROOT    folders stage_dataset may read text from (local backend); default <runs root>/sources
  FSDP_DEFAULT_BACKEND  the backend a DAG run uses when its `backend` param is empty: local (default)
                      or eks (deploy/helm/airflow-values.yaml sets eks: the Airflow image has no
                      training environment)
  FSDP_QUARANTINE_COOLDOWN_S  unset or 0 (default): a quarantined node stays out of service until a
                      person returns it; N > 0: the node_maintenance DAG returns nodes quarantined for
                      longer than N seconds, recording why
  FSDP_REPORT_DAG_IDS comma-separated DAGs whose runs have a Training report tab in the UI;
                      default fsdp_training (a copy of the DAG under another id: add it)

The EKS backend (``backend_config("eks")``; see docs/run-on-eks.md):
  FSDP_EKS_IMAGE                 the training image (the DAG's `image` param overrides it)
  FSDP_EKS_IMAGE_ALLOWLIST       comma-separated registry/repository prefixes an image must be under
                                 (whole path components: ".../fsdp-training" allows ".../fsdp-training:1"
                                 and "...@sha256:...", never ".../fsdp-training-evil"); default: the
                                 repository of FSDP_EKS_IMAGE. The `image` param is refused in
                                 validate_config outside it, and the backend refuses it again at submit
  FSDP_EKS_NAMESPACE             where jobs run; default fsdp-training
  FSDP_EKS_NAMESPACES            comma-separated namespaces the `namespace` param may pick (each needs
                                 the kit's Role and claim); default: FSDP_EKS_NAMESPACE alone
  FSDP_EKS_CLUSTER_NAME          set: kubeconfig from EksHook + the AWS connection; unset: the
                                 Kubernetes connection (in-cluster or its kubeconfig)
  FSDP_KUBERNETES_CONN_ID        default kubernetes_default
  FSDP_AWS_CONN_ID               default aws_default;  FSDP_AWS_REGION: the region (default: the connection's)
  FSDP_EKS_REPLACEMENT           asg (default) | karpenter | cordon
  FSDP_EKS_MAX_UNHEALTHY_SHARE   default 0.2: never replace more of the pool at once
  FSDP_EKS_POOL_SELECTOR         JSON labels of the GPU node pool; default: the pods' nodeSelector
  FSDP_EKS_POD                   JSON pod settings (backends/eks/pod_settings.py PodTemplateSettings); the
                                 defaults fit p5.48xlarge (instance_type, 8 GPUs, 32 EFA, cpu 180,
                                 memory 1800Gi, QoS Guaranteed), e.g. for p4d.24xlarge
                                 {"instance_type": "p4d.24xlarge", "efa_per_node": 4, "cpu": "90",
                                  "memory": "1000Gi", "eval_cpu": "11", "eval_memory": "120Gi"}
  FSDP_FSX_MOUNT_PATH            where FSx is mounted, in the pods and the Airflow workers; default /fsx
  FSDP_FSX_FILE_SYSTEM_ID        the FSx for Lustre file system (fs-...): staging and export tasks
  FSDP_CHECKPOINTS_S3            optional s3://bucket/prefix that the runs root is exported to (the FSx
                                 data repository association): the watch reads checkpoint progress
                                 there, for a triggerer that does not mount FSx, and the run
                                 report in the UI reads events there for an API server without it
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]  # src/fsdp_resilience/control/<this> -> the checkout


def runs_root() -> Path:
    return Path(os.environ.get("FSDP_RUNS_ROOT", REPO / "runs")).resolve()


def report_dag_ids() -> set[str]:
    """The DAGs whose runs have a run report in the UI (``FSDP_REPORT_DAG_IDS``)."""
    return {d.strip() for d in os.environ.get("FSDP_REPORT_DAG_IDS", "fsdp_training").split(",") if d.strip()}


def data_root() -> Path:
    return Path(os.environ.get("FSDP_DATA_ROOT", runs_root() / "data")).resolve()


def source_root() -> Path:
    return Path(os.environ.get("FSDP_SOURCE_ROOT", runs_root() / "sources")).resolve()


#: The backends a DAG run may pick.
BACKENDS = ("local", "eks")


def default_backend() -> str:
    """FSDP_DEFAULT_BACKEND: the backend of a DAG run whose `backend` param is empty."""
    name = os.environ.get("FSDP_DEFAULT_BACKEND", "").strip() or "local"
    if name not in BACKENDS:
        raise ValueError(f"FSDP_DEFAULT_BACKEND={name!r} is not a backend; use one of {', '.join(BACKENDS)}")
    return name


def backend_name(requested: str | None = None) -> str:
    """The backend a run or command uses: ``requested`` (a DAG param, a CLI flag), else
    FSDP_DEFAULT_BACKEND. ValueError for a name that is not a backend."""
    name = requested or default_backend()
    if name not in BACKENDS:
        raise ValueError(f"backend={name!r} is not a backend; use one of {', '.join(BACKENDS)}")
    return name


def quarantine_cooldown_s() -> float:
    """FSDP_QUARANTINE_COOLDOWN_S: after how long a quarantined node returns to service by itself
    (0: never; the default)."""
    text = os.environ.get("FSDP_QUARANTINE_COOLDOWN_S", "").strip() or "0"
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"FSDP_QUARANTINE_COOLDOWN_S={text!r} is not a number of seconds") from None
    if value < 0:
        raise ValueError(f"FSDP_QUARANTINE_COOLDOWN_S={text!r} must be 0 (off) or a positive number of seconds")
    return value


def under_root(root: Path, *parts: str, what: str) -> Path:
    """``root / parts``, resolved (symlinks followed), refused unless it stays inside ``root``:
    a user's name for a dataset or run can never pick a path elsewhere, by ``..``, by an absolute
    path, or by a symlink placed under the root. Raises ValueError naming ``what``."""
    root = root.resolve()
    path = root.joinpath(*parts)
    resolved = path.resolve()
    if root not in resolved.parents:
        raise ValueError(
            f"{what} {'/'.join(parts)!r} resolves to {resolved}, outside its root {root}: "
            "give a name of a folder under the root (no '..', no absolute path, no symlink out)"
        )
    return resolved


def training_python() -> str:
    return os.environ.get("TRAINING_PYTHON", str(REPO / ".venv" / "bin" / "python"))


def backend_config(name: str, **overrides: Any) -> dict[str, Any]:
    """The kwargs of ``fsdp_resilience.control.backends.get_backend`` for a backend name: JSON-safe, so
    they travel in XCom and trigger kwargs and any process can rebuild the same backend."""
    if name == "local":
        config = {
            "name": "local",
            "state_dir": str(runs_root() / ".local-backend"),
            "slots": int(os.environ.get("FSDP_LOCAL_SLOTS", "4")),
            "training_python": training_python(),
        }
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


def fsx_mount_path() -> Path:
    """Where FSx for Lustre is mounted in the Airflow workers and triggerer (and the pods)."""
    return Path(os.environ.get("FSDP_FSX_MOUNT_PATH") or "/fsx")


def aws_conn_id() -> str:
    """The Airflow AWS connection for FSx, S3, EKS and Auto Scaling calls."""
    return os.environ.get("FSDP_AWS_CONN_ID") or "aws_default"


def checkpoints_s3_uri(run_dir: str) -> str | None:
    """The S3 export of a run dir (FSDP_CHECKPOINTS_S3 + its path under the runs root), or None."""
    base = os.environ.get("FSDP_CHECKPOINTS_S3", "").strip().rstrip("/")
    if not base:
        return None
    try:
        relative = Path(run_dir).resolve().relative_to(runs_root())
    except ValueError:
        raise ValueError(
            f"run dir {run_dir} is not under FSDP_RUNS_ROOT={runs_root()}, so its S3 export under "
            f"FSDP_CHECKPOINTS_S3={base} is unknown"
        ) from None
    return f"{base}/{relative.as_posix()}"


def image_allowlist() -> list[str]:
    """FSDP_EKS_IMAGE_ALLOWLIST as a list of prefixes (raises ValueError naming a bad entry); unset:
    the repository of FSDP_EKS_IMAGE (its reference without :tag and @digest); neither: empty,
    and no image is allowed."""
    from fsdp_resilience.control.backends.eks import check_image_prefix, image_repository

    text = os.environ.get("FSDP_EKS_IMAGE_ALLOWLIST", "").strip()
    if text:
        return [check_image_prefix(p) for p in text.split(",") if p.strip()]
    image = os.environ.get("FSDP_EKS_IMAGE", "").strip()
    if not image:
        return []
    try:
        return [image_repository(image)]
    except ValueError as e:
        raise ValueError(f"FSDP_EKS_IMAGE: {e}") from None


def allowed_namespaces() -> list[str]:
    """The namespaces a DAG run's `namespace` param may pick: FSDP_EKS_NAMESPACES, else the
    deployment's FSDP_EKS_NAMESPACE alone."""
    text = os.environ.get("FSDP_EKS_NAMESPACES", "").strip()
    names = [n.strip() for n in text.split(",") if n.strip()]
    return names or [os.environ.get("FSDP_EKS_NAMESPACE", "fsdp-training")]


def eks_backend_config() -> dict[str, Any]:
    env = os.environ.get
    pod = dict(_json_env("FSDP_EKS_POD") or {})
    if env("FSDP_FSX_MOUNT_PATH"):
        pod.setdefault("fsx_mount_path", str(fsx_mount_path()))
    config: dict[str, Any] = {
        "name": "eks",
        "image": env("FSDP_EKS_IMAGE", ""),
        "namespace": env("FSDP_EKS_NAMESPACE", "fsdp-training"),
        "kubernetes_conn_id": env("FSDP_KUBERNETES_CONN_ID", "kubernetes_default"),
        "cluster_name": env("FSDP_EKS_CLUSTER_NAME") or None,
        "aws_conn_id": aws_conn_id(),
        "region_name": env("FSDP_AWS_REGION") or None,
        "replacement": env("FSDP_EKS_REPLACEMENT", "asg"),
        "max_unhealthy_share": float(env("FSDP_EKS_MAX_UNHEALTHY_SHARE", "0.2")),
        "pod": pod,
        "image_allowlist": image_allowlist(),
    }
    pool = _json_env("FSDP_EKS_POOL_SELECTOR")
    if pool is not None:
        config["pool_selector"] = pool
    return config
