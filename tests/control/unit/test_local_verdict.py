"""The local job verdict (backends/local/verdict.py): a job's state and failure from its record,
its nodes' liveness and the run's ``final`` events. Records are written by hand; the only process
is this one (alive), or a pid whose start time does not match (gone)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from fsdp_resilience.control.backends import LOST
from fsdp_resilience.control.backends.local.verdict import DROPPED_SPARE, judge_job, promotion_pending
from fsdp_resilience.training.contract import FailureClass, failure_class_for_exit

from control.support.local_jobs import ALIVE, GONE, make_record, node


def write_events(tmp_path: Path, *events: dict) -> None:
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    with open(run / "events.jsonl", "a") as f:
        for e in events:
            f.write(json.dumps({"launch_id": "1", "ts": time.time(), **e}) + "\n")


def final(rank: int, failure_class: str = "success", exit_code: int = 0, message: str = "done") -> dict:
    return {
        "event": "final",
        "node_rank": rank,
        "failure_class": failure_class,
        "exit_code": exit_code,
        "message": message,
    }


def test_every_node_reporting_success_is_a_succeeded_job(tmp_path):
    store, record = make_record(tmp_path, [node(0, **GONE, exit_code=0), node(1, **GONE, exit_code=0)])
    write_events(tmp_path, final(0), final(1))
    status = judge_job(store, record)
    assert status.state == "succeeded" and status.failure_class == FailureClass.SUCCESS.value
    assert status.message.startswith("all 2 node(s) succeeded") and status.exit_codes == {0: 0, 1: 0}


def test_running_and_pending_nodes(tmp_path):
    store, record = make_record(tmp_path, [node(0, **ALIVE), node(1)])
    status = judge_job(store, record)
    assert status.state == "running" and [n.state for n in status.nodes] == ["running", "pending"]
    store, record = make_record(tmp_path, [node(0), node(1)])
    assert judge_job(store, record).state == "pending"


def test_a_launcher_gone_without_a_final_event_is_a_lost_node(tmp_path):
    store, record = make_record(tmp_path, [node(0, **ALIVE), node(1, **GONE, exit_code=-9)])
    status = judge_job(store, record)
    assert status.state == "failed" and status.failure_class == FailureClass.RESTARTS_EXHAUSTED.value
    assert status.nodes[1].state == LOST and "killed by signal 9" in status.nodes[1].message
    assert status.message.startswith("node 1 (slot-1) lost: restarts_exhausted")


def test_a_launcher_that_exited_by_itself_is_failed_not_lost(tmp_path):
    store, record = make_record(tmp_path, [node(0, **GONE, exit_code=2)])
    status = judge_job(store, record)
    assert status.nodes[0].state == "failed" and status.exit_codes == {0: 2}
    assert status.failure_class == failure_class_for_exit(2).value
    assert "exited 2 without a final event" in status.message


def test_a_node_we_stopped_is_not_lost(tmp_path):
    store, record = make_record(tmp_path, [node(0, **GONE, exit_code=-9, stopped_by="cancel")])
    status = judge_job(store, record)
    assert status.nodes[0].state == "failed" and status.nodes[0].failure_class == FailureClass.UNKNOWN.value
    assert "stopped by cancel before it reported" in status.nodes[0].message


def test_a_spare_covers_a_lost_node(tmp_path):
    store, record = make_record(
        tmp_path, [node(0, **GONE, exit_code=-9), node(1, standby=True, **ALIVE)], train_nodes=1
    )
    status = judge_job(store, record)
    assert status.state == "running" and "a spare covers it" in status.message


def test_a_dropped_spare_fails_nothing_by_itself(tmp_path):
    store, record = make_record(tmp_path, [node(0, **ALIVE), node(1, standby=True, **GONE, exit_code=1)], train_nodes=1)
    write_events(tmp_path, final(1, "unknown", 1, DROPPED_SPARE + "health check failed"))
    status = judge_job(store, record)
    assert status.state == "running"
    assert status.nodes[1].message == DROPPED_SPARE + "health check failed"  # not prefixed twice


def test_a_cancelled_job_keeps_the_verdict_taken_at_cancel(tmp_path):
    cancel = {"failure_class": FailureClass.NO_PROGRESS.value, "message": "no checkpoint for 60s"}
    store, record = make_record(tmp_path, [node(0, **GONE, exit_code=-15, stopped_by="cancel")], cancel=cancel)
    status = judge_job(store, record)
    assert (status.state, status.failure_class, status.message) == ("failed", "no_progress", "no checkpoint for 60s")


def test_a_job_that_failed_to_start_fails_every_node(tmp_path):
    store, record = make_record(tmp_path, [node(0), node(1)], error="could not start a launcher: ENOENT")
    status = judge_job(store, record)
    assert status.state == "failed" and all(n.message == "could not start a launcher: ENOENT" for n in status.nodes)


def test_promotion_is_pending_until_membership_is_recorded_after_the_loss(tmp_path):
    lost_at = time.time() - 10
    store, record = make_record(
        tmp_path, [node(0, **GONE, exit_code=-9, ended_at=lost_at), node(1, standby=True, **ALIVE)], train_nodes=1
    )
    status = judge_job(store, record)
    assert not promotion_pending(record, judge_job(*make_record(tmp_path, [node(0, **ALIVE)])))  # none lost
    assert not promotion_pending(record, status)  # the lost node never trained: nobody's place to take
    write_events(tmp_path, {"event": "train_begin", "node_rank": 0, "rank": 0})
    assert promotion_pending(record, status)
    membership = Path(record["run_dir"]) / "control" / "membership.json"
    membership.parent.mkdir(parents=True, exist_ok=True)
    membership.write_text(json.dumps({"launch_id": "1", "ts": time.time()}))
    assert not promotion_pending(record, status)
