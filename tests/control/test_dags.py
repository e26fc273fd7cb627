"""The DAGs parse fast without torch, and their forms validate input before anything launches."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import MEASURED, REPO

PARSE = """
import importlib, json, pkgutil, sys, time
sys.modules["torch"] = None  # any import of torch now fails
t0 = time.perf_counter()
from airflow.dag_processing.dagbag import DagBag
t1 = time.perf_counter()
bag = DagBag(dag_folder=sys.argv[1])
seconds, airflow_import = time.perf_counter() - t1, t1 - t0
import fsdp_resilience
modules = [m.name for m in pkgutil.walk_packages(fsdp_resilience.__path__, "fsdp_resilience.")]
for name in modules:
    importlib.import_module(name)
print(json.dumps({"seconds": seconds, "airflow_import": airflow_import, "dags": sorted(bag.dag_ids), "modules": modules,
                  "errors": {k: str(v) for k, v in bag.import_errors.items()}}))
"""


def test_dags_parse_without_torch_and_fast():
    env = {**os.environ, "PYTHONPATH": str(REPO / "plugins")}
    out = subprocess.run([sys.executable, "-c", PARSE, str(REPO / "dags")], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["errors"] == {}
    assert result["dags"] == ["fsdp_training", "stage_dataset"]
    assert "fsdp_resilience.backends.local" in result["modules"] and "fsdp_resilience.report" in result["modules"]
    MEASURED.append(f"DAG parse of dags/ with torch blocked: {result['seconds']:.2f}s "
                    f"(after {result['airflow_import']:.2f}s importing Airflow)")


def test_no_control_plane_file_imports_torch():
    offenders = []
    for path in list((REPO / "dags").rglob("*.py")) + list((REPO / "plugins").rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            stripped = line.strip()
            if stripped.startswith(("import torch", "from torch")):
                offenders.append(f"{path.relative_to(REPO)}:{n}")
    assert offenders == []


def _dag(dag_id):
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(REPO / "dags")).dags[dag_id]


@pytest.mark.parametrize("dag_id", ["fsdp_training", "stage_dataset"])
def test_every_param_has_a_type_bounds_and_a_description(dag_id):
    for name, param in _dag(dag_id).params.items():
        schema = param.schema
        assert param.description, f"{dag_id}.{name} has no description"
        assert "type" in schema or "enum" in schema, f"{dag_id}.{name} has no type"
        if schema.get("type") == "integer":
            assert "minimum" in schema and "maximum" in schema, f"{dag_id}.{name} is unbounded"


def test_the_training_graph_reads_top_to_bottom():
    dag = _dag("fsdp_training")
    assert dag.schedule is None  # no schedule unless FSDP_TRAINING_SCHEDULE says so
    order = ["validate_config", "stage_data", "launch_training", "watch_checkpoints",
             "escalation_1.decide", "escalation_1.diagnose_and_replace", "escalation_1.relaunch",
             "escalation_1.watch", "escalation_2.decide", "escalation_3.watch", "resolve_outcome",
             "evaluate", "build_report", "plan_export", "export_to_s3", "publish"]
    for upstream, downstream in zip(order, order[1:]):
        assert upstream in dag.get_task(downstream).get_flat_relative_ids(upstream=True), (upstream, downstream)


def test_stage_dataset_stages_a_folder_and_announces_it(tmp_path, monkeypatch):
    src = tmp_path / "text"
    src.mkdir()
    for i in range(6):
        (src / f"doc{i}.txt").write_text(f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * 200)
    monkeypatch.setenv("FSDP_DATA_ROOT", str(tmp_path / "data"))
    from airflow.dag_processing.dagbag import DagBag

    dag = DagBag(dag_folder=str(REPO / "dags")).dags["stage_dataset"]
    dr = dag.test(run_conf={"source": str(src), "dataset": "tiny-text", "val_fraction": 0.3})
    assert str(dr.state) == "success"
    index = json.loads((tmp_path / "data" / "tiny-text" / "index.json").read_text())
    assert index["train"] and index["val"]
    bad = dag.test(run_conf={"source": str(tmp_path / "missing"), "dataset": "nothing"})
    assert str(bad.state) == "failed" and not (tmp_path / "data" / "nothing").exists()
