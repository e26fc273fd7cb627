"""FSx for Lustre staging against FSx's API: validation, idempotent data repository tasks
(``FsxHook``), the trigger and operator, and the stage_dataset DAG's EKS path.

FSx calls go to a real botocore client with a ``Stubber`` (moto has no data repository tasks), so
every request is checked against botocore's FSx model.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import re
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace

import pytest
from airflow.sdk.exceptions import AirflowFailException, TaskDeferred

from fsdp_resilience.control import fsx
from fsdp_resilience.control.fsx import FsxStagingError
from fsdp_resilience.control.hooks.fsx import FsxHook
from fsdp_resilience.control.operators.fsx import FsxDataRepositoryTaskOperator
from fsdp_resilience.control.triggers.fsx import FsxDataRepositoryTaskTrigger

from control.fakes.fsx_stubs import (  # noqa: F401  (stub is a fixture)
    ASSOCIATIONS,
    DATASETS,
    FS,
    FS_FILTER,
    REGION,
    RUNS,
    TASK,
    a_task,
    expect_associations,
    expect_create,
    expect_describe,
    expect_file_system,
    expect_in_flight,
    stub,
)
from control.support import REPO


def test_hook_resolves_paths_through_every_page_of_associations(stub):
    stub.add_response(
        "describe_data_repository_associations",
        {"Associations": [DATASETS], "NextToken": "bmV4dA=="},
        {"Filters": FS_FILTER, "MaxResults": 25},
    )
    stub.add_response(
        "describe_data_repository_associations",
        {"Associations": [RUNS]},
        {"Filters": FS_FILTER, "MaxResults": 25, "NextToken": "bmV4dA=="},
    )
    assert FsxHook().resolve_path(FS, "s3://bucket/exports/runs/r7") == (RUNS, "/runs/r7")


# -- clear errors before anything is created ----------------------------------------------------


def test_a_missing_file_system_is_named_with_its_region(stub):
    stub.add_client_error(
        "describe_file_systems",
        "FileSystemNotFound",
        "File system not found",
        400,
        expected_params={"FileSystemIds": [FS]},
    )
    with pytest.raises(FsxStagingError) as e:
        FsxHook().start_task("import", FS, ["s3://bucket/datasets/c4/"])
    assert FS in str(e.value) and REGION in str(e.value) and fsx.FILE_SYSTEM_ID_ENV in str(e.value)
    assert not e.value.retryable


def test_a_file_system_that_is_not_lustre_is_refused(stub):
    expect_file_system(stub, "ONTAP")
    with pytest.raises(FsxStagingError, match=f"{FS} is FSx for ONTAP, not FSx for Lustre"):
        FsxHook().start_task("import", FS, ["s3://bucket/datasets/c4/"])


def test_a_path_no_association_covers_is_refused_listing_the_associations(stub):
    expect_file_system(stub)
    expect_associations(stub)
    with pytest.raises(FsxStagingError) as e:
        FsxHook().start_task("import", FS, ["s3://elsewhere/c4/"])
    message = str(e.value)
    assert "no data repository association covers s3://elsewhere/c4/" in message
    for a in ASSOCIATIONS:
        assert f"{a['DataRepositoryPath']} <-> {a['FileSystemPath']}" in message
    assert "create-data-repository-association" in message


def test_an_association_that_is_not_available_is_refused(stub):
    expect_file_system(stub)
    expect_associations(
        stub, [{**DATASETS, "Lifecycle": "MISCONFIGURED", "FailureDetails": {"Message": "bucket policy denies FSx"}}]
    )
    with pytest.raises(FsxStagingError, match="is not AVAILABLE: bucket policy denies FSx"):
        FsxHook().start_task("import", FS, ["s3://bucket/datasets/c4/"])


def test_a_report_path_outside_the_associations_is_refused(stub):
    expect_file_system(stub)
    expect_associations(stub)
    with pytest.raises(FsxStagingError, match="report_path 's3://bucket/reports' must be an s3:// URI inside"):
        FsxHook().start_task("import", FS, ["s3://bucket/datasets/c4/"], report_path="s3://bucket/reports")


def test_another_running_task_is_a_retryable_error_that_says_what_to_wait_for(stub):
    expect_file_system(stub)
    expect_associations(stub)
    expect_in_flight(stub)
    stub.add_client_error("create_data_repository_task", "DataRepositoryTaskExecuting", "A task is executing", 400)
    with pytest.raises(FsxStagingError) as e:
        FsxHook().start_task("import", FS, ["s3://bucket/datasets/c4/"])
    assert e.value.retryable and "another data repository task is running" in str(e.value)


# -- idempotent creation ------------------------------------------------------------------------


def test_an_in_flight_task_for_the_same_paths_is_reused_not_queued_again(stub):
    expect_file_system(stub)
    expect_associations(stub)
    other_paths = a_task("EXECUTING", paths=["s3://bucket/datasets/wiki"], task_id="task-00000000000000001")
    export = a_task("PENDING", type_="EXPORT_TO_REPOSITORY", paths=["datasets/c4"], task_id="task-00000000000000002")
    ours = a_task("PENDING", paths=["s3://bucket/datasets/c4/"], task_id="task-00000000000000003")
    expect_in_flight(stub, [other_paths, export, ours])
    # No create_data_repository_task is queued: the Stubber would fail the call.
    assert FsxHook().start_task("import", FS, ["s3://bucket/datasets/c4"])["TaskId"] == "task-00000000000000003"


def test_an_import_is_created_with_the_shapes_fsx_wants(stub):
    expect_file_system(stub)
    expect_associations(stub)
    expect_in_flight(stub, [a_task("SUCCEEDED")])  # an ended task is history, not in flight
    token = fsx.request_token("import", FS, ["s3://bucket/datasets/c4/"], "dag.run.try1")
    report = {
        "Enabled": True,
        "Path": "s3://bucket/datasets/reports",
        "Format": "REPORT_CSV_20191124",
        "Scope": "FAILED_FILES_ONLY",
    }
    expect_create(stub, ["s3://bucket/datasets/c4/"], token=token, report=report, task_paths=a_task()["Paths"])
    task = FsxHook().start_task(
        "import", FS, ["/datasets/c4/"], report_path="s3://bucket/datasets/reports/", request_key="dag.run.try1"
    )
    assert task["TaskId"] == TASK
    assert re.fullmatch(r"[A-Za-z0-9_.-]{1,63}", token)
    assert token == fsx.request_token("import", FS, ["s3://bucket/datasets/c4/"], "dag.run.try1")
    assert token != fsx.request_token("import", FS, ["s3://bucket/datasets/c4/"], "dag.run.try2")


def test_an_export_names_paths_relative_to_the_file_system_root(stub):
    expect_file_system(stub)
    expect_associations(stub)
    expect_in_flight(stub)
    expect_create(stub, ["runs/r1/checkpoints", "runs/r1/eval.json"], "EXPORT_TO_REPOSITORY")
    FsxHook().start_task("export", FS, ["/runs/r1/eval.json", "s3://bucket/exports/runs/r1/checkpoints/"])


# -- the trigger ----------------------------------------------------------------------------------


def run_trigger(trigger):
    async def collect():
        return [event.payload async for event in trigger.run()]

    return asyncio.run(collect())


def test_the_trigger_waits_for_the_task_and_fires_once_on_success(stub):
    for lifecycle in ("PENDING", "EXECUTING"):
        expect_describe(stub, a_task(lifecycle))
    expect_describe(
        stub,
        a_task(
            "SUCCEEDED",
            Status={"TotalCount": 9, "SucceededCount": 9, "FailedCount": 0},
            EndTime=datetime(2025, 1, 1, 0, 5, tzinfo=timezone.utc),
        ),
    )
    events = run_trigger(FsxDataRepositoryTaskTrigger(task_id=TASK, file_system_id=FS, poll_interval_s=0))
    assert len(events) == 1
    assert events[0]["status"] == "success"
    assert events[0]["task"]["task_id"] == TASK and events[0]["task"]["succeeded_files"] == 9
    json.dumps(events[0])  # trigger events must be JSON-safe (no datetimes)


def test_the_trigger_reports_a_failed_task_with_its_reason(stub):
    expect_describe(stub, a_task("FAILED", FailureDetails={"Message": "The S3 prefix does not exist"}))
    [event] = run_trigger(FsxDataRepositoryTaskTrigger(task_id=TASK, file_system_id=FS, poll_interval_s=0))
    assert event["status"] == "failure" and "The S3 prefix does not exist" in event["message"]


def test_the_trigger_round_trips_through_serialize():
    trigger = FsxDataRepositoryTaskTrigger(
        task_id=TASK, file_system_id=FS, aws_conn_id="aws_fsx", region_name=REGION, poll_interval_s=12.5
    )
    classpath, kwargs = trigger.serialize()
    module, _, name = classpath.rpartition(".")
    again = getattr(importlib.import_module(module), name)(**json.loads(json.dumps(kwargs)))
    assert again.serialize() == (classpath, kwargs)


# -- the operator ---------------------------------------------------------------------------------


def context(try_number=1):
    return {
        "ti": SimpleNamespace(
            dag_id="stage_dataset", run_id="manual__1", task_id="import_to_fsx", map_index=-1, try_number=try_number
        )
    }


def test_the_operator_starts_the_task_then_defers_to_the_trigger(stub):
    expect_file_system(stub)
    expect_associations(stub)
    expect_in_flight(stub)
    token = fsx.request_token("import", FS, ["s3://bucket/datasets/c4/"], "stage_dataset.manual__1.import_to_fsx.-1.1")
    expect_create(stub, ["s3://bucket/datasets/c4/"], token=token, task_paths=a_task()["Paths"])
    op = FsxDataRepositoryTaskOperator(
        task_id="import_to_fsx",
        kind="import",
        file_system_id=FS,
        paths="s3://bucket/datasets/c4/",
        aws_conn_id="aws_fsx",
        poll_interval_s=7,
    )
    with pytest.raises(TaskDeferred) as deferred:
        op.execute(context())
    assert deferred.value.method_name == "execute_complete"
    assert deferred.value.trigger.serialize() == (
        "fsdp_resilience.control.triggers.fsx.FsxDataRepositoryTaskTrigger",
        {"task_id": TASK, "file_system_id": FS, "aws_conn_id": "aws_fsx", "region_name": None, "poll_interval_s": 7},
    )


def test_execute_complete_returns_the_summary_or_fails_with_the_message():
    op = FsxDataRepositoryTaskOperator(task_id="import_to_fsx", kind="import", file_system_id=FS, paths=[])
    summary = {"task_id": TASK, "lifecycle": "SUCCEEDED"}
    assert op.execute_complete(context(), {"status": "success", "message": "ok", "task": summary}) == summary
    with pytest.raises(AirflowFailException, match="3 of 40 files failed"):
        op.execute_complete(context(), {"status": "failure", "message": "... 3 of 40 files failed ...", "task": None})


def test_the_operator_polls_in_the_worker_when_not_deferrable(stub):
    expect_file_system(stub)
    expect_associations(stub)
    expect_in_flight(stub, [a_task("EXECUTING")])  # reused: a retry of the try that started it
    expect_describe(stub, a_task("SUCCEEDED", Status={"TotalCount": 2, "SucceededCount": 2, "FailedCount": 0}))
    op = FsxDataRepositoryTaskOperator(
        task_id="import_to_fsx",
        kind="import",
        file_system_id=FS,
        paths=["s3://bucket/datasets/c4"],
        deferrable=False,
        poll_interval_s=0,
    )
    assert op.execute(context(try_number=2))["lifecycle"] == "SUCCEEDED"


def test_a_configuration_error_fails_the_operator_without_retries(stub):
    expect_file_system(stub, "WINDOWS")
    op = FsxDataRepositoryTaskOperator(
        task_id="import_to_fsx", kind="import", file_system_id=FS, paths=["s3://bucket/datasets/c4"]
    )
    with pytest.raises(AirflowFailException, match="not FSx for Lustre"):
        op.execute(context())


# -- the stage_dataset DAG on EKS -----------------------------------------------------------------


def write_dataset(dst: Path) -> None:
    """A prepared dataset as fsdp_resilience.training.prepare_data writes it (format byte-tokens-v1)."""
    dst.mkdir(parents=True)
    for split, tokens in (("train", 300), ("val", 40)):
        (dst / f"{split}_00000.bin").write_bytes(b"\x01\x00" * tokens)
    (dst / "index.json").write_text(
        json.dumps(
            {
                "format": "byte-tokens-v1",
                "dtype": "uint16",
                "vocab_size": 256,
                "separator": 0,
                "train": [{"file": "train_00000.bin", "tokens": 300}],
                "val": [{"file": "val_00000.bin", "tokens": 40}],
                "sha256": "0" * 64,
            }
        )
    )


def test_stage_dataset_imports_an_s3_dataset_into_fsx_and_verifies_it(stub, tmp_path, monkeypatch):
    monkeypatch.setenv("FSDP_FSX_FILE_SYSTEM_ID", FS)
    monkeypatch.setenv("FSDP_FSX_MOUNT_PATH", str(tmp_path / "fsx"))
    write_dataset(tmp_path / "fsx" / "datasets" / "c4")  # what the import makes visible on the mount
    expect_file_system(stub)  # validate_source
    expect_associations(stub)
    expect_file_system(stub)  # import_to_fsx
    expect_associations(stub)
    expect_in_flight(stub)
    expect_create(stub, ["s3://bucket/datasets/c4/"], task_paths=a_task()["Paths"])
    expect_describe(stub, a_task("SUCCEEDED", Status={"TotalCount": 3, "SucceededCount": 3, "FailedCount": 0}))
    from airflow.dag_processing.dagbag import DagBag

    dag = DagBag(dag_folder=str(REPO / "dags" / "stage_dataset.py")).dags["stage_dataset"]
    dr = dag.test(run_conf={"backend": "eks", "source": "s3://bucket/datasets/c4/"})
    states = {ti.task_id: str(ti.state) for ti in dr.get_task_instances()}
    assert states == {
        "validate_source": "success",
        "choose_staging": "success",
        "prepare_shards": "skipped",
        "import_to_fsx": "success",
        "verify_dataset": "success",
    }
    summary = next(ti for ti in dr.get_task_instances() if ti.task_id == "verify_dataset").xcom_pull()
    assert summary["path"] == str(tmp_path / "fsx" / "datasets" / "c4") and summary["fs_path"] == "/datasets/c4"
    assert summary["train_tokens"] == 300 and summary["val_tokens"] == 40

    # A URI no association covers stops at validate_source, before any import.
    expect_file_system(stub)
    expect_associations(stub)
    bad = dag.test(run_conf={"backend": "eks", "source": "s3://bucket/elsewhere/c4/"})
    assert str(bad.state) == "failed"
    assert {ti.task_id: str(ti.state) for ti in bad.get_task_instances()}["validate_source"] == "failed"
