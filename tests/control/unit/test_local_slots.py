"""The local backend's slot pool (backends/local/slots.py): quarantine under the share rule, the
way back to service, capacity. slots.json and job records only; no process starts here (a parked
spare stopped by a quarantine is in tests/control/integration/test_local_backend.py)."""

from __future__ import annotations

import pytest

from fsdp_resilience.control.backends import BackendError, Capacity
from fsdp_resilience.control.backends.local.slots import (
    SLOT_PREFIX,
    quarantine_slots,
    quarantined_slots,
    return_slots,
    slot_capacity,
    slot_names,
    stop_parked_spares,
)
from fsdp_resilience.control.backends.local.state import StateStore

POOL = slot_names(4)


def test_slots_are_named_by_index():
    assert POOL == ["slot-0", "slot-1", "slot-2", "slot-3"] and all(s.startswith(SLOT_PREFIX) for s in POOL)


def test_quarantine_under_the_share_rule_and_capacity(tmp_path):
    store = StateStore(tmp_path / "state")
    assert slot_capacity(store, POOL) == Capacity(4, 4, [], POOL)
    too_many = quarantine_slots(store, POOL, ["slot-0", "slot-1", "slot-2"], "test", 0.5)
    assert too_many.replaced == [] and too_many.refused == ["slot-0", "slot-1", "slot-2"]
    assert "allows 2" in too_many.reason and store.read_slots() == {}  # nothing written

    done = quarantine_slots(store, POOL, ["slot-2", "slot-9"], "restarts exhausted twice", 0.5)
    assert done.replaced == ["slot-2"] and done.refused == ["slot-9"]
    assert "capacity now 3 of 4 slot(s)" in done.reason and "not in the pool" in done.reason
    assert slot_capacity(store, POOL) == Capacity(4, 3, ["slot-2"], ["slot-0", "slot-1", "slot-3"])
    again = quarantine_slots(store, POOL, ["slot-2"], "again", 0.5)
    assert again.replaced == [] and "already out of service" in again.reason
    assert quarantine_slots(store, POOL, [], "nothing", 0.5).reason == "nothing to replace"


def test_quarantined_slots_are_listed_oldest_first(tmp_path):
    store = StateStore(tmp_path / "state")
    store.write_slots(
        {
            "slot-3": {"state": "quarantined", "reason": "late", "since": 20.0},
            "slot-1": {"state": "quarantined", "reason": "early", "since": 10.0},
            "slot-0": {"state": "healthy"},
            "slot-7": {"state": "quarantined", "reason": "not a slot of this pool", "since": 1.0},
        }
    )
    assert quarantined_slots(store, POOL) == [
        {"node_id": "slot-1", "reason": "early", "since": 10.0},
        {"node_id": "slot-3", "reason": "late", "since": 20.0},
    ]


def test_return_records_who_why_and_the_quarantine_it_ended(tmp_path):
    store = StateStore(tmp_path / "state")
    store.write_slots(
        {
            "slot-1": {"state": "quarantined", "reason": "xid 79", "since": 10.0},
            "slot-2": {"state": "quarantined", "reason": "new", "since": 30.0},
        }
    )
    wanted = ["slot-1", "slot-2", "slot-0", "slot-1"]
    done = return_slots(store, POOL, tmp_path / "state", wanted, " reseated ", by="me@host", quarantined_before=20.0)
    assert done.returned == ["slot-1"] and done.not_quarantined == ["slot-2", "slot-0"] and done.gone == []
    back = store.read_slots()["slot-1"]
    assert back["state"] == "healthy" and back["reason"] == "returned to service: reseated"
    assert back["returned_by"] == "me@host" and back["quarantine_reason"] == "xid 79"
    assert back["quarantined_since"] == 10.0
    assert store.quarantined() == ["slot-2"]


def test_return_refuses_unknown_slots_and_an_empty_reason_before_changing_anything(tmp_path):
    store = StateStore(tmp_path / "state")
    store.write_slots({"slot-1": {"state": "quarantined", "reason": "bad", "since": 1.0}})
    with pytest.raises(BackendError, match=r"unknown local node\(s\) \['slot-9'\]"):
        return_slots(store, POOL, tmp_path / "state", ["slot-1", "slot-9"], "checked")
    with pytest.raises(BackendError, match="needs a reason"):
        return_slots(store, POOL, tmp_path / "state", ["slot-1"], "  ")
    assert store.quarantined() == ["slot-1"]


def test_no_active_job_means_no_parked_spare_to_stop(tmp_path):
    store = StateStore(tmp_path / "state")
    assert stop_parked_spares(store, ["slot-0"]) == []
