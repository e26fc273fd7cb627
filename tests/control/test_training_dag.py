"""fsdp_training end to end with dag.test(): real Airflow tasks, the deferrable sensor's trigger
run inline, the local backend, and real 2-rank CPU training (tiny model) as the workload."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from shared import FAST_RUN
from conftest import REPO, make_dataset
from fsdp_resilience import settings
from fsdp_resilience.backends import get_backend
from training.contract import CheckpointCatalog, read_events

pytestmark = pytest.mark.slow

FAST = FAST_RUN


@pytest.fixture()
def roots(tmp_path, monkeypatch):
    """A fresh runs root (and so a fresh local backend with healthy slots) per test."""
    monkeypatch.setenv("FSDP_RUNS_ROOT", str(tmp_path / "runs"))
    data = Path(os.environ["FSDP_DATA_ROOT"])
    make_dataset(data / "python-stdlib")
    return tmp_path / "runs"


def trigger(conf: dict):
    from airflow.dag_processing.dagbag import DagBag

    dag = DagBag(dag_folder=str(REPO / "dags")).get_dag("fsdp_training")
    return dag.test(run_conf=conf)


def states(dag_run) -> dict[str, str]:
    return {ti.task_id: str(ti.state) for ti in dag_run.get_task_instances()}


def xcom(dag_run, task_id: str):
    """A task's return value, as the UI shows it."""
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    with create_session() as session:
        row = session.scalars(XComModel.get_many(run_id=dag_run.run_id, dag_ids=dag_run.dag_id,
                                                 task_ids=task_id, key="return_value")).first()
        return XComModel.deserialize_value(row) if row is not None else None


def base_conf(run_name: str, **overrides) -> dict:
    conf = {"run_name": run_name, "steps": 12, "checkpoint_interval": 3, "max_restarts": 1,
            "max_node_replacements": 1, "run_config": dict(FAST)}
    conf.update(overrides)
    return conf


def test_faults_inside_the_job_are_recovered_and_the_run_is_evaluated_and_published(roots):
    conf = base_conf("happy", run_config={**FAST, "faults": [
        {"kind": "exception", "step": 4, "rank": 1},   # in-process
        {"kind": "sigkill", "step": 8, "rank": 0},     # in-job
    ]})
    dr = trigger(conf)
    st = states(dr)
    assert str(dr.state) == "success", st
    assert st["watch_checkpoints"] == "success" and st["publish"] == "success"
    assert all(st[f"escalation_{k}.decide"] == "skipped" for k in (1, 2, 3))
    run_dir = roots / "happy"
    events = read_events(run_dir / "events.jsonl")
    layers = [r["layer"] for r in events if r["event"] == "restart_end"]
    assert "inprocess" in layers and "injob" in layers
    assert not [r for r in events if r["event"] == "escalation"]
    assert json.loads((run_dir / "eval.json").read_text())["step"] == 12
    assert (run_dir / "report" / "report.md").exists()
    # Published: the final checkpoint, every byte checked against its commit's CRC32C.
    published = xcom(dr, "publish")
    assert (published["checkpoint_id"], published["verified"], published["skipped"]) == (
        "step_00000012", "checksums", [])
    assert published["checkpoint"] == str(run_dir / "checkpoints" / "step_00000012")


def test_restarts_exhausted_replaces_the_slot_and_resumes(roots):
    # A bad node: rank 1 dies at step 7 on every attempt while it runs on slot-0.
    conf = base_conf("ladder", restart_mode="injob", run_config={**FAST, "faults": [
        {"kind": "sigkill", "step": 7, "rank": 1, "attempt": None, "node_id": "slot-0"}]})
    dr = trigger(conf)
    st = states(dr)
    assert str(dr.state) == "success", st
    assert st["escalation_1.diagnose_and_replace"] == "success" and st["escalation_1.watch"] == "success"
    assert st["escalation_2.decide"] == "skipped"
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


def test_a_user_bug_fails_the_run_without_replacing_a_node(roots):
    dr = trigger(base_conf("userbug", fault_drill={"kind": "user_bug", "step": 5, "rank": 1}))
    st = states(dr)
    assert str(dr.state) == "failed", st
    assert st["escalation_1.decide"] == "skipped" and st["resolve_outcome"] == "failed"
    assert st["evaluate"] in ("upstream_failed", "skipped")
    events = read_events(roots / "userbug" / "events.jsonl")
    assert not [r for r in events if r["event"] == "escalation"]
    assert any(r["event"] == "final" and r["failure_class"] == "user_error" for r in events)


def test_a_diverging_run_ends_non_finite_and_never_replaces_a_node(roots):
    # The loss of rank 1 turns NaN at step 5 on every pass: the run rolls back to its newest verified
    # checkpoint max_nonfinite_rollbacks times, then ends non_finite. Not the machine's fault.
    dr = trigger(base_conf("diverges", max_node_replacements=2, run_config={**FAST, "faults": [
        {"kind": "nan", "step": 5, "rank": 1, "attempt": None}]}))
    st = states(dr)
    assert str(dr.state) == "failed", st
    assert xcom(dr, "watch_checkpoints")["failure_class"] == "non_finite"
    assert all(st[f"escalation_{k}.decide"] == "skipped" for k in (1, 2, 3)), st
    assert st["resolve_outcome"] == "failed" and st["evaluate"] in ("upstream_failed", "skipped")
    events = read_events(roots / "diverges" / "events.jsonl")
    assert not [r for r in events if r["event"] == "escalation"]
    assert any(r["event"] == "final" and r["failure_class"] == "non_finite" and r["exit_code"] == 65 for r in events)
    assert get_backend(**settings.backend_config("local")).capacity().quarantined == []
    # Every checkpoint it committed holds finite state: none was saved after the NaN.
    assert all(c.step < 5 for c in CheckpointCatalog(roots / "diverges").committed())


def test_a_stall_ends_as_no_progress(roots):
    # restart_mode none and a long collective timeout: nothing inside the job notices the hang,
    # only the watch (or the launcher's own stall watchdog) does.
    dr = trigger(base_conf("stall", restart_mode="none", max_node_replacements=0, stall_timeout_s=60,
                           run_config={**FAST, "collective_timeout_s": 600.0,
                                       "faults": [{"kind": "hang", "step": 5, "rank": 1}]}))
    st = states(dr)
    assert str(dr.state) == "failed", st
    assert st["resolve_outcome"] == "failed" and st["escalation_1.decide"] == "skipped"
    assert xcom(dr, "watch_checkpoints")["failure_class"] == "no_progress"
    latest = CheckpointCatalog(roots / "stall").latest()
    assert latest is None or latest.step < 12


def test_invalid_params_are_rejected_before_anything_launches(roots):
    from airflow.sdk.exceptions import ParamValidationError

    with pytest.raises(ParamValidationError):
        trigger(base_conf("bad-form", nodes=0))
    dr = trigger(base_conf("bad-config", fault_drill={"kind": "meteor", "step": 1}))
    st = states(dr)
    assert str(dr.state) == "failed" and st["validate_config"] == "failed"
    assert st["launch_training"] == "upstream_failed"
    assert not (roots / "bad-config").exists()
