"""Launch idempotence, a trigger that survives a triggerer restart, and a run another launcher
already trains, on real local jobs; a trigger that sees a launch end (its final event, a lost
node) between its polls, and the keeper of a launch's spare pool (its trigger, the quarantine and
the new spare, its bounds), on stand-in launchers."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from fsdp_resilience.control import ladder, spare_refill
from fsdp_resilience.control.backends import JobHandle, get_backend
from fsdp_resilience.control.progress import LaunchChanges, check_progress, waiting_verdict
from fsdp_resilience.control.task_data import Launch, Outcome, Run
from fsdp_resilience.control.triggers.spare_pool import SparePoolTrigger
from fsdp_resilience.control.triggers.training_progress import TrainingProgressTrigger
from fsdp_resilience.training.contract import CheckpointCatalog, EventLog, RunConfig, final_status, read_events
from fsdp_resilience.training.contract.replacements import read_membership_deadline

from control.fakes.stand_in_launcher import script_backend
from control.support import REPO, TRAINING_PYTHON, make_dataset
from control.support.dag_runs import XComs
from shared import FAST_RUN

FAST = FAST_RUN


@pytest.fixture()
def launched(tmp_path, monkeypatch):
    """Launches made by a test; cancelled at the end, so no training process outlives it."""
    monkeypatch.setenv("FSDP_RUNS_ROOT", str(tmp_path / "runs"))
    make_dataset(Path(os.environ["FSDP_DATA_ROOT"]) / "python-stdlib")
    launches: list[dict] = []
    yield launches
    for launch in launches:
        get_backend(**launch.backend).cancel(JobHandle.from_dict(launch.handle))


def run_config(name: str, **params) -> dict:
    return ladder.build_run_config(
        {"run_name": name, "dataset": "python-stdlib", "steps": 12, "checkpoint_interval": 2, **params}, dag_run_id=name
    )


@pytest.mark.slow
def test_launching_the_same_run_again_never_starts_a_second_job(launched):
    run = run_config("idem", run_config=FAST)
    first = ladder.launch(run, launch_no=0)
    launched.append(first)
    again = ladder.launch(run, launch_no=0)
    assert again.handle == first.handle
    record = json.loads((Path(run.backend["state_dir"]) / "jobs" / f"{first.handle['job_name']}.json").read_text())
    assert len(record["nodes"]) == 1  # one node launched, once
    backend = get_backend(**run.backend)
    assert backend.status(JobHandle.from_dict(first.handle)).state in ("pending", "running")


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
    run = run_config(
        "stall-clock",
        restart_mode="none",
        stall_timeout_s=int(stall),
        run_config={
            **FAST,
            "collective_timeout_s": 600.0,
            "heartbeat_timeout_s": 700.0,
            "faults": [{"kind": "hang", "step": 5, "rank": 1}],
        },
    )
    launch = ladder.launch(run, launch_no=0)
    launched.append(launch)
    kwargs = {
        k: getattr(launch, k) for k in ("backend", "handle", "run_dir", "final_step", "stall_timeout_s", "launched_at")
    }
    trigger = TrainingProgressTrigger(**kwargs, poll_interval_s=1.0)

    # Wait for the hang; by then the last progress (a committed checkpoint) is on disk.
    events = Path(launch.run_dir) / "events.jsonl"
    deadline = time.time() + 240
    while not any(r["event"] == "fault_injected" for r in read_events(events)) and time.time() < deadline:
        time.sleep(1)
    latest = CheckpointCatalog(launch.run_dir).latest()
    assert latest is not None and latest.step >= 2
    last_commit = latest.committed_at
    assert asyncio.run(_watch(trigger, seconds=12)) is None  # still running: no event yet

    # The triggerer restarts: a new trigger from the serialized one.
    classpath, restored_kwargs = trigger.serialize()
    assert classpath == "fsdp_resilience.control.triggers.training_progress.TrainingProgressTrigger"
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
    cfg = RunConfig.from_dict(run.config)
    config = tmp_path / "by-hand.json"
    config.write_text(cfg.to_json())
    by_hand = subprocess.Popen(
        [
            TRAINING_PYTHON,
            "-m",
            "fsdp_resilience.training.launch",
            "--config",
            str(config),
            "--node-rank",
            "0",
            "--rdzv-host",
            "127.0.0.1",
        ],
        cwd=REPO,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "TRAINING_NODE_ID": "by-hand", "TRAINING_LAUNCH_ID": "by-hand"},
    )
    try:
        deadline = time.time() + 240
        while not read_events(cfg.layout.events, "step") and time.time() < deadline:
            assert by_hand.poll() is None, f"the launcher by hand ended early (exit {by_hand.returncode})"
            time.sleep(1)
        status_before = final_status(cfg.run_dir)

        launch = ladder.launch(run, launch_no=0)
        launched.append(launch)
        backend = get_backend(**run.backend)
        handle = JobHandle.from_dict(launch.handle)
        deadline = time.time() + 120
        while backend.status(handle).state not in ("failed", "succeeded") and time.time() < deadline:
            time.sleep(0.5)
        progress = check_progress(
            backend,
            handle,
            run_dir=launch.run_dir,
            final_step=launch.final_step,
            stall_timeout_s=launch.stall_timeout_s,
            launched_at=launch.launched_at,
        )
        outcome = progress
        assert outcome.failure_class == "already_running", outcome
        assert backend.status(handle).exit_codes == {0: 73}
        climb, why = ladder.should_escalate(outcome, rung=1, max_replacements=3)
        assert not climb and "another fsdp_resilience.training.launch of this run" in why
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

#: Stands in for the training venv's python: a "launcher" (called as ``python -m fsdp_resilience.training.launch
#: --config <run_dir>/launches/<id>.json ...``) that runs until the test creates ``<run_dir>/go``,
#: then, if ``<run_dir>/report`` exists, appends its final event as fsdp_resilience.training.launch does, and
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
    cfg = RunConfig(
        **{
            **FAST,
            "run_id": "stand-in",
            "run_dir": str(tmp_path / "run"),
            "dataset_dir": str(tmp_path / "no-data"),
            "steps": 4,
        }
    )
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
    return TrainingProgressTrigger(
        backend=backend.to_config(),
        handle=handle.to_dict(),
        run_dir=cfg.run_dir,
        final_step=cfg.steps,
        stall_timeout_s=3600.0,
        launched_at=time.time(),
        poll_interval_s=3600.0,
    )


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


def test_the_watch_waits_for_an_announced_replacement_and_fails_at_once_when_none_is_coming(tmp_path):
    """A survivor's waiting_for_nodes (contract: training/launch/membership_watch.py): with a
    replacement announced the watch says what it waits for and keeps watching; with nothing coming
    it fails the launch at once (restarts_exhausted, naming the lost node), before the launch's
    final and long before stall_timeout_s."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    log = EventLog(run_dir / "events.jsonl", run_id="r", role="launcher", launch_id="2", node_rank=0)
    changes = LaunchChanges(run_dir, "2")
    running = Outcome(None, None, "running: step 6", 6, "step_00000006", "2", {"launch_id": "2"}, "running", 1.0)
    assert waiting_verdict(running, changes.waiting) == (None, None)
    EventLog(run_dir / "events.jsonl", launch_id="1").emit(
        "waiting_for_nodes", nodes=["slot-7"], until=None, why="another launch's"
    )
    assert changes.poll() is None and changes.waiting is None
    log.emit(
        "waiting_for_nodes",
        missing=1,
        nodes=["slot-2"],
        missing_node_ranks=[2],
        until=time.time() + 60,
        why="a replacement is coming: the pool keeper is adding a spare for node 2 (slot-2)",
    )
    assert "node 0 of launch 2 waits for nodes" in changes.poll()
    ended, said = waiting_verdict(running, changes.waiting)
    assert ended is None and "waits for node(s) slot-2 for up to" in said and "pool keeper" in said
    EventLog(run_dir / "events.jsonl", launch_id="2", rank=0).emit("train_begin", start_step=6, world_size=2)
    changes.poll()
    assert waiting_verdict(running, changes.waiting) == (None, None)  # it came: training goes on
    log.emit(
        "waiting_for_nodes",
        missing=1,
        nodes=["slot-2"],
        missing_node_ranks=[2],
        until=None,
        why="no replacement is coming: spare pool not refilled: max_node_replacements=1 spent",
    )
    changes.poll()
    ended, said = waiting_verdict(running, changes.waiting)
    assert said is None and ended.outcome == "failed" and ended.failure_class == "restarts_exhausted"
    assert (
        ended.message.startswith("node(s) slot-2 lost and no spare left") and "max_node_replacements" in ended.message
    )
    assert (ended.step, ended.launch_id) == (6, "2")
    done = Outcome(
        "success", "success", "step 12 committed", 12, "step_00000012", "2", {"launch_id": "2"}, "succeeded", 1.0
    )
    assert waiting_verdict(done, changes.waiting) == (None, None)  # a verdict already made stands


