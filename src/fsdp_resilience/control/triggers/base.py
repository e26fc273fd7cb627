"""What the control plane's triggers share: the shape of their events, and the wait between two
checks of a launch.

Every event is ``{"status": ..., "message": ..., **data}``, as the Amazon provider's waiter
triggers' events carry a ``status``: ``status`` says how the wait ended (one of ``STATUSES``),
``message`` says it in words for the task log, and the rest is the data the deferred task goes
on with. ``trigger_event`` builds one; a task's ``execute_complete`` reads it with ``read_event``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from airflow.triggers.base import TriggerEvent

from fsdp_resilience.control.progress import LaunchChanges

#: What was waited for happened: the launch succeeded, the data repository task succeeded, the
#: node capacity is there.
SUCCESS = "success"
#: What was waited for ended otherwise: a failed or stalled launch, a failed data repository task.
FAILURE = "failure"
#: The wait gave up (node capacity after its timeout).
TIMEOUT = "timeout"
#: The spare pool's watch: the launch ended, however it ended.
LAUNCH_ENDED = "launch_ended"
#: The spare pool's watch: nodes of the running launch are out of the job.
NODES_OUT = "nodes_out_of_job"
STATUSES = (SUCCESS, FAILURE, TIMEOUT, LAUNCH_ENDED, NODES_OUT)


class TriggerEventError(ValueError):
    """A trigger event a task cannot read: not ``{"status", "message", ...}``, or a status the task
    does not expect."""


def event_payload(status: str, message: str, **data: Any) -> dict[str, Any]:
    """An event's payload: ``{"status": status, "message": message, **data}`` (JSON-able data)."""
    if status not in STATUSES:
        raise TriggerEventError(f"status {status!r} is not a trigger event status; use one of {', '.join(STATUSES)}")
    return {"status": status, "message": message, **data}


def trigger_event(status: str, message: str, **data: Any) -> TriggerEvent:
    """The ``TriggerEvent`` of ``event_payload``."""
    return TriggerEvent(event_payload(status, message, **data))


def read_event(event: Any, *statuses: str) -> dict[str, Any]:
    """The event a deferred task resumed with, checked: a dict with a ``message`` and a ``status``
    (among ``statuses`` when given). Raises ``TriggerEventError`` saying what is wrong."""
    if not isinstance(event, dict) or not isinstance(event.get("status"), str) or "message" not in event:
        raise TriggerEventError(
            f"trigger event {event!r} is not a {{'status', 'message', ...}} dict: was the "
            "trigger serialised by an older version of the control plane?"
        )
    if statuses and event["status"] not in statuses:
        raise TriggerEventError(
            f"trigger event status {event['status']!r} is not one of {', '.join(statuses)}: {event['message']}"
        )
    return event


async def until_next_check(
    changes: LaunchChanges | None, poll_interval_s: float, change_tick_s: float, log: Any
) -> None:
    """Wait out the poll interval, or less: until ``changes`` says the launch may have changed (a
    ``final`` event, a rewritten job file)."""
    if changes is None:
        await asyncio.sleep(poll_interval_s)
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + poll_interval_s
    while (left := deadline - loop.time()) > 0:
        await asyncio.sleep(min(change_tick_s, left))
        why = await asyncio.to_thread(changes.poll)  # a stat on a network mount may block
        if why:
            log.info("checking now: %s", why)
            return
