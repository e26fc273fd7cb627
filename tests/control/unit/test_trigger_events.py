"""Every trigger's events have one shape, ``{"status", "message", ...data}`` (``triggers.base``),
with a status the task that deferred to it reads; and each trigger still round-trips through
``serialize()`` under its classpath. The triggers run against a stand-in backend whose job state
and node pool a test sets, and FSx's API behind botocore's Stubber."""

from __future__ import annotations

import asyncio
import importlib
import json
import time
from typing import Any

import pytest

from fsdp_resilience.control.backends import (
    Capacity,
    JobHandle,
    JobStatus,
    NodeStatus,
    TrainingBackend,
    register_backend,
)
from fsdp_resilience.control.triggers.base import (
    FAILURE,
    LAUNCH_ENDED,
    NODES_OUT,
    STATUSES,
    SUCCESS,
    TIMEOUT,
    TriggerEventError,
    read_event,
    trigger_event,
)
from fsdp_resilience.control.triggers.fsx import FsxDataRepositoryTaskTrigger
from fsdp_resilience.control.triggers.node_capacity import NodeCapacityTrigger
from fsdp_resilience.control.triggers.spare_pool import SparePoolTrigger
from fsdp_resilience.control.triggers.training_progress import TrainingProgressTrigger
from fsdp_resilience.training.contract import CheckpointCatalog

from control.fakes.fsx_stubs import FS, TASK, a_task, expect_describe, stub  # noqa: F401  (stub is a fixture)
from control.fakes.saved_checkpoints import save_checkpoint


