"""NVRx's node health checks, as evidence against a node: where a failed check surfaces, which
check it was, and its ``health_check_failed`` record in the events log. Torch-free (the launcher
imports it too).

Where each NVRx version checks a node, read from the two wheels' sources:

- ft_launcher's rendezvous, at every join: a GPU check on 0.4.1 and 0.7 (``UnhealthyNodeException``
  "Node X has an unhealthy GPU."); on 0.6+ also NIC link state and storage (Lustre, and the
  paths of ``--ft-storage-health-check-path``) when enabled, and an external node-health
  service. The launcher logs the refusal and exits 1; the node's launcher finds the line in
  its log (``launcher_refusal``).
- the in-process Wrapper, before a restart: on 0.6+ it chains NVML GPU, NVLink and NIC checks
  into ``restart_health_check`` (``wrapper.restart_health_checks_wanted``); a failure raises
  ``HealthCheckError`` and ends the rank's process (``failed_health_check`` finds it in the
  exception's chain). 0.4.1 runs no check there: only a Wrapper ``health_check`` of our own would,
  and we pass none, so on 0.4.1 this path never records anything.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

from fsdp_resilience.training.contract import Event, EventLog

#: Where a check ran (``health_check_failed``'s ``source``).
WRAPPER = "inprocess_wrapper"
LAUNCHER = "ft_launcher"

#: Phrases of NVRx's messages -> the check (``contract.HEALTH_CHECKS``). Phrases, not words: the
#: messages name the node too, and a node's name may hold "gpu".
_CHECK_PHRASES = (
    ("nvl health", "nvlink"),
    ("nvlink", "nvlink"),
    ("nic health", "nic"),
    ("nic link", "nic"),
    ("unhealthy nic", "nic"),
    ("gpu health", "gpu"),
    ("unhealthy gpu", "gpu"),
    ("storage", "storage"),
    ("unreadable paths", "storage"),
)
#: ft_launcher's refusals (``UnhealthyNodeException``): what its log line holds. Not a bare
#: "health check failed": the Wrapper's own log lines (a rank's, in the same log locally) say
#: that too, and are recorded by the rank.
_REFUSAL_MARKS = ("unhealthynodeexception", "health check failed for node")


def check_named_in(message: str) -> str:
    """The check an NVRx message names; ``node`` when it names none (an external node-health
    service, a rank's request to exclude its node)."""
    text = message.lower()
    return next((check for phrase, check in _CHECK_PHRASES if phrase in text), "node")


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and what it came from. NVRx's Wrapper re-raises its last exception ``from None``,
    which hides the cause from a traceback but keeps it as ``__context__``: follow both."""
    seen: list[BaseException] = []
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or any(e is s for s in seen) or len(seen) > 20:
            continue
        seen.append(e)
        todo += [e.__context__, e.__cause__]
    return seen


def failed_health_check(exc: BaseException) -> tuple[str, str] | None:
    """(check, message) when ``exc`` ended a rank because an NVRx restart health check failed, else
    None. Matched by the class NVRx raises (``nvidia_resiliency_ext.inprocess.exception.
    HealthCheckError``, in both versions) without importing NVRx. The message is the innermost
    one: the Wrapper wraps the check's own error in a bare ``HealthCheckError``."""
    found = [
        e
        for e in _chain(exc)
        if type(e).__name__ == "HealthCheckError" and type(e).__module__.startswith("nvidia_resiliency_ext")
    ]
    if not found:
        return None
    messages = [str(e) for e in found if str(e)]
    message = messages[-1] if messages else "HealthCheckError (no message)"
    return check_named_in(message), message[:500]


def launcher_refusal(lines: list[str]) -> tuple[str, str] | None:
    """(check, message) when ft_launcher's rendezvous turned this node away for a failed health
    check, from the lines of its log (the last refusal wins), else None. A rank's request to
    exclude its node ("excluded from the training due to an user request") is no health check."""
    for line in reversed(lines):
        low = line.lower()
        if any(mark in low for mark in _REFUSAL_MARKS) and "user request" not in low:
            message = line.strip()
            for mark in ("UnhealthyNodeException: ", "failed for node "):
                if mark in message:
                    message = message.split(mark, 1)[1]
            return check_named_in(message), message[:500]
    return None


def nvrx_version_text() -> str:
    try:
        return importlib.metadata.version("nvidia-resiliency-ext")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def record_health_check(events: EventLog, check: str, source: str, message: str, **context: Any) -> dict[str, Any]:
    """Put a failed health check in the events log: ``node_id`` (the writer's) names the node."""
    return events.emit(
        Event.HEALTH_CHECK_FAILED,
        check=check,
        source=source,
        message=message[:500],
        nvrx_version=nvrx_version_text(),
        **context,
    )
