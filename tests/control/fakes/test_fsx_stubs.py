"""The FSx stubs: a real botocore FSx client behind a Stubber, so each queued response and each
request is checked against botocore's FSx model, and any call not queued fails."""

from __future__ import annotations

import botocore.exceptions
import pytest
from botocore.stub import Stubber

from control.fakes import fsx_stubs
from control.fakes.fsx_stubs import FS, a_task, expect_associations, expect_describe, expect_file_system, stub  # noqa: F401


def test_queued_responses_answer_the_hooks_client(stub):  # noqa: F811
    expect_file_system(stub)
    expect_associations(stub)
    task = a_task(lifecycle="SUCCEEDED")
    expect_describe(stub, task)
    client = fsx_stubs.FsxHook(aws_conn_id=None, region_name=fsx_stubs.REGION).conn
    assert client.describe_file_systems(FileSystemIds=[FS])["FileSystems"][0]["FileSystemType"] == "LUSTRE"
    paths = [
        a["FileSystemPath"]
        for a in client.describe_data_repository_associations(Filters=fsx_stubs.FS_FILTER, MaxResults=25)[
            "Associations"
        ]
    ]
    assert paths == ["/datasets", "/runs/", "/extra"]
    described = client.describe_data_repository_tasks(TaskIds=[task["TaskId"]])["DataRepositoryTasks"]
    assert described[0]["Lifecycle"] == "SUCCEEDED"


def test_a_call_that_was_not_queued_fails(stub):  # noqa: F811
    client = fsx_stubs.FsxHook(aws_conn_id=None, region_name=fsx_stubs.REGION).conn
    with pytest.raises(botocore.exceptions.StubResponseError):
        client.describe_file_systems(FileSystemIds=[FS])


def test_a_task_matches_botocores_fsx_model():
    import boto3

    client = boto3.client("fsx", region_name=fsx_stubs.REGION, aws_access_key_id="x", aws_secret_access_key="x")
    with Stubber(client) as stubber:  # the Stubber validates responses against the service model
        stubber.add_response("describe_data_repository_tasks", {"DataRepositoryTasks": [a_task()]})
        assert client.describe_data_repository_tasks()["DataRepositoryTasks"][0]["Lifecycle"] == "EXECUTING"
