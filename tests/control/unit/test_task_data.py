"""The fsdp_training DAG's task data (``control.task_data``): ``Run``, ``Launch`` and ``Outcome``
go through XCom as JSON-able dicts and come back equal, and a dict that is not one says which keys
are missing or unknown."""

from __future__ import annotations

import json

import pytest

from fsdp_resilience.control.task_data import Launch, Outcome, Run, TaskDataError

RUN = Run(
    config={"run_id": "r1", "run_dir": "/runs/r1", "nodes": 2, "spare_nodes": 1},
    backend={"name": "local", "state_dir": "/var/lib/fsdp"},
    max_node_replacements=2,
    airflow_run_id="manual__1",
)
LAUNCH = Launch(
    backend=RUN.backend,
    handle={"backend": "local", "run_id": "r1", "launch_id": "1", "job_name": "r1-1", "extra": {"submitted_at": 1.5}},
    run_dir="/runs/r1",
    final_step=60,
    stall_timeout_s=1800.0,
    launched_at=1.5,
)
OUTCOME = Outcome(
    outcome="failed",
    failure_class="restarts_exhausted",
    message="node 1 gave up",
    step=20,
    checkpoint_id="step_00000020",
    launch_id="1",
    handle=LAUNCH.handle,
    job_state="failed",
    last_progress_at=12.0,
    nodes=[{"index": 1, "node_id": "slot-1", "state": "failed"}],
)


@pytest.mark.parametrize("data", [RUN, LAUNCH, OUTCOME], ids=lambda d: type(d).__name__)
def test_task_data_round_trips_through_json_as_xcom_stores_it(data):
    stored = json.loads(json.dumps(data.to_dict()))
    assert type(data).from_dict(stored) == data
    assert type(data).of(stored) == data and type(data).of(data) is data


def test_optional_fields_may_be_left_out():
    # What the bench and older tests write: no Airflow run, no S3 export of the run dir.
    run = Run.from_dict({"config": {}, "backend": {"name": "local"}, "max_node_replacements": 1})
    assert run.airflow_run_id is None
    launch = Launch.from_dict({k: v for k, v in LAUNCH.to_dict().items() if k not in ("checkpoints_s3", "aws_conn_id")})
    assert launch.checkpoints_s3 is None and launch.launch_id == "1"
    running = Outcome.from_dict({k: v for k, v in OUTCOME.to_dict().items() if k != "nodes"} | {"outcome": None})
    assert running.nodes == [] and running.outcome is None


def test_a_dict_that_is_not_the_task_data_says_which_keys_do_not_fit():
    with pytest.raises(
        TaskDataError, match=r"not Run task data: missing backend, max_node_replacements \(keys: airflow_run_id"
    ):
        Run.from_dict({"config": {}})
    with pytest.raises(TaskDataError, match="not Launch task data: unknown status"):
        Launch.from_dict({**LAUNCH.to_dict(), "status": "success"})
    # A trigger event is not an Outcome until its status is taken off.
    with pytest.raises(TaskDataError, match="not Outcome task data: unknown status"):
        Outcome.from_dict({"status": "failure", **OUTCOME.to_dict()})
    with pytest.raises(TaskDataError, match="Outcome comes from a dict .* got NoneType"):
        Outcome.from_dict(None)
    with pytest.raises(TaskDataError, match="missing handle, launch_id"):
        Outcome.from_dict({k: v for k, v in OUTCOME.to_dict().items() if k not in ("handle", "launch_id")})