def _not_here(self: Any, *args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("the trigger events' stand-in backend only answers status() and capacity()")


class StandIn:
    """What the stand-in backend answers, set by each test."""

    status = JobStatus(state="running")
    capacity = Capacity(total=2, healthy=2)


#: A backend whose job state and node pool are ``StandIn``'s.
StandInBackend = type(
    "StandInBackend",
    (TrainingBackend,),
    {
        **{name: _not_here for name in TrainingBackend.__abstractmethods__},
        "__module__": __name__,
        "name": "trigger-events",
        "__init__": lambda self: None,
        "status": lambda self, handle: StandIn.status,
        "capacity": lambda self: StandIn.capacity,
        "to_config": lambda self: {"name": "trigger-events"},
    },
)
BACKEND = {"name": "trigger-events"}
HANDLE = JobHandle(backend="trigger-events", run_id="r1", launch_id="0", job_name="r1-0").to_dict()


@pytest.fixture(autouse=True)
def stand_in(monkeypatch):
    register_backend("trigger-events", StandInBackend)
    monkeypatch.setattr(StandIn, "status", JobStatus(state="running"))
    monkeypatch.setattr(StandIn, "capacity", Capacity(total=2, healthy=2))


def events(trigger) -> list[dict[str, Any]]:
    async def collect():
        return [event.payload async for event in trigger.run()]

    return asyncio.run(asyncio.wait_for(collect(), timeout=30))


def assert_shape(event: dict[str, Any], *statuses: str) -> None:
    assert event["status"] in statuses and event["status"] in STATUSES, event
    assert isinstance(event["message"], str) and event["message"], event
    assert json.loads(json.dumps(event)) == event  # stored by the triggerer: JSON-safe
    assert read_event(event, *statuses) is event


def assert_round_trips(trigger, classpath: str) -> None:
    path, kwargs = trigger.serialize()
    assert path == classpath
    module, _, name = path.rpartition(".")
    again = getattr(importlib.import_module(module), name)(**json.loads(json.dumps(kwargs)))
    assert again.serialize() == (path, kwargs)


def progress_trigger(tmp_path, **kw) -> TrainingProgressTrigger:
    return TrainingProgressTrigger(
        backend=BACKEND,
        handle=HANDLE,
        run_dir=str(tmp_path / "r1"),
        final_step=10,
        poll_interval_s=0.01,
        change_tick_s=0,
        **kw,
    )


def test_the_progress_trigger_fires_success_or_failure_with_what_the_watch_saw(tmp_path):
    assert_round_trips(
        progress_trigger(tmp_path, stall_timeout_s=60, launched_at=time.time()),
        "fsdp_resilience.control.triggers.training_progress.TrainingProgressTrigger",
    )
    StandIn.status = JobStatus(state="failed", failure_class="restarts_exhausted", message="node 1 gave up")
    [event] = events(progress_trigger(tmp_path, stall_timeout_s=60, launched_at=time.time()))
    assert_shape(event, FAILURE)
    assert (event["outcome"], event["failure_class"], event["message"]) == (
        "failed",
        "restarts_exhausted",
        "node 1 gave up",
    )
    StandIn.status = JobStatus(state="running")
    [event] = events(progress_trigger(tmp_path, stall_timeout_s=0.01, launched_at=time.time() - 60))
    assert_shape(event, FAILURE)
    assert event["outcome"] == "no_progress"
    # The job succeeded but no checkpoint was committed: a failure too, not a success.
    StandIn.status = JobStatus(state="succeeded", failure_class="success")
    [event] = events(progress_trigger(tmp_path, stall_timeout_s=60, launched_at=time.time()))
    assert_shape(event, FAILURE)
    save_checkpoint(CheckpointCatalog(tmp_path / "r1").layout.root, 10, 1)
    [event] = events(progress_trigger(tmp_path, stall_timeout_s=60, launched_at=time.time()))
    assert_shape(event, SUCCESS)
    assert (event["outcome"], event["step"]) == ("success", 10) and "step 10 committed" in event["message"]


def test_the_spare_pool_trigger_fires_nodes_out_of_job_or_launch_ended(tmp_path):
    def trigger(handled=()):
        return SparePoolTrigger(
            backend=BACKEND,
            handle=HANDLE,
            run_dir=str(tmp_path / "r1"),
            handled=list(handled),
            poll_interval_s=0.01,
            change_tick_s=0,
        )

    assert_round_trips(trigger(), "fsdp_resilience.control.triggers.spare_pool.SparePoolTrigger")
    lost = NodeStatus(index=1, node_id="slot-1", state="lost", message="node lost")
    StandIn.status = JobStatus(state="running", message="training on a spare", nodes=[lost])
    [event] = events(trigger())
    assert_shape(event, NODES_OUT)
    assert [n["key"] for n in event["nodes"]] == ["1@slot-1"] and event["state"] == "running"
    StandIn.status = JobStatus(state="failed", failure_class="user_error", message="rank 0 raised", nodes=[lost])
    [event] = events(trigger(handled=["1@slot-1"]))
    assert_shape(event, LAUNCH_ENDED)
    assert event["nodes"] == [] and event["handled"] == ["1@slot-1"] and event["message"] == "rank 0 raised"


def test_the_capacity_trigger_fires_success_or_timeout_with_the_capacity_seen():
    def trigger(timeout_s):
        return NodeCapacityTrigger(
            backend=BACKEND, nodes=2, timeout_s=timeout_s, started_at=time.time(), poll_interval_s=0.01
        )

    assert_round_trips(trigger(5), "fsdp_resilience.control.triggers.node_capacity.NodeCapacityTrigger")
    [event] = events(trigger(5))
    assert_shape(event, SUCCESS)
    assert event["capacity"]["healthy"] == 2 and "2 of 2 node(s) healthy" in event["message"]
    StandIn.capacity = Capacity(total=2, healthy=1, quarantined=["slot-0"])
    [event] = events(trigger(0.05))
    assert_shape(event, TIMEOUT)
    assert "1 of 2 node(s) healthy, out of service ['slot-0']" in event["message"]


def test_the_fsx_trigger_fires_success_or_failure_with_the_task(stub):
    trigger = FsxDataRepositoryTaskTrigger(task_id=TASK, file_system_id=FS, poll_interval_s=0)
    assert_round_trips(trigger, "fsdp_resilience.control.triggers.fsx.FsxDataRepositoryTaskTrigger")
    expect_describe(stub, a_task("SUCCEEDED", Status={"TotalCount": 1, "SucceededCount": 1, "FailedCount": 0}))
    [event] = events(trigger)
    assert_shape(event, SUCCESS)
    assert event["task"]["task_id"] == TASK
    expect_describe(stub, a_task("CANCELED"))
    [event] = events(trigger)
    assert_shape(event, FAILURE)
    stub.add_client_error("describe_data_repository_tasks", "DataRepositoryTaskNotFound", "gone", 400)
    [event] = events(trigger)
    assert_shape(event, FAILURE)
    assert event["task"] is None and "was not found" in event["message"]


def test_events_of_another_shape_are_refused_with_what_is_wrong():
    assert trigger_event(SUCCESS, "done", step=3).payload == {"status": "success", "message": "done", "step": 3}
    with pytest.raises(TriggerEventError, match="'succeeded' is not a trigger event status"):
        trigger_event("succeeded", "done")
    with pytest.raises(TriggerEventError, match="is not a {'status', 'message', ...} dict"):
        read_event({"ready": True, "capacity": {}})
    with pytest.raises(TriggerEventError, match="status 'timeout' is not one of success, failure: 1 of 2"):
        read_event({"status": TIMEOUT, "message": "1 of 2 node(s) healthy"}, SUCCESS, FAILURE)
