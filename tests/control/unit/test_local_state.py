"""The local backend's state on disk (backends/local/state.py): job records, slots, the record's shape."""

from __future__ import annotations

import json

import pytest

from fsdp_resilience.control.backends import BackendError, JobNotFoundError
from fsdp_resilience.control.backends.local.processes import JOB_TAG_ENV
from fsdp_resilience.control.backends.local.state import (
    LAUNCH_ID_ENV,
    RECORD_VERSION,
    StateStore,
    new_job_record,
    node_entry,
    read_json,
    tail_lines,
)
from fsdp_resilience.training.contract import NODE_ID_ENV, RunConfig


def test_job_records_round_trip_and_update_under_the_lock(tmp_path):
    store = StateStore(tmp_path / "state")
    assert store.jobs() == [] and store.read_job("nope") is None
    store.write_job({"job_name": "b", "n": 1})
    store.write_job({"job_name": "a", "n": 2})
    assert [r["job_name"] for r in store.jobs()] == ["a", "b"]  # sorted by file name
    assert store.job_path("a") == tmp_path / "state" / "jobs" / "a.json"
    changed = store.update_job("a", lambda r: r.update(n=3))
    assert changed["n"] == 3 and store.read_job("a")["n"] == 3
    with pytest.raises(JobNotFoundError, match="no local job gone"):
        store.update_job("gone", lambda r: None)
    assert (tmp_path / "state" / ".lock").exists()


def test_slots_are_kept_in_one_file_and_quarantined_ones_listed(tmp_path):
    store = StateStore(tmp_path / "state")
    assert store.read_slots() == {} and store.quarantined() == []
    store.write_slots({"slot-0": {"state": "healthy"}, "slot-1": {"state": "quarantined", "reason": "bad"}})
    assert store.quarantined() == ["slot-1"]
    assert json.loads((tmp_path / "state" / "slots.json").read_text())["slots"]["slot-1"]["reason"] == "bad"


def test_an_unreadable_state_file_says_which_and_a_non_object_reads_as_none(tmp_path):
    torn = tmp_path / "torn.json"
    torn.write_text('{"job_name": ')
    with pytest.raises(BackendError, match="torn.json is unreadable"):
        read_json(torn)
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    assert read_json(listed) is None and read_json(tmp_path / "missing.json") is None


def test_tail_lines_reads_the_end_of_a_log(tmp_path):
    log = tmp_path / "node.log"
    log.write_text("".join(f"line {i}\n" for i in range(5000)))
    assert tail_lines(log, 3) == "line 4997\nline 4998\nline 4999"
    assert tail_lines(log, 0) == "" and tail_lines(tmp_path / "none.log", 10) == ""


def test_a_new_job_record_holds_what_the_supervisor_starts(tmp_path):
    store = StateStore(tmp_path / "state")
    cfg = RunConfig(
        run_id="r", run_dir=str(tmp_path / "runs" / "r"), dataset_dir=str(tmp_path / "data"), nodes=2, spare_nodes=1
    )
    record = new_job_record(
        store,
        cfg,
        "try/1",
        "r-try-1-abc",
        ["slot-0", "slot-2", "slot-3"],
        "/py",
        cwd=tmp_path,
        failure_grace_s=30.0,
        cancel_grace_s=20.0,
        start_timeout_s=60.0,
    )
    assert record["version"] == RECORD_VERSION and record["train_nodes"] == 2 and record["cwd"] == str(tmp_path)
    assert record["config_path"].endswith("try_1-abc.json")  # a launch id unsafe in a file name, kept unique
    assert record["supervisor"]["log_path"] == str(store.jobs_dir / "r-try-1-abc.supervisor.log")
    assert [(n["index"], n["node_id"], n["standby"]) for n in record["nodes"]] == [
        (0, "slot-0", False),
        (1, "slot-2", False),
        (2, "slot-3", True),
    ]
    assert record["cancel"] is None and record["error"] is None


def test_a_node_entry_runs_the_launcher_tagged_with_its_job(tmp_path):
    node = node_entry(
        "/venv/bin/python",
        "job",
        "1",
        "/run/launches/1.json",
        str(tmp_path),
        3,
        "slot-3",
        standby=True,
        added_reason="refill",
    )
    assert node["command"] == [
        "/venv/bin/python",
        "-m",
        "fsdp_resilience.training.launch",
        "--config",
        "/run/launches/1.json",
        "--node-rank",
        "3",
        "--rdzv-host",
        "127.0.0.1",
    ]
    assert node["env"] == {LAUNCH_ID_ENV: "1", NODE_ID_ENV: "slot-3", "PYTHONUNBUFFERED": "1", JOB_TAG_ENV: "job/3"}
    assert node["log_path"] == str(tmp_path / "logs" / "job-node3.log")
    assert node["added_reason"] == "refill" and node["pid"] is None and node["exit_code"] is None
