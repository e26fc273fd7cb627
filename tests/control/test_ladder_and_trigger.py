"""Launch idempotence, a trigger that survives a triggerer restart, and a run another launcher
already trains, on real local jobs."""

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
from conftest import REPO, TRAINING_PYTHON, make_dataset
from fsdp_resilience import ladder
from fsdp_resilience.backends import JobHandle, get_backend
from fsdp_resilience.progress import check_progress
from fsdp_resilience.triggers import TrainingProgressTrigger
from training.contract import CheckpointCatalog, RunConfig, final_status, read_events

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