# --------------------------------------------------------------------------------------------
# Keeping the spare pool whole: the trigger, and keep_spare_pool on the local backend
# --------------------------------------------------------------------------------------------

#: A launcher that only waits: the test decides what happens to its node (lost, cancelled).
IDLE_LAUNCHER = """#!/bin/sh
exec sleep 300
"""


@pytest.fixture()
def spared(tmp_path):
    """A local backend of 4 slots with idle stand-in launchers, and launch 0 of a run of 2 nodes and
    1 spare submitted through the ladder (what launch_training does)."""
    backend = script_backend(tmp_path / "spared", IDLE_LAUNCHER, slots=4, cancel_grace_s=2)
    cfg = RunConfig(
        **{
            **FAST,
            "run_id": "spared",
            "run_dir": str(tmp_path / "run"),
            "dataset_dir": str(tmp_path / "no-data"),
            "steps": 4,
            "nodes": 2,
            "spare_nodes": 1,
            "restart_mode": "injob",
        }
    )
    run = Run(config=cfg.to_dict(), backend=backend.to_config(), max_node_replacements=1)
    launch = ladder.launch(run, launch_no=0)
    handle = JobHandle.from_dict(launch.handle)
    deadline = time.time() + 60
    while backend.status(handle).state != "running" and time.time() < deadline:
        time.sleep(0.1)
    yield backend, run, launch
    backend.cancel(handle)


