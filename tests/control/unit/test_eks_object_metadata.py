"""The metadata of the EKS backend's objects (eks/object_metadata.py): labels with cleaned ids,
annotations with the exact ids, and the owner reference to the launch's Job. (label_value's own
cases, and the labels on whole objects: test_eks_manifests.py.)"""

from __future__ import annotations

import pytest

from fsdp_resilience.control.backends.eks.constants import (
    ANNOTATION_AIRFLOW_RUN,
    ANNOTATION_LAUNCH,
    LABEL_AIRFLOW_RUN,
    LABEL_COMPONENT,
    LABEL_LAUNCH,
    LABEL_RUN,
    MANAGED_BY,
)
from fsdp_resilience.control.backends.eks.object_metadata import (
    check_ids,
    label_value,
    object_annotations,
    object_labels,
    object_metadata,
    owner_reference,
)
from fsdp_resilience.training.contract import RunConfig

AIRFLOW_RUN_ID = "manual__2026-11-30T07:35:43.123456+00:00"
CFG = RunConfig(run_id="run", run_dir="/fsx/runs/run", dataset_dir="/fsx/data")


def test_labels_carry_cleaned_ids_and_annotations_the_exact_ones():
    labels = object_labels(CFG, "training", "try:1", AIRFLOW_RUN_ID)
    assert labels == {
        **MANAGED_BY,
        LABEL_COMPONENT: "training",
        LABEL_RUN: "run",
        LABEL_LAUNCH: label_value("try:1"),
        LABEL_AIRFLOW_RUN: label_value(AIRFLOW_RUN_ID),
    }
    assert object_annotations("try:1", AIRFLOW_RUN_ID) == {
        ANNOTATION_LAUNCH: "try:1",
        ANNOTATION_AIRFLOW_RUN: AIRFLOW_RUN_ID,
    }
    assert LABEL_LAUNCH not in object_labels(CFG, "evaluation", None, None) and object_annotations(None, None) == {}
    assert "annotations" not in object_metadata("n", "ns", labels, {})
    assert object_metadata("n", "ns", {}, {"a": "b"}) == {
        "name": "n",
        "namespace": "ns",
        "labels": {},
        "annotations": {"a": "b"},
    }


@pytest.mark.parametrize("launch_id, airflow_run_id", [("", None), (" ", None), ("x" * 201, None), ("0", "")])
def test_bad_ids_are_refused(launch_id, airflow_run_id):
    with pytest.raises(ValueError, match="launch_id=|airflow_run_id="):
        check_ids(launch_id, airflow_run_id)


def test_the_owner_reference_names_the_created_job_and_refuses_another():
    ref = owner_reference({"metadata": {"name": "r-run-0", "uid": "u-1"}}, "r-run-0")
    assert ref == {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "name": "r-run-0",
        "uid": "u-1",
        "controller": True,
        "blockOwnerDeletion": False,
    }
    with pytest.raises(ValueError, match="with metadata.name and metadata.uid"):
        owner_reference({"metadata": {"name": "r-run-0"}}, "r-run-0")
    with pytest.raises(ValueError, match="owner is Job 'r-run-1', but this launch's Job is 'r-run-0'"):
        owner_reference({"metadata": {"name": "r-run-1", "uid": "u"}}, "r-run-0")
