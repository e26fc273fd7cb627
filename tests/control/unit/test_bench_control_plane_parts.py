"""Pieces of the control-plane benchmark (bench/control_plane/): the private Airflow home, the
stand-in job the watch latency is timed against, and the overlap the slot figure sums."""

from __future__ import annotations

import pytest

from bench.control_plane.__main__ import airflow_env
from bench.control_plane.watch_latency import RunDirJob
from bench.control_plane.worker_slots import _overlap


def test_the_airflow_home_is_private_to_the_work_dir(tmp_path):
    env = airflow_env(tmp_path)
    assert env["AIRFLOW_HOME"] == str(tmp_path / "airflow-home")
    assert env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].endswith(str(tmp_path / "airflow-home" / "airflow.db"))
    assert env["FSDP_RUNS_ROOT"] == str(tmp_path / "runs")


def test_the_stand_in_job_runs_until_the_benchmark_says_otherwise(tmp_path):
    job = RunDirJob(str(tmp_path))
    assert job.status(None).state == "running"
    (tmp_path / "state").write_text("succeeded\n")
    status = job.status(None)
    assert status.state == "succeeded" and status.failure_class == "success"
    with pytest.raises(NotImplementedError):
        job.cancel(None)


def test_overlap_of_two_intervals():
    assert _overlap((0.0, 10.0), (5.0, 20.0)) == 5.0
    assert _overlap((0.0, 1.0), (2.0, 3.0)) == 0.0