def _lose(backend, launch, index: int) -> str:
    """The machine under node ``index`` goes: its launcher dies, nothing reports. Its slot."""
    node = backend._store.read_job(launch.handle["job_name"])["nodes"][index]
    os.kill(node["pid"], signal.SIGKILL)
    return node["node_id"]


def _pool_trigger(backend, launch, handled=()) -> SparePoolTrigger:
    return SparePoolTrigger(
        backend=backend.to_config(),
        handle=launch.handle,
        run_dir=launch.run_dir,
        handled=list(handled),
        poll_interval_s=3600.0,
    )  # only the look between polls fires it


def test_the_pool_trigger_fires_on_a_lost_node_not_yet_handled_and_on_the_launchs_end(spared):
    backend, run, launch = spared
    handle = JobHandle.from_dict(launch.handle)
    trigger = _pool_trigger(backend, launch)
    classpath, kwargs = trigger.serialize()
    assert classpath == "fsdp_resilience.control.triggers.spare_pool.SparePoolTrigger"
    assert json.loads(json.dumps(kwargs)) == kwargs

    event = asyncio.run(_fire_after(trigger, lambda: _lose(backend, launch, 1), timeout_s=60))
    assert event is not None, "the trigger waited for its next poll"
    assert event["status"] == "nodes_out_of_job" and event["state"] == "running", event  # a spare covers the node
    assert [(n["index"], n["state"]) for n in event["nodes"]] == [(1, "lost")]
    assert "node lost" in event["nodes"][0]["message"]

    # Handled: the same lost node does not fire it again; the launch's end does.
    key = event["nodes"][0]["key"]
    assert key == f"1@{event['nodes'][0]['node_id']}"  # the index and the machine: one node
    event = asyncio.run(
        _fire_after(_pool_trigger(backend, launch, handled=[key]), lambda: backend.cancel(handle), timeout_s=60)
    )
    assert event is not None and event["status"] == "launch_ended" and event["state"] == "failed", event
    assert event["nodes"] == [] and event["handled"] == [key]


