"""Launch idempotence and a trigger that survives a triggerer restart, on real local jobs."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import pytest

from shared import FAST_RUN
from conftest import make_dataset
from fsdp_resilience import ladder
from fsdp_resilience.backends import JobHandle, get_backend
from fsdp_resilience.triggers import TrainingProgressTrigger
from training.contract import CheckpointCatalog, read_events

pytestmark = pytest.mark.slow

FAST = FAST_RUN


@pytest.fixture()
def launched(tmp_path, monkeypatch):
    """Launches made by a test; cancelled at the end, so no training process outlives it."""
    monkeypatch.setenv("FSDP_RUNS_ROOT", str(tmp_path / "runs"))
    make_dataset(Path(os.environ["FSDP_DATA_ROOT"]) / "python-stdlib")
    launches: list[dict] = []
    yield launches
    for launch in launches:
        get_backend(**launch["backend"]).cancel(JobHandle.from_dict(launch["handle"]))


def run_config(name: str, **params) -> dict:
    return ladder.build_run_config({"run_name": name, "dataset": "python-stdlib", "steps": 12,
                                    "checkpoint_interval": 2, **params}, dag_run_id=name)


def test_launching_the_same_run_again_never_starts_a_second_job(launched):
    run = run_config("idem", run_config=FAST)
    first = ladder.launch(run, launch_no=0)
    launched.append(first)
    again = ladder.launch(run, launch_no=0)
    assert again["handle"] == first["handle"]
    record = json.loads((Path(run["backend"]["state_dir"]) / "jobs" / f"{first['handle']['job_name']}.json").read_text())
    assert len(record["nodes"]) == 1  # one node launched, once
    backend = get_backend(**run["backend"])
    assert backend.status(JobHandle.from_dict(first["handle"])).state in ("pending", "running")


async def _watch(trigger: TrainingProgressTrigger, seconds: float | None):
    """Run the trigger like the triggerer does; stop after ``seconds`` (a triggerer restart)."""
    async def first_event():
        async for event in trigger.run():
            return event.payload
    task = asyncio.ensure_future(first_event())
    done, _ = await asyncio.wait({task}, timeout=seconds)
    if not done:
        task.cancel()
        return None
    return task.result()


def test_a_restarted_trigger_picks_the_run_up_where_it_was(launched):
    # A hang no restart layer handles (restart_mode none): only the stall clock can end it.
    stall = 60.0  # well past start-up (~20 s here), so only the hang can trip it
    # The healthy rank waits in its collective far longer than the stall timeout.
    run = run_config("stall-clock", restart_mode="none", stall_timeout_s=int(stall),
                     run_config={**FAST, "collective_timeout_s": 600.0, "heartbeat_timeout_s": 700.0,
                                 "faults": [{"kind": "hang", "step": 5, "rank": 1}]})
    launch = ladder.launch(run, launch_no=0)
    launched.append(launch)
    kwargs = {k: launch[k] for k in ("backend", "handle", "run_dir", "final_step", "stall_timeout_s", "launched_at")}
    trigger = TrainingProgressTrigger(**kwargs, poll_interval_s=1.0)

    # Wait for the hang; by then the last progress (a committed checkpoint) is on disk.
    events = Path(launch["run_dir"]) / "events.jsonl"
    deadline = time.time() + 240
    while not any(r["event"] == "fault_injected" for r in read_events(events)) and time.time() < deadline:
        time.sleep(1)
    latest = CheckpointCatalog(launch["run_dir"]).latest()
    assert latest is not None and latest.step >= 2
    last_commit = latest.committed_at
    assert asyncio.run(_watch(trigger, seconds=12)) is None  # still running: no event yet

    # The triggerer restarts: a new trigger from the serialized one.
    classpath, restored_kwargs = trigger.serialize()
    assert classpath == "fsdp_resilience.triggers.TrainingProgressTrigger"
    restarted_at = time.time()
    event = asyncio.run(_watch(TrainingProgressTrigger(**restored_kwargs), seconds=stall + 60))
    fired_at = time.time()

    # (the launcher's own stall watchdog may stop the job first: then the job reports no_progress)
    assert event["failure_class"] == "no_progress", event
    assert event["last_progress_at"] == pytest.approx(last_commit)
    # It counted from the last commit on disk, not from its own restart.
    assert fired_at - restarted_at < stall - 5, (fired_at - restarted_at, restarted_at - last_commit)
    assert fired_at - last_commit >= stall
