"""Launch idempotence, a trigger that survives a triggerer restart, and a run another launcher
already trains, on real local jobs; and a trigger that sees a launch end (its final event, a lost
node) between its polls, on stand-in launchers."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from shared import FAST_RUN
from conftest import REPO, TRAINING_PYTHON, make_dataset, script_backend
from fsdp_resilience import ladder
from fsdp_resilience.backends import JobHandle, LocalProcessBackend, get_backend
from fsdp_resilience.progress import LaunchChanges, check_progress
from fsdp_resilience.triggers import TrainingProgressTrigger
from training.contract import CheckpointCatalog, EventLog, RunConfig, final_status, read_events

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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_run_another_launcher_already_trains_is_refused_and_left_alone(launched, tmp_path):
    """Someone trains the run by hand; the DAG launches it too. The DAG's launcher is refused by
    the launch lock (exit 73, no event), and nothing climbs the ladder: no slot is quarantined,
    no relaunch, the other launcher keeps training and the run's status stays its own."""
    run = run_config("held", run_config={**FAST, "steps": 400})
    cfg = RunConfig.from_dict(run["config"])
    config = tmp_path / "by-hand.json"
    config.write_text(cfg.to_json())
    by_hand = subprocess.Popen(
        [TRAINING_PYTHON, "-m", "training.launch", "--config", str(config), "--node-rank", "0",
         "--rdzv-host", "127.0.0.1"], cwd=REPO, start_new_session=True, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, env={**os.environ, "TRAINING_NODE_ID": "by-hand", "TRAINING_LAUNCH_ID": "by-hand"})
    try:
        deadline = time.time() + 240
        while not read_events(cfg.layout.events, "step") and time.time() < deadline:
            assert by_hand.poll() is None, f"the launcher by hand ended early (exit {by_hand.returncode})"
            time.sleep(1)
        status_before = final_status(cfg.run_dir)

        launch = ladder.launch(run, launch_no=0)
        launched.append(launch)
        backend = get_backend(**run["backend"])
        handle = JobHandle.from_dict(launch["handle"])
        deadline = time.time() + 120
        while backend.status(handle).state not in ("failed", "succeeded") and time.time() < deadline:
            time.sleep(0.5)
        progress = check_progress(backend, handle, run_dir=launch["run_dir"], final_step=launch["final_step"],
                                  stall_timeout_s=launch["stall_timeout_s"], launched_at=launch["launched_at"])
        outcome = progress.to_dict()
        assert outcome["failure_class"] == "already_running", outcome
        assert backend.status(handle).exit_codes == {0: 73}
        climb, why = ladder.should_escalate(outcome, rung=1, max_replacements=3)
        assert not climb and "another training.launch of this run" in why
        assert not backend.diagnose(handle).replaceable
        ladder.stop_launch(run, outcome)  # what resolve_outcome does: only this launch's own processes
        assert backend.capacity().quarantined == []
        assert by_hand.poll() is None, "the launcher that holds the run was touched"
        assert final_status(cfg.run_dir) == status_before
        assert not read_events(cfg.layout.events, "escalation")
    finally:
        by_hand.send_signal(signal.SIGTERM)  # the launcher passes it on to ft_launcher and its ranks
        by_hand.wait(timeout=180)


# --------------------------------------------------------------------------------------------
# The watch sees a launch end between its polls
# --------------------------------------------------------------------------------------------

#: Stands in for the training venv's python: a "launcher" (called as ``python -m training.launch
#: --config <run_dir>/launches/<id>.json ...``) that runs until the test creates ``<run_dir>/go``,
#: then, if ``<run_dir>/report`` exists, appends its final event as training.launch does, and
#: lingers as a launcher does while it exits.
STAND_IN_LAUNCHER = """#!/bin/sh
run_dir=$(dirname "$(dirname "$4")")
while [ ! -e "$run_dir/go" ]; do sleep 0.05; done
if [ -e "$run_dir/report" ]; then
  printf '{"event": "final", "failure_class": "restarts_exhausted", "exit_code": 75, "launch_id": "%s", "message": "stand-in gave up", "node_rank": 0, "ts": %s}\\n' "$TRAINING_LAUNCH_ID" "$(date +%s)" >> "$run_dir/events.jsonl"
fi
exec sleep 300
"""


