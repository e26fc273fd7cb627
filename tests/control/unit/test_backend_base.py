"""The backend interface (base.py): job names, JSON round trips, the registry.
No processes start here; the local backend's real jobs are in tests/control/integration/test_local_backend.py."""

from __future__ import annotations

import json
import sys

import pytest

from fsdp_resilience.control.backends import (
    BackendError,
    Capacity,
    Diagnosis,
    JobHandle,
    JobStatus,
    LocalProcessBackend,
    NodeStatus,
    Replacement,
    TrainingBackend,
    get_backend,
    job_name_for,
)


def test_job_names_are_deterministic_dns_labels():
    name = job_name_for("my-run", "manual__2026-11-30T05:15:00+00:00")
    assert name == job_name_for("my-run", "manual__2026-11-30T05:15:00+00:00")
    assert name.startswith("my-run-manual-2026-11-30t05-15-00-00-00-")
    long = job_name_for("r" * 63, "launch-" + "x" * 100)
    for n in (name, long, job_name_for("a", "1"), job_name_for("a-b", "c"), job_name_for("a", "b-c")):
        assert len(n) <= 63 and n[0].isalnum() and n[-1].isalnum()
        assert all(c.islower() or c.isdigit() or c == "-" for c in n)
    # readable parts that coincide still give distinct names
    assert job_name_for("a-b", "c") != job_name_for("a", "b-c")
    assert job_name_for("run", "1") != job_name_for("run", "2")


def test_results_survive_json_for_xcom_and_triggers():
    handle = JobHandle("local", "r", "1", job_name_for("r", "1"), {"state_dir": "/s", "node_ids": ["slot-0"]})
    status = JobStatus(
        "failed",
        "restarts_exhausted",
        {0: 75, 1: None},
        "node 1 lost",
        [
            NodeStatus(0, "slot-0", "failed", "restarts_exhausted", 75, "gave up"),
            NodeStatus(1, "slot-1", "lost", "restarts_exhausted", None, "node lost"),
        ],
    )
    values = [
        handle,
        status,
        Diagnosis("restarts_exhausted", ["slot-1"], True, ["node lost"]),
        Replacement(["slot-1"], [], "quarantined"),
        Capacity(4, 3, ["slot-1"], ["slot-0", "slot-2", "slot-3"]),
    ]
    for value in values:
        again = type(value).from_dict(json.loads(json.dumps(value.to_dict())))
        assert again == value
    assert json.loads(json.dumps(status.to_dict()))["exit_codes"] == {"0": 75, "1": None}
    assert status.done and not JobStatus("running").done


def test_backends_are_built_by_name_and_from_their_config(tmp_path):
    b = get_backend("local", state_dir=str(tmp_path / "state"), slots=3, training_python=sys.executable)
    assert isinstance(b, LocalProcessBackend) and b.slots == 3
    config = json.loads(json.dumps(b.to_config()))  # what travels to the triggerer
    for again in (get_backend(**config), TrainingBackend.from_config(config), LocalProcessBackend.from_config(config)):
        assert isinstance(again, LocalProcessBackend) and again.to_config() == b.to_config()
    with pytest.raises(BackendError, match="unknown training backend 'slurm'"):
        get_backend("slurm")
    eks = get_backend("eks", image="registry/fsdp:1", namespace="team-a")  # imported on first use
    assert get_backend(**json.loads(json.dumps(eks.to_config()))).to_config() == eks.to_config()
    with pytest.raises(BackendError, match="belongs to the 'eks' backend"):
        b.status(JobHandle("eks", "r", "1", "r-1"))