def test_keep_spare_pool_quarantines_the_lost_slot_and_adds_a_spare_once(spared):
    from airflow.sdk.exceptions import TaskDeferred

    from fsdp_resilience.control.operators.spare_pool import SparePoolKeeper

    backend, run, launch = spared
    handle = JobHandle.from_dict(launch.handle)
    keeper = SparePoolKeeper(task_id="keep_spare_pool", launch=launch)
    context = {"ti": XComs(validate_config=run, launch_training=launch)}
    with pytest.raises(TaskDeferred) as deferred:
        keeper.execute(context)
    # With a replacement left, the keeper's watch keeps a standing notice in the run dir, so
    # survivors of a loss no spare covers wait for the keeper's word on it.
    control = RunConfig.from_dict(run.config).layout.control
    assert deferred.value.trigger.standby_s == spare_refill.KEEPER_NOTICE_S
    lost_slot = _lose(backend, launch, 1)
    event = asyncio.run(_watch(deferred.value.trigger, seconds=60))
    assert event is not None and event["nodes"][0]["index"] == 1, event
    standing = read_membership_deadline(control, "0")
    assert standing.standing and standing.wait_until() is not None, standing
    assert "1 of max_node_replacements=1 left" in standing.why and "keep_spare_pool" in standing.why

    with pytest.raises(TaskDeferred) as deferred:  # it acts, then waits again
        keeper.execute_complete(context, event=event)
    assert deferred.value.trigger.handled == [f"1@{lost_slot}"]
    assert deferred.value.trigger.standby_s == 0  # the refill spent the last replacement
    assert backend.capacity().quarantined == [lost_slot]
    added = read_events(Path(launch.run_dir) / "events.jsonl", "spare_added")
    assert len(added) == 1, added
    record = backend._store.read_job(handle.job_name)
    spare = record["nodes"][-1]
    assert (added[0]["lost_node_id"], added[0]["lost_node_rank"]) == (lost_slot, 1)
    assert added[0]["quarantined"] == [lost_slot]
    assert (added[0]["node_id"], added[0]["node_rank"], added[0]["launch_id"]) == (spare["node_id"], 3, "0")
    assert added[0]["role"] == "control-plane" and spare["node_id"] != lost_slot
    assert backend.status(handle).state == "running"
    # Survivors waiting for a node wait for this one (control/membership-deadline.json).
    coming = read_membership_deadline(control, "0")
    assert coming.coming and coming.wait_until() is not None and f"node 1 ({lost_slot})" in coming.why
    assert coming.nodes == (spare["node_id"],) and coming.node_ranks == (3,) and not coming.standing
    # Once that spare's launcher beats, the announcement is spent: a later loss waits for nothing.
    assert coming.wait_until(beats={3: coming.ts + 1}) is None

    # A retried task (or a stale event) never handles the same node twice.
    again = spare_refill.keep_spare_pool(run, launch, event["nodes"], since=launch.launched_at, log=lambda _: None)
    assert [r["refilled"] for r in again] == [False] and "already handled" in again[0]["why"]
    assert spare_refill.handled_nodes(run, launch) == [f"1@{lost_slot}"]
    assert len(read_events(Path(launch.run_dir) / "events.jsonl", "spare_added")) == 1

    # The launch ends (here: stopped): the keeper ends quietly, with what it did.
    backend.cancel(handle)
    event = asyncio.run(_watch(deferred.value.trigger, seconds=60))
    assert event["status"] == "launch_ended", event
    summary = keeper.execute_complete(context, event=event)
    assert summary["state"] == "failed" and summary["nodes_handled"] == [f"1@{lost_slot}"]
    assert summary["spares_added"] == [
        {
            "lost_node_id": lost_slot,
            "lost_node_rank": 1,
            "quarantined": [lost_slot],
            "node_id": spare["node_id"],
            "node_rank": 3,
        }
    ]


