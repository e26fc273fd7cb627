"""FSx for Lustre's API as the tests see it: a real botocore FSx client behind a ``Stubber``
(moto has no data repository tasks), so every request is checked against botocore's FSx model,
and the file system, associations and tasks the tests expect."""

from __future__ import annotations

from datetime import datetime, timezone

import boto3
import pytest
from botocore.stub import ANY, Stubber

from fsdp_resilience.control.hooks.fsx import FsxHook

REGION = "eu-west-1"
FS = "fs-0123456789abcdef0"
TASK = "task-0123456789abcdef0"
DATASETS = {
    "AssociationId": "dra-0123456789abcdef0",
    "FileSystemId": FS,
    "Lifecycle": "AVAILABLE",
    "FileSystemPath": "/datasets",
    "DataRepositoryPath": "s3://bucket/datasets/",
}
RUNS = {
    "AssociationId": "dra-0123456789abcdef1",
    "FileSystemId": FS,
    "Lifecycle": "AVAILABLE",
    "FileSystemPath": "/runs/",
    "DataRepositoryPath": "s3://bucket/exports/runs",
}
# Same bucket, a name that starts like "datasets": must not be mistaken for a folder of it.
DATASETS_EXTRA = {
    "AssociationId": "dra-0123456789abcdef2",
    "FileSystemId": FS,
    "Lifecycle": "AVAILABLE",
    "FileSystemPath": "/extra",
    "DataRepositoryPath": "s3://bucket/datasets-extra/",
}
ASSOCIATIONS = [DATASETS, RUNS, DATASETS_EXTRA]
FS_FILTER = [{"Name": "file-system-id", "Values": [FS]}]
IN_FLIGHT_FILTER = FS_FILTER + [{"Name": "task-lifecycle", "Values": ["PENDING", "EXECUTING"]}]


def a_task(
    lifecycle="EXECUTING",
    type_="IMPORT_METADATA_FROM_REPOSITORY",
    paths=("s3://bucket/datasets/c4",),
    task_id=TASK,
    **extra,
):
    return {
        "TaskId": task_id,
        "Lifecycle": lifecycle,
        "Type": type_,
        "FileSystemId": FS,
        "Paths": list(paths),
        "CreationTime": datetime(2025, 1, 1, tzinfo=timezone.utc),
        **extra,
    }


@pytest.fixture()
def stub(monkeypatch):
    """The FSx client every FsxHook uses in this test, with a Stubber that fails on any call not queued."""
    client = boto3.client("fsx", region_name=REGION, aws_access_key_id="testing", aws_secret_access_key="testing")
    monkeypatch.setattr(FsxHook, "conn", property(lambda self: client))
    with Stubber(client) as stubber:
        yield stubber
        stubber.assert_no_pending_responses()


def expect_file_system(stub, type_="LUSTRE"):
    stub.add_response(
        "describe_file_systems",
        {"FileSystems": [{"FileSystemId": FS, "FileSystemType": type_, "Lifecycle": "AVAILABLE"}]},
        {"FileSystemIds": [FS]},
    )


def expect_associations(stub, associations=ASSOCIATIONS):
    stub.add_response(
        "describe_data_repository_associations",
        {"Associations": associations},
        {"Filters": FS_FILTER, "MaxResults": 25},
    )


def expect_in_flight(stub, tasks=()):
    stub.add_response(
        "describe_data_repository_tasks", {"DataRepositoryTasks": list(tasks)}, {"Filters": IN_FLIGHT_FILTER}
    )


def expect_describe(stub, task):
    stub.add_response("describe_data_repository_tasks", {"DataRepositoryTasks": [task]}, {"TaskIds": [task["TaskId"]]})


def expect_create(stub, paths, type_="IMPORT_METADATA_FROM_REPOSITORY", token=ANY, report=None, task_paths=None):
    """create_data_repository_task for exactly ``paths`` (``report``: its Report, default off; ``token``:
    its ClientRequestToken), answered with a PENDING task (of ``task_paths``, default ``paths``)."""
    stub.add_response(
        "create_data_repository_task",
        {"DataRepositoryTask": a_task("PENDING", type_, task_paths or paths)},
        {
            "Type": type_,
            "FileSystemId": FS,
            "Paths": list(paths),
            "Report": report or {"Enabled": False},
            "ClientRequestToken": token,
        },
    )
