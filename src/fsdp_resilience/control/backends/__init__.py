"""Training backends: one interface (``TrainingBackend``), one implementation per platform.

    from fsdp_resilience.control.backends import get_backend
    backend = get_backend("local", state_dir="/var/lib/fsdp/local")   # later: get_backend("eks", ...)
    handle = backend.submit(cfg, launch_id="try-1")
    backend.status(handle).state   # pending | running | succeeded | failed

Implementations are imported on first use (``LocalProcessBackend`` below too), so importing this
package costs nothing and needs no platform client.
"""

from __future__ import annotations

from typing import Any

from fsdp_resilience.control.backends.base import (
    LOST,
    BackendError,
    Capacity,
    Diagnosis,
    InsufficientCapacityError,
    JobConflictError,
    JobHandle,
    JobNotFoundError,
    JobStatus,
    NodeStatus,
    Replacement,
    TrainingBackend,
    available_backends,
    get_backend,
    job_name_for,
    register_backend,
)
from fsdp_resilience.control.backends.replacement import DEFAULT_MAX_UNHEALTHY_SHARE

__all__ = [
    "DEFAULT_MAX_UNHEALTHY_SHARE",
    "LOST",
    "BackendError",
    "Capacity",
    "Diagnosis",
    "InsufficientCapacityError",
    "JobConflictError",
    "JobHandle",
    "JobNotFoundError",
    "JobStatus",
    "LocalProcessBackend",
    "NodeStatus",
    "Replacement",
    "TrainingBackend",
    "available_backends",
    "get_backend",
    "job_name_for",
    "register_backend",
]


def __getattr__(name: str) -> Any:
    if name == "LocalProcessBackend":
        from .local import LocalProcessBackend

        return LocalProcessBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
