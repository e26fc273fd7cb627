"""The pure FSx for Lustre helpers (``fsdp_resilience.control.fsx``): path mapping through data
repository associations, and the outcome of a data repository task. No AWS client is made."""

from __future__ import annotations

import pytest

from fsdp_resilience.control import fsx
from fsdp_resilience.control.fsx import FsxStagingError

from control.fakes.fsx_stubs import ASSOCIATIONS, DATASETS, DATASETS_EXTRA, RUNS, a_task

# -- paths ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path, association, fs_path",
    [
        ("s3://bucket/datasets/c4/", DATASETS, "/datasets/c4"),
        ("s3://bucket/datasets/c4/en/shard.bin", DATASETS, "/datasets/c4/en/shard.bin"),
        ("s3://bucket/datasets", DATASETS, "/datasets"),
        ("s3://bucket/datasets-extra/c4", DATASETS_EXTRA, "/extra/c4"),
        ("s3://bucket/exports/runs/r1/checkpoints/", RUNS, "/runs/r1/checkpoints"),
        ("/runs/r1/checkpoints", RUNS, "/runs/r1/checkpoints"),
        ("/datasets/c4/", DATASETS, "/datasets/c4"),
    ],
)
def test_paths_map_through_the_covering_association(path, association, fs_path):
    assert fsx.resolve_path(ASSOCIATIONS, path) == (association, fs_path)


def test_the_longest_association_wins_and_prefixes_match_whole_segments():
    root = {
        **DATASETS,
        "AssociationId": "dra-0123456789abcdef3",
        "DataRepositoryPath": "s3://bucket",
        "FileSystemPath": "/",
    }
    nested = {**DATASETS, "DataRepositoryPath": "s3://bucket/datasets/c4/", "FileSystemPath": "/c4"}
    assert fsx.resolve_path([root, nested], "s3://bucket/datasets/c4/en") == (nested, "/c4/en")
    assert fsx.resolve_path([root, nested], "s3://bucket/datasets/c40") == (root, "/datasets/c40")
    assert fsx.locate([DATASETS], "s3://bucket/datasets2/c4") is None
    assert fsx.locate([DATASETS], "s3://other-bucket/datasets/c4") is None


def test_bad_uris_and_paths_are_refused_with_an_example():
    with pytest.raises(FsxStagingError, match=r"not an S3 URI; give one like s3://"):
        fsx.resolve_path(ASSOCIATIONS, "s3:/bucket/datasets")
    with pytest.raises(FsxStagingError, match=r"'\.\.' segments"):
        fsx.resolve_path(ASSOCIATIONS, "/datasets/../etc")
    with pytest.raises(FsxStagingError, match="not an absolute file-system path"):
        fsx.resolve_path(ASSOCIATIONS, "datasets/c4")


# -- outcomes -----------------------------------------------------------------------------------


def test_a_failed_task_says_why_and_where_the_report_is():
    status, message = fsx.task_outcome(
        a_task(
            "FAILED",
            FailureDetails={"Message": "Access denied to s3://bucket/datasets/c4"},
            Report={"Enabled": True, "Path": "s3://bucket/datasets/reports"},
        )
    )
    assert status == "failed"
    assert "Access denied to s3://bucket/datasets/c4" in message and "s3://bucket/datasets/reports" in message


def test_a_task_that_succeeded_with_failed_files_is_a_failure():
    status, message = fsx.task_outcome(
        a_task(
            "SUCCEEDED",
            Status={"TotalCount": 40, "SucceededCount": 37, "FailedCount": 3},
            Report={"Enabled": True, "Path": "s3://bucket/datasets/reports"},
        )
    )
    assert status == "failed" and "3 of 40 files failed" in message and "s3://bucket/datasets/reports" in message
    status, message = fsx.task_outcome(
        a_task("SUCCEEDED", Status={"TotalCount": 40, "SucceededCount": 37, "FailedCount": 3})
    )
    assert status == "failed" and "give report_path" in message


def test_running_and_clean_outcomes():
    assert fsx.task_outcome(a_task("PENDING"))[0] == "running"
    assert fsx.task_outcome(a_task("CANCELING"))[0] == "running"
    assert fsx.task_outcome(a_task("CANCELED"))[0] == "failed"
    status, message = fsx.task_outcome(
        a_task("SUCCEEDED", Status={"TotalCount": 5, "SucceededCount": 5, "FailedCount": 0})
    )
    assert status == "succeeded" and "5 of 5 files" in message
