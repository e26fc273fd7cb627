"""fsdp_training end to end with dag.test(): real Airflow tasks, the deferrable sensor's trigger
run inline, the local backend, and real 2-rank CPU training (tiny model) as the workload."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import time
from pathlib import Path

import pytest

from fsdp_resilience.control import settings
from fsdp_resilience.control.backends import JobHandle, get_backend
from fsdp_resilience.training.contract import CheckpointCatalog, read_events

from control.support import REPO, make_dataset
from control.support.dag_runs import XComs, first_event, states, trigger, xcom
from shared import FAST_RUN

pytestmark = pytest.mark.slow

FAST = FAST_RUN


@pytest.fixture()
def roots(tmp_path, monkeypatch):
    """A fresh runs root (and so a fresh local backend with healthy slots) per test."""
    monkeypatch.setenv("FSDP_RUNS_ROOT", str(tmp_path / "runs"))
    data = Path(os.environ["FSDP_DATA_ROOT"])
    make_dataset(data / "python-stdlib")
    return tmp_path / "runs"


def base_conf(run_name: str, **overrides) -> dict:
    conf = {
        "run_name": run_name,
        "steps": 12,
        "checkpoint_interval": 3,
        "max_restarts": 1,
        "max_node_replacements": 1,
        "run_config": dict(FAST),
    }
    conf.update(overrides)
    return conf


# Under the real scheduler, triggerer and PostgreSQL instead (test_deployment.py): a good run with an
# in-process and an in-job fault, evaluated and published; a user bug and a diverging run, which
# fail without replacing a node; and the params validate_config refuses. dag.test() keeps the
# ladder's climb and the stall.


def test_restarts_exhausted_replaces_the_slot_and_resumes(roots):
    # A bad node: rank 1 dies at step 7 on every attempt while it runs on slot-0.
    conf = base_conf(
        "ladder",
        restart_mode="injob",
        run_config={
            **FAST,
            "faults": [{"kind": "sigkill", "step": 7, "rank": 1, "attempt": None, "node_id": "slot-0"}],
        },
    )
    dr = trigger(conf)
    st = states(dr)
    assert str(dr.state) == "success", st
    assert st["escalation_1.diagnose_and_replace"] == "success" and st["escalation_1.watch"] == "success"
    assert st["escalation_2.decide"] == "skipped"
    # No spares: every keeper of a spare pool shows skipped, and the run still ends a success.
    assert {t: s for t, s in st.items() if t.endswith("keep_spare_pool")} == {
        "keep_spare_pool": "skipped",
        **{f"escalation_{r}.keep_spare_pool": "skipped" for r in (1, 2, 3)},
    }
    run_dir = roots / "ladder"
    events = read_events(run_dir / "events.jsonl")
    escalations = [r for r in events if r["event"] == "escalation"]
    assert len(escalations) == 1 and escalations[0]["nodes"] == ["slot-0"]
    assert xcom(dr, "escalation_1.diagnose_and_replace")["replaced"] == ["slot-0"]  # visible in the UI
    assert escalations[0]["failure_class"] == "restarts_exhausted"
    # the relaunch resumed from a committed checkpoint, on another slot
    relaunch = [r for r in events if r["event"] == "train_begin" and r.get("node_id") != "slot-0"]
    assert relaunch and relaunch[0]["resumed_from"] is not None
    slots = json.loads((roots / ".local-backend" / "slots.json").read_text())
    assert "slot-0" in json.dumps(slots) and "quarantined" in json.dumps(slots)
    assert CheckpointCatalog(run_dir).latest().step == 12


def test_a_stall_ends_as_no_progress(roots):
    # restart_mode none and a long collective timeout: nothing inside the job notices the hang,
    # only the watch (or the launcher's own stall watchdog) does.
    dr = trigger(
        base_conf(
            "stall",
            restart_mode="none",
            max_node_replacements=0,
            stall_timeout_s=30,
            run_config={**FAST, "collective_timeout_s": 600.0, "faults": [{"kind": "hang", "step": 5, "rank": 1}]},
        )
    )
    st = states(dr)
    assert str(dr.state) == "failed", st
    assert st["resolve_outcome"] == "failed" and st["escalation_1.decide"] == "skipped"
    assert st["keep_spare_pool"] == "skipped"
    assert xcom(dr, "watch_checkpoints")["failure_class"] == "no_progress"
    latest = CheckpointCatalog(roots / "stall").latest()
    assert latest is None or latest.step < 12


def test_no_param_places_a_run_outside_its_roots(roots, monkeypatch):
    """Straight through the ladder (the schema's refusals aside): every path field by name, '..',
    absolute paths and symlinks are refused before anything is created."""
    from fsdp_resilience.control import ladder
    from fsdp_resilience.training.contract import ConfigError

    def build(**params):
        return ladder.build_run_config({"dataset": "python-stdlib", **params}, "manual__x")

    good = build(run_name="fine")
    assert good.config["run_dir"] == str(roots.resolve() / "fine")
    assert good.config["dataset_dir"] == str(Path(os.environ["FSDP_DATA_ROOT"]).resolve() / "python-stdlib")
    for field in ladder.PLACEMENT_FIELDS:
        with pytest.raises(ConfigError, match=f"run_config may not set {field}"):
            build(run_name="sneaky", run_config={field: "/tmp/x" if field != "rdzv_port" else 2222})
    for dataset in ("../python-stdlib", "/etc", "..", "a/b", "", None):
        with pytest.raises(ConfigError, match="dataset"):
            build(dataset=dataset)
    roots.mkdir(parents=True, exist_ok=True)
    (roots / "linked-run").symlink_to(roots.parent, target_is_directory=True)
    with pytest.raises(ConfigError, match="outside its root"):
        build(run_name="linked-run")
    (Path(os.environ["FSDP_DATA_ROOT"]) / "linked-data").symlink_to(roots.parent, target_is_directory=True)
    with pytest.raises(ConfigError, match="outside its root"):
        build(dataset="linked-data")
    for run_name in ("../up", "/abs", "UPPER"):
        with pytest.raises(ConfigError, match="run_id"):
            build(run_name=run_name)
    # The backend's checks come before anything starts: slots quarantined for good leave too few.
    backend = get_backend(**settings.backend_config("local"))
    backend.replace_nodes(["slot-0"], reason="test")
    backend.replace_nodes(["slot-1"], reason="test")
    with pytest.raises(ConfigError, match="capacity: .* 2 are quarantined"):
        build(run_name="crowded", nodes=3)
    monkeypatch.setenv("TRAINING_PYTHON", str(roots / "no-such-python"))
    with pytest.raises(ConfigError, match="needs a training environment"):
        build(run_name="no-env")
    # A deployment whose default backend is EKS (the Airflow image) never falls back to local.
    monkeypatch.setenv("FSDP_DEFAULT_BACKEND", "eks")
    monkeypatch.delenv("FSDP_EKS_IMAGE", raising=False)
    with pytest.raises(ConfigError, match="the EKS backend needs a training image"):
        build(run_name="deployed")


async def _keep_pool(keeper, context) -> dict:
    """What the triggerer and a worker do with a deferrable task: execute, run its trigger, resume
    it in a worker thread (it starts processes), until it returns."""
    from airflow.sdk.exceptions import TaskDeferred

    try:
        return await asyncio.to_thread(keeper.execute, context)
    except TaskDeferred as deferred:
        trigger = deferred.trigger
    while True:
        event = await first_event(trigger)
        try:
            return await asyncio.to_thread(keeper.execute_complete, context, event)
        except TaskDeferred as deferred:
            trigger = deferred.trigger


def _watch_and_keep(
    run, launch, first_launch, watch_id="watch_checkpoints", keeper_id="keep_spare_pool", stop_after=True
):
    """A launch's watch and keep_spare_pool side by side, as the triggerer and a worker run them,
    until both end (the launch stopped after, if anything of it is left, unless not
    ``stop_after``): the watch's outcome (its XCom) and the keeper's result."""
    from fsdp_resilience.control.operators.spare_pool import SparePoolKeeper
    from fsdp_resilience.control.sensors.checkpoint_progress import CheckpointProgressSensor
    from fsdp_resilience.control.task_data import Outcome
    from fsdp_resilience.control.triggers.training_progress import TrainingProgressTrigger

    try:
        watch = CheckpointProgressSensor(task_id=watch_id, launch=launch)
        keeper = SparePoolKeeper(task_id=keeper_id, launch=launch, poll_interval_s=2.0)
        context = {"ti": XComs(validate_config=run, launch_training=first_launch)}

        async def side_by_side():
            return await asyncio.wait_for(
                asyncio.gather(
                    first_event(TrainingProgressTrigger(**watch._trigger_kwargs(), poll_interval_s=2.0)),
                    _keep_pool(keeper, context),
                ),
                timeout=480,
            )

        outcome, kept = asyncio.run(side_by_side())
        return Outcome.from_dict(watch.execute_complete(context, outcome)), kept
    except BaseException:
        stop_after = True
        raise
    finally:
        if stop_after:
            get_backend(**run.backend).cancel(JobHandle.from_dict(launch.handle))


def test_a_lost_node_with_a_spare_recovers_in_job_and_the_pool_is_refilled(roots):
    """Two training nodes and one spare, real training; node 1 is lost whole at step 5. The spare
    takes its place in the next in-job restart (no rung, one launch), and while training goes on
    keep_spare_pool quarantines the lost slot and adds a new spare. The DAG's tasks, as their
    real code: validate_config's run config, launch_training's launch, then the watch's trigger
    and keep_spare_pool side by side, as the triggerer runs them. (dag.test() runs one task at a
    time, so the keeper would only start once the watch had seen the launch end.)"""
    from fsdp_resilience.control import ladder

    conf = base_conf(
        "spare",
        nodes=2,
        spare_nodes=1,
        procs_per_node=1,
        restart_mode="injob",
        max_restarts=2,
        run_config={**FAST, "faults": [{"kind": "node_loss", "step": 5, "node": 1}]},
    )
    from airflow.dag_processing.dagbag import DagBag

    params = copy.deepcopy(DagBag(dag_folder=str(REPO / "dags")).get_dag("fsdp_training").params)
    params.update(conf)  # what a trigger does with its conf: the form's schema and defaults
    run = ladder.build_run_config(params.validate(), "manual__spare")  # validate_config
    launch = ladder.launch(run, launch_no=0)  # launch_training
    outcome, kept = _watch_and_keep(run, launch, launch)
    run_dir = roots / "spare"
    events = read_events(run_dir / "events.jsonl")
    assert outcome.outcome == "success" and outcome.launch_id == "0", outcome
    climb, why = ladder.should_escalate(outcome, rung=1, max_replacements=1)
    assert not climb, why  # no rung runs
    assert {r.get("launch_id") for r in events if r["event"] == "launch_begin"} == {"0"}  # one launch
    assert not [r for r in events if r["event"] == "escalation"]
    [promoted] = [r for r in events if r["event"] == "spare_promoted"]
    [added] = [r for r in events if r["event"] == "spare_added"]
    lost_slot = added["lost_node_id"]
    assert promoted["replaces"] == [lost_slot] and added["lost_node_rank"] == 1
    assert added["quarantined"] == [lost_slot] and added["node_rank"] == 3 and added["node_id"] != lost_slot
    # Refilled before the run ended, and by the keeper that returned it.
    train_end = max(r["ts"] for r in events if r["event"] == "train_end")
    assert added["ts"] < train_end
    assert [s["node_rank"] for s in kept["spares_added"]] == [3] and kept["state"] == "succeeded", kept
    slots = json.loads((roots / ".local-backend" / "slots.json").read_text())
    assert slots["slots"][lost_slot]["state"] == "quarantined", slots
    assert CheckpointCatalog(run_dir).latest().step == 12


def test_spares_used_up_end_the_launch_in_seconds_and_the_ladder_relaunches_from_the_newest_checkpoint(
    roots, monkeypatch
):
    """Two training nodes, one spare, max_node_replacements=1, and three node losses (steps 4, 9
    and 14), with the watch and keep_spare_pool running side by side as in the DAG. The first loss:
    the spare takes its place and the keeper adds a new one (the one replacement the run has); the
    second: that new spare joins in its place, training goes on in the same launch; the third: no
    spare left and nothing coming (the keeper has no replacement left), so node 0 ends the launch
    within seconds, the watch fails it at once, and the ladder's rung relaunches from the newest
    committed checkpoint, which finishes the run."""
    from fsdp_resilience.control import ladder

    monkeypatch.setenv("FSDP_LOCAL_SLOTS", "7")  # the relaunch needs 3 healthy slots after 3 losses
    conf = base_conf(
        "usedup",
        nodes=2,
        spare_nodes=1,
        procs_per_node=1,
        restart_mode="injob",
        max_restarts=3,
        steps=20,
        run_config={
            **FAST,
            "faults": [
                {"kind": "node_loss", "step": step, "node": None, "attempt": None, "once": True} for step in (4, 9, 14)
            ],
        },
    )
    from airflow.dag_processing.dagbag import DagBag

    params = copy.deepcopy(DagBag(dag_folder=str(REPO / "dags")).get_dag("fsdp_training").params)
    params.update(conf)
    run = ladder.build_run_config(params.validate(), "manual__usedup")  # validate_config
    first = ladder.launch(run, launch_no=0)  # launch_training
    outcome, kept = _watch_and_keep(run, first, first, stop_after=False)  # the rung stops what is left
    run_dir = roots / "usedup"
    deadline = time.time() + 60  # node 0's own end, which the backend's verdict may come before
    while time.time() < deadline and not [
        r for r in read_events(run_dir / "events.jsonl", "final") if r.get("node_rank") == 0
    ]:
        time.sleep(0.5)
    events = read_events(run_dir / "events.jsonl")
    losses = sorted(r["ts"] for r in events if r["event"] == "fault_injected")
    assert len(losses) == 3, [r for r in events if r["event"] in ("fault_injected", "final")]
    # One refill (the budget), and the new spare took the second lost node's place: one launch so far.
    assert [r["node_rank"] for r in events if r["event"] == "spare_added"] == [3], kept
    assert [r["node_rank"] for r in events if r["event"] == "spare_promoted"] == [2, 3]
    assert outcome.outcome == "failed" and outcome.failure_class == "restarts_exhausted", outcome
    # The local backend fails the launch as soon as the third loss leaves too few nodes; node 0's
    # launcher, which ends it by itself wherever the backend cannot tell (EKS), says so too: nothing
    # is coming, the keeper has no replacement left. (Had the second loss come before the new spare
    # was parked, node 0 would have waited for it first.)
    waiting = [r for r in events if r["event"] == "waiting_for_nodes"][-1]
    assert waiting["node_rank"] == 0 and waiting["missing_node_ranks"] == [3] and waiting["until"] is None
    assert "max_node_replacements=1 spent" in waiting["why"], waiting
    [final] = [r for r in events if r["event"] == "final" and r.get("node_rank") == 0]
    assert final["failure_class"] == "restarts_exhausted" and "(node 3) lost and no spare left" in final["message"]
    assert final["ts"] - losses[2] < 30, final["ts"] - losses[2]
    newest = CheckpointCatalog(run_dir).latest()

    climb, why = ladder.decide_escalation(run, outcome, rung=1)  # escalation_1.decide
    assert climb, why
    ladder.diagnose_and_replace(run, outcome, rung=1)
    assert get_backend(**run.backend).capacity().healthy >= 3  # escalation_1.wait_for_capacity
    relaunched = ladder.launch(run, launch_no=ladder.next_launch_no(outcome))  # escalation_1.relaunch
    outcome, kept = _watch_and_keep(run, relaunched, first, "escalation_1.watch", "escalation_1.keep_spare_pool")
    assert outcome.outcome == "success" and outcome.launch_id == relaunched.launch_id, outcome
    events = read_events(run_dir / "events.jsonl")
    began = [r for r in events if r["event"] == "train_begin" and r["launch_id"] == relaunched.launch_id]
    resumed = {r["resumed_from"] for r in began}
    assert resumed == {newest.checkpoint_id}, (resumed, newest)
    assert CheckpointCatalog(run_dir).latest().step == 20


def test_with_spares_the_keepers_end_with_their_launch_and_the_run_ends_as_it_should(roots):
    """dag.test() with one spare: a clean run succeeds with keep_spare_pool a success (it ends
    with its launch; the spare's launcher ends with the job); a launch that fails (in-job restarts
    exhausted, no node replacement allowed) fails the run at resolve_outcome, never at the keeper."""
    spares = dict(nodes=2, spare_nodes=1, procs_per_node=1, restart_mode="injob")
    good = trigger(base_conf("spares-good", **spares))
    st = states(good)
    assert str(good.state) == "success", st
    assert st["keep_spare_pool"] == "success" and st["escalation_1.keep_spare_pool"] == "skipped", st
    assert xcom(good, "keep_spare_pool")["spares_added"] == []
    events = read_events(roots / "spares-good" / "events.jsonl")
    assert sorted(r["node_rank"] for r in events if r["event"] == "launch_begin" and r.get("standby")) == [2]
    assert {r.get("launch_id") for r in events if r["event"] == "launch_begin"} == {"0"}

    bad = trigger(
        base_conf(
            "spares-bad",
            **spares,
            max_restarts=0,
            max_node_replacements=0,
            run_config={**FAST, "faults": [{"kind": "sigkill", "step": 4, "rank": 1, "attempt": None}]},
        )
    )
    st = states(bad)
    assert str(bad.state) == "failed", st
    assert st["resolve_outcome"] == "failed" and st["keep_spare_pool"] == "success", st
    assert xcom(bad, "watch_checkpoints")["failure_class"] == "restarts_exhausted"
    assert xcom(bad, "keep_spare_pool")["state"] == "failed"