def test_keep_spare_pool_refills_nothing_past_its_budget_and_says_why(spared):
    backend, run, launch = spared
    handle = JobHandle.from_dict(launch.handle)
    # One escalation of this DAG run already spent max_node_replacements=1.
    cfg = RunConfig.from_dict(run.config)
    EventLog(cfg.layout.events, run_id=cfg.run_id, role="control-plane").emit("escalation", rung=1)
    lost_slot = _lose(backend, launch, 1)
    deadline = time.time() + 30
    while not (lost := [n for n in backend.status(handle).nodes if n.state == "lost"]) and time.time() < deadline:
        time.sleep(0.1)
    said = []
    results = spare_refill.keep_spare_pool(
        run, launch, [n.to_dict() for n in lost], since=launch.launched_at - 1, log=said.append
    )
    assert [r["refilled"] for r in results] == [False] and "max_node_replacements=1 spent" in results[0]["why"]
    assert any("not refilled" in line and lost_slot in line for line in said), said
    assert backend.capacity().quarantined == []  # a replacement is not done by halves
    assert not read_events(cfg.layout.events, "spare_added")
    assert len(backend._store.read_job(handle.job_name)["nodes"]) == 3
    # Survivors waiting for a node stop waiting: nothing is coming.
    none = read_membership_deadline(cfg.layout.control, handle.launch_id)
    assert not none.coming and none.wait_until() is None and "max_node_replacements=1 spent" in none.why


def test_keep_spare_pool_without_a_free_node_quarantines_and_trains_on(tmp_path):
    backend = script_backend(tmp_path / "full", IDLE_LAUNCHER, slots=3, cancel_grace_s=2)
    cfg = RunConfig(
        **{
            **FAST,
            "run_id": "full",
            "run_dir": str(tmp_path / "run"),
            "dataset_dir": str(tmp_path / "x"),
            "steps": 4,
            "nodes": 2,
            "spare_nodes": 1,
            "restart_mode": "injob",
        }
    )
    run = Run(config=cfg.to_dict(), backend=backend.to_config(), max_node_replacements=2)
    launch = ladder.launch(run, launch_no=0)
    handle = JobHandle.from_dict(launch.handle)
    try:
        deadline = time.time() + 60
        while backend.status(handle).state != "running" and time.time() < deadline:
            time.sleep(0.1)
        lost_slot = _lose(backend, launch, 2)  # the spare's machine goes, before it ever trained
        while not (lost := [n for n in backend.status(handle).nodes if n.state == "lost"]) and time.time() < deadline:
            time.sleep(0.1)
        results = spare_refill.keep_spare_pool(
            run, launch, [n.to_dict() for n in lost], since=launch.launched_at, log=lambda _: None
        )
        assert [r["refilled"] for r in results] == [False], results
        assert "no free healthy" in results[0]["why"] and results[0]["quarantined"] == [lost_slot]
        assert backend.capacity().quarantined == [lost_slot]
        assert backend.status(handle).state == "running"  # two training nodes: it trains on, with no spare
        assert not read_events(cfg.layout.events, "spare_added")
    finally:
        backend.cancel(handle)


def test_a_run_without_spares_skips_its_keepers_and_spares_count_in_capacity(launched):
    from airflow.sdk.exceptions import AirflowSkipException

    from fsdp_resilience.control.operators.spare_pool import SparePoolKeeper
    from fsdp_resilience.training.contract import ConfigError

    run = run_config("no-spares")
    launch = Launch(
        backend=run.backend,
        handle={"launch_id": "0", "job_name": "never-submitted"},
        run_dir=run.config["run_dir"],
        final_step=12,
        stall_timeout_s=60.0,
        launched_at=0.0,
    )
    with pytest.raises(AirflowSkipException, match="spare_nodes=0"):
        SparePoolKeeper(task_id="keep_spare_pool", launch=launch).execute({"ti": XComs(validate_config=run)})
    spared = run_config("with-spares", nodes=2, spare_nodes=1, restart_mode="injob")
    assert spared.config["spare_nodes"] == 1
    with pytest.raises(ConfigError, match="needs in-job restarts"):
        run_config("spares-need-injob", nodes=2, spare_nodes=1, restart_mode="inprocess")
    with pytest.raises(ConfigError, match="capacity: .*5"):  # 3 + 2 launchers on 4 local slots
        run_config("too-many", nodes=3, spare_nodes=2, restart_mode="injob")
