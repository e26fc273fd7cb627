"""The local backend's slots as a pool: quarantine (``replace_nodes``), the way back
(``return_nodes``) and capacity. The state is slots.json (``StateStore.read_slots``); a quarantined
slot is never replaced by a new one, it is out until someone returns it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from fsdp_resilience.control.backends.base import (
    BackendError,
    Capacity,
    Replacement,
    ServiceReturn,
    current_operator,
    require_reason,
)
from fsdp_resilience.control.backends.evidence import final_events, trained_nodes
from fsdp_resilience.control.backends.local.processes import job_active, process_alive, stop_nodes
from fsdp_resilience.control.backends.local.state import StateStore
from fsdp_resilience.control.backends.replacement import plan_replacement

SLOT_PREFIX = "slot-"


def slot_names(slots: int) -> list[str]:
    """The node ids of ``slots`` local slots: ``slot-0`` .. ``slot-{slots-1}``."""
    return [f"{SLOT_PREFIX}{i}" for i in range(slots)]


def quarantine_slots(
    store: StateStore, slot_ids: list[str], node_ids: list[str], reason: str, max_unhealthy_share: float
) -> Replacement:
    """``LocalProcessBackend.replace_nodes``: quarantine slots under the share rule, and stop the
    spares parked on them."""
    with store.locked():
        slots = store.read_slots()
        out = [s for s, info in slots.items() if info.get("state") == "quarantined"]
        replace, refused, note = plan_replacement(list(node_ids), slot_ids, out, max_unhealthy_share)
        now = time.time()
        for slot in replace:
            slots[slot] = {"state": "quarantined", "reason": reason, "since": now}
        if replace:
            store.write_slots(slots)
    healthy = len(slot_ids) - len(set(out) | set(replace))
    parts = (
        [
            f"quarantined {replace}: {reason}; capacity now {healthy} of {len(slot_ids)} slot(s) "
            "(local slots are not replaced by new ones)"
        ]
        if replace
        else []
    )
    stopped = stop_parked_spares(store, replace)
    if stopped:
        parts.append(f"stopped the spare(s) parked there, never to be promoted: {', '.join(stopped)}")
    if note:
        parts.append(note)
    return Replacement(replace, refused, "; ".join(parts) or "nothing to replace")


def stop_parked_spares(store: StateStore, slots: list[str]) -> list[str]:
    """Stop every standby on ``slots`` that has not trained, in every active job. One still
    being started is marked, and its supervisor stops it (or never starts it)."""
    stopped = []
    for record in store.jobs():
        hosted = [n for n in record["nodes"] if n["node_id"] in slots and n.get("standby")]
        if not hosted or not job_active(record):
            continue
        trained = trained_nodes(record["run_dir"], record["launch_id"])
        finals = final_events(Path(record["run_dir"]), record["launch_id"])
        parked = [
            n["index"]
            for n in hosted
            if n["index"] not in trained
            and n["index"] not in finals
            and n["exit_code"] is None
            and not n.get("start_error")
            and (n["pid"] is None or process_alive(n["pid"], n["start_ticks"]))
        ]
        if not parked:
            continue
        stop_nodes(store, record["job_name"], parked, "quarantine (its slot was taken out of service)")
        stopped += [f"node {i} of job {record['job_name']}" for i in parked]
    return stopped


def quarantined_slots(store: StateStore, slot_ids: list[str]) -> list[dict[str, Any]]:
    """``LocalProcessBackend.quarantined_nodes``: the quarantined slots, oldest first."""
    slots = store.read_slots()
    out = [
        {"node_id": s, "reason": slots[s].get("reason", ""), "since": slots[s].get("since")}
        for s in slot_ids
        if slots.get(s, {}).get("state") == "quarantined"
    ]
    return sorted(out, key=lambda q: q["since"] or 0)


def return_slots(
    store: StateStore,
    slot_ids: list[str],
    state_dir: Path,
    node_ids: list[str],
    reason: str,
    *,
    by: str | None = None,
    quarantined_before: float | None = None,
) -> ServiceReturn:
    """``LocalProcessBackend.return_nodes``: mark quarantined slots healthy again, recording why,
    by whom and the quarantine it ended."""
    reason = require_reason(reason)
    wanted = list(dict.fromkeys(node_ids))
    unknown = [n for n in wanted if n not in slot_ids]
    if unknown:
        raise BackendError(
            f"unknown local node(s) {unknown}: this backend's slots are {slot_ids} "
            f"(state dir {state_dir}); list the quarantined ones with "
            "`python -m fsdp_resilience.control.quarantine list`"
        )
    by = by or current_operator()
    with store.locked():
        slots = store.read_slots()
        now = time.time()
        returned = [
            s
            for s in wanted
            if slots.get(s, {}).get("state") == "quarantined"
            and (quarantined_before is None or (slots[s].get("since") or 0) <= quarantined_before)
        ]
        for slot in returned:
            old = slots[slot]
            slots[slot] = {
                "state": "healthy",
                "reason": f"returned to service: {reason}",
                "since": now,
                "returned_by": by,
                "quarantine_reason": old.get("reason", ""),
                "quarantined_since": old.get("since"),
            }
        if returned:
            store.write_slots(slots)
    not_quarantined = [s for s in wanted if s not in returned]
    return ServiceReturn(returned, not_quarantined, [])


def slot_capacity(store: StateStore, slot_ids: list[str]) -> Capacity:
    """``LocalProcessBackend.capacity``: the slots, the healthy ones and the quarantined ones."""
    quarantined = set(store.quarantined())
    pool = slot_ids
    healthy = [s for s in pool if s not in quarantined]
    return Capacity(
        total=len(pool),
        healthy=len(healthy),
        quarantined=[s for s in pool if s in quarantined],
        healthy_node_ids=healthy,
    )