@pytest.fixture()
def stand_in(tmp_path):
    """A local backend whose launchers are ``STAND_IN_LAUNCHER``, and a submitted launch of it."""
    backend = script_backend(tmp_path / "stand-in", STAND_IN_LAUNCHER, slots=2, cancel_grace_s=2)
    cfg = RunConfig(**{**FAST, "run_id": "stand-in", "run_dir": str(tmp_path / "run"),
                       "dataset_dir": str(tmp_path / "no-data"), "steps": 4})
    handle = backend.submit(cfg, launch_id="0")
    yield backend, cfg, handle
    backend.cancel(handle)


async def _fire_after(trigger: TrainingProgressTrigger, act, timeout_s: float):
    """Run the trigger; once it has made its first check and is waiting, ``act()``; return its
    event, or None if it did not fire within ``timeout_s``."""
    async def first_event():
        async for event in trigger.run():
            return event.payload
    task = asyncio.ensure_future(first_event())
    await asyncio.sleep(1.0)  # the first check (the job is running) is done by now
    assert not task.done(), task.result()
    act()
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if not done:
        task.cancel()
        return None
    return task.result()


def _trigger_for(backend, cfg, handle) -> TrainingProgressTrigger:
    # A poll interval no test waits out: only the look between polls can fire it.
    return TrainingProgressTrigger(backend=backend.to_config(), handle=handle.to_dict(), run_dir=cfg.run_dir,
                                   final_step=cfg.steps, stall_timeout_s=3600.0, launched_at=time.time(),
                                   poll_interval_s=3600.0)


def test_the_watch_sees_a_final_event_between_its_polls(stand_in):
    backend, cfg, handle = stand_in
    run_dir = Path(cfg.run_dir)
    (run_dir / "report").touch()
    event = asyncio.run(_fire_after(_trigger_for(backend, cfg, handle), (run_dir / "go").touch, timeout_s=120))
    assert event is not None, "the trigger waited for its next poll"
    assert event["outcome"] == "failed" and event["failure_class"] == "restarts_exhausted", event
    assert "stand-in gave up" in event["message"]


def test_the_watch_sees_a_lost_node_between_its_polls(stand_in):
    backend, cfg, handle = stand_in
    run_dir = Path(cfg.run_dir)
    launcher = backend._store.read_job(handle.job_name)["nodes"][0]["pid"]

    def node_dies() -> None:  # the machine goes: nothing reports
        os.kill(launcher, signal.SIGKILL)

    event = asyncio.run(_fire_after(_trigger_for(backend, cfg, handle), node_dies, timeout_s=120))
    assert event is not None, "the trigger waited for its next poll"
    assert event["failure_class"] == "restarts_exhausted" and "node lost" in event["message"], event
    assert not (run_dir / "go").exists()


def test_launch_changes_name_only_this_launchs_final_event_and_changed_job_files(tmp_path):
    run_dir, job_file = tmp_path / "run", tmp_path / "job.json"
    run_dir.mkdir()
    job_file.write_text("{}")
    log = EventLog(run_dir / "events.jsonl", run_id="r", role="launcher")
    log.emit("launch_begin", launch_id="2")
    changes = LaunchChanges(run_dir, "2", [job_file])  # what was there before is the check's to read
    assert changes.poll() is None
    log.emit("step", step=3)
    log.emit("final", launch_id="1", node_rank=0, failure_class="success")  # another launch's
    assert changes.poll() is None
    with open(run_dir / "events.jsonl", "a") as f:  # a line still being written
        f.write('{"event": "final", "launch_id": "2", ')
    assert changes.poll() is None
    with open(run_dir / "events.jsonl", "a") as f:
        f.write('"node_rank": 1, "ts": 1.0}\n')
    assert "node 1 of launch 2" in changes.poll()
    assert changes.poll() is None  # seen once
    job_file.write_text('{"exit_code": -9}')
    assert "job.json changed" in changes.poll()
    assert changes.poll() is None
