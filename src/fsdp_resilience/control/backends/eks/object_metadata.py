"""The metadata every object of the EKS backend carries: its labels (``label_value`` makes any id
a valid label value), the annotations that keep the exact ids, and the owner reference that ties a
launch's Service and NetworkPolicy to its Job. Pure functions, like manifests.py.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from fsdp_resilience.control.backends.eks.constants import (
    ANNOTATION_AIRFLOW_RUN,
    ANNOTATION_LAUNCH,
    LABEL_AIRFLOW_RUN,
    LABEL_COMPONENT,
    LABEL_LAUNCH,
    LABEL_RUN,
    LABEL_VALUE_FORMAT,
    LABEL_VALUE_MAX,
    MANAGED_BY,
)
from fsdp_resilience.training.contract import RunConfig

_LABEL_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")
_LABEL_EDGE = re.compile(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$")
_HASH_LEN = 8


def label_value(text: str) -> str:
    """``text`` as a valid label value: unchanged if it already is one, else cleaned and cut to fit,
    with a short hash of the exact text appended (so two ids that clean up alike stay distinct).

    ``manual__2026-11-30T07:35:43.123456+00:00`` -> ``manual__2026-11-30T07-35-43.123456-00-00-<hash>``.
    """
    if not isinstance(text, str):
        raise TypeError(f"label_value needs a string, got {type(text).__name__}")
    if text and len(text) <= LABEL_VALUE_MAX and LABEL_VALUE_FORMAT.match(text):
        return text
    digest = hashlib.sha256(text.encode()).hexdigest()[:_HASH_LEN]
    readable = _LABEL_UNSAFE.sub("-", text)[: LABEL_VALUE_MAX - _HASH_LEN - 1]
    readable = _LABEL_EDGE.sub("", readable)
    return f"{readable}-{digest}" if readable else digest


def object_labels(cfg: RunConfig, component: str, launch_id: str | None, airflow_run_id: str | None) -> dict[str, str]:
    labels = {**MANAGED_BY, LABEL_COMPONENT: component, LABEL_RUN: cfg.run_id}
    if launch_id is not None:
        labels[LABEL_LAUNCH] = label_value(launch_id)
    if airflow_run_id is not None:
        labels[LABEL_AIRFLOW_RUN] = label_value(airflow_run_id)
    return labels


def object_annotations(launch_id: str | None, airflow_run_id: str | None) -> dict[str, str]:
    annotations = {}
    if launch_id is not None:
        annotations[ANNOTATION_LAUNCH] = launch_id
    if airflow_run_id is not None:
        annotations[ANNOTATION_AIRFLOW_RUN] = airflow_run_id
    return annotations


def object_metadata(name: str, namespace: str, labels: dict[str, str], annotations: dict[str, str]) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": labels}
    if annotations:
        meta["annotations"] = annotations
    return meta


def check_ids(launch_id: Any, airflow_run_id: Any) -> None:
    if not isinstance(launch_id, str) or not launch_id.strip() or len(launch_id) > 200:
        raise ValueError(f"launch_id={launch_id!r} must be a non-empty string of at most 200 characters")
    if airflow_run_id is not None and (not isinstance(airflow_run_id, str) or not airflow_run_id):
        raise ValueError(f"airflow_run_id={airflow_run_id!r} must be the DAG run's id, or None")


def owner_reference(owner: Any, job_name: str) -> dict[str, Any]:
    # A dict (the API's JSON) or the client's V1Job model: both have metadata.name and .uid.
    meta = owner.get("metadata") if isinstance(owner, dict) else getattr(owner, "metadata", None)
    if isinstance(meta, dict):
        name, uid = meta.get("name"), meta.get("uid")
    else:
        name, uid = getattr(meta, "name", None), getattr(meta, "uid", None)
    if not name or not uid:
        raise ValueError(
            f"owner must be the created Job as the API returned it (with metadata.name and metadata.uid), got {owner!r}"
        )
    if name != job_name:
        raise ValueError(
            f"owner is Job {name!r}, but this launch's Job is {job_name!r}: pass the Job that "
            "create_namespaced_job returned for the same run and launch"
        )
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "name": name,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": False,
    }
