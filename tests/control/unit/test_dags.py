"""The DAGs parse fast without torch, and their forms validate input before anything launches."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest

from control.support import MEASURED, REPO

PARSE = """
import importlib, json, pkgutil, sys, time
sys.modules["torch"] = None  # any import of torch now fails
t0 = time.perf_counter()
from airflow.dag_processing.dagbag import DagBag
t1 = time.perf_counter()
bag = DagBag(dag_folder=sys.argv[1])
seconds, airflow_import = time.perf_counter() - t1, t1 - t0
import fsdp_resilience.control, fsdp_resilience.training.contract as contract
modules = [m.name for m in pkgutil.walk_packages(fsdp_resilience.control.__path__, "fsdp_resilience.control.")]
modules += ["fsdp_resilience.training.contract"] + [
    m.name for m in pkgutil.walk_packages(getattr(contract, "__path__", []), "fsdp_resilience.training.contract.")]
for name in modules:
    importlib.import_module(name)
print(json.dumps({"seconds": seconds, "airflow_import": airflow_import, "dags": sorted(bag.dag_ids), "modules": modules,
                  "errors": {k: str(v) for k, v in bag.import_errors.items()}}))
"""


def test_dags_parse_without_torch_and_fast():
    out = subprocess.run([sys.executable, "-c", PARSE, str(REPO / "dags")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["errors"] == {}
    assert {"fsdp_training", "stage_dataset"} <= set(result["dags"])
    assert (
        "fsdp_resilience.control.backends.local" in result["modules"]
        and "fsdp_resilience.control.report" in result["modules"]
    )
    MEASURED.append(
        f"DAG parse of dags/ with torch blocked: {result['seconds']:.2f}s "
        f"(after {result['airflow_import']:.2f}s importing Airflow)"
    )


def test_no_control_plane_file_imports_torch():
    offenders = []
    control = REPO / "src" / "fsdp_resilience" / "control"
    for path in [*(REPO / "dags").rglob("*.py"), *(REPO / "plugins").rglob("*.py"), *control.rglob("*.py")]:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            stripped = line.strip()
            if stripped.startswith(("import torch", "from torch")):
                offenders.append(f"{path.relative_to(REPO)}:{n}")
    assert offenders == []


def _dag(dag_id):
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(REPO / "dags")).dags[dag_id]


@pytest.mark.parametrize("dag_id", ["fsdp_training", "stage_dataset", "node_maintenance"])
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
    order = [
        "validate_config",
        "stage_data",
        "launch_training",
        "watch_checkpoints",
        "escalation_1.decide",
        "escalation_1.diagnose_and_replace",
        "escalation_1.wait_for_capacity",
        "escalation_1.relaunch",
        "escalation_1.watch",
        "escalation_2.decide",
        "escalation_3.watch",
        "resolve_outcome",
        "evaluate",
        "build_report",
        "plan_export",
        "export_to_s3",
        "publish",
    ]
    for upstream, downstream in zip(order, order[1:]):
        assert upstream in dag.get_task(downstream).get_flat_relative_ids(upstream=True), (upstream, downstream)
    # One line at the default zoom: tasks pull the run config themselves, so no bundle of edges
    # fans out of validate_config. Two edges out of: the export branch, and each launch (its watch,
    # and beside it the keeper of its spare pool, a leaf nothing waits for).
    fan_out = {t.task_id: sorted(t.downstream_task_ids) for t in dag.tasks if len(t.downstream_task_ids) > 1}
    assert fan_out == {
        "plan_export": ["export_to_s3", "publish"],
        "launch_training": ["keep_spare_pool", "watch_checkpoints"],
        **{f"escalation_{r}.relaunch": [f"escalation_{r}.keep_spare_pool", f"escalation_{r}.watch"] for r in (1, 2, 3)},
    }, fan_out
    keepers = [t for t in dag.tasks if t.task_id.endswith("keep_spare_pool")]
    assert len(keepers) == 4 and all(not t.downstream_task_ids for t in keepers)
    # The rungs read only the watches: a rung waits for the watch before it, never for a keeper.
    assert dag.get_task("escalation_2.decide").upstream_task_ids == {"escalation_1.watch"}
    assert dag.get_task("resolve_outcome").upstream_task_ids == {"escalation_3.watch"}


def test_spare_nodes_is_a_bounded_form_field_that_reaches_the_run_config():
    from fsdp_resilience.training.contract import MAX_SPARE_NODES

    param = _dag("fsdp_training").params.get_param("spare_nodes")
    assert param.value == 0 and param.schema["section"] == "Where it runs"
    assert (param.schema["minimum"], param.schema["maximum"]) == (0, MAX_SPARE_NODES)
    assert "idle" in param.description and "lost node" in param.description
    from fsdp_resilience.control import ladder

    assert "spare_nodes" in ladder.FORM_FIELDS


def test_the_training_form_submits_with_its_defaults_and_reads_in_sections():
    params = _dag("fsdp_training").params
    # A field the UI treats as required is one whose default is empty and whose type has no null.
    for name, param in params.items():
        default, types = param.value, param.schema.get("type")
        types = types if isinstance(types, list) else [types]
        assert default not in (None, "") or "null" in types, f"{name}: an empty default must be nullable"
        assert param.schema.get("title") and param.schema.get("section"), f"{name} has no title or section"
    params.validate()  # the defaults themselves pass the schema
    sections = list(dict.fromkeys(p.schema["section"] for p in params.values()))
    assert sections == ["What to train", "Restarts and escalation", "Where it runs", "Drills and other settings"]


@pytest.mark.parametrize(
    "conf",
    [
        {"nodes": 0},
        {"nodes": -1},
        {"model": "70b-unknown"},
        {"dataset": "../x"},
        {"dataset": "/etc"},
        {"run_name": "Bad_Name"},
        {"run_config": {"run_dir": "/tmp/x"}},
        {"run_config": {"run_id": "other"}},
        {"run_config": {"dataset_dir": "/etc"}},
        {"run_config": {"rdzv_port": 22}},
        {"backend": "slurm"},
        {"spare_nodes": -1},
        {"spare_nodes": 9},
        {"spare_nodes": "1"},
    ],
)
def test_the_form_schema_refuses_what_it_can_express(conf):
    from airflow.sdk.exceptions import ParamValidationError

    # What a trigger does with a conf: each value resolved against its param's schema.
    params = copy.deepcopy(_dag("fsdp_training").params)
    with pytest.raises(ParamValidationError, match=f"Invalid input for param {next(iter(conf))}"):
        params.update(conf)


def test_stage_dataset_stages_a_folder_under_the_source_root_and_announces_it(tmp_path, monkeypatch):
    sources = tmp_path / "sources"
    src = sources / "text"
    src.mkdir(parents=True)
    for i in range(6):
        (src / f"doc{i}.txt").write_text(f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * 200)
    monkeypatch.setenv("FSDP_DATA_ROOT", str(tmp_path / "data"))
    monkeypatch.setenv("FSDP_SOURCE_ROOT", str(sources))
    from airflow.dag_processing.dagbag import DagBag

    dag = DagBag(dag_folder=str(REPO / "dags")).dags["stage_dataset"]
    dr = dag.test(run_conf={"source": "text", "dataset": "tiny-text", "val_fraction": 0.3})
    assert str(dr.state) == "success"
    index = json.loads((tmp_path / "data" / "tiny-text" / "index.json").read_text())
    assert index["train"] and index["val"]
    # Nothing outside the two roots is read or written: a missing folder, a path outside the
    # source root (absolute, by "..", by a symlink), a dataset name that is a symlink out.
    (sources / "escape").symlink_to(tmp_path)
    (tmp_path / "data" / "linked").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    for conf in (
        {"source": "missing", "dataset": "nothing"},
        {"source": str(tmp_path), "dataset": "abs"},
        {"source": "../", "dataset": "dotdot"},
        {"source": "escape", "dataset": "symlinked"},
        {"source": "text", "dataset": "linked"},
    ):
        bad = dag.test(run_conf=conf)
        states = {ti.task_id: str(ti.state) for ti in bad.get_task_instances()}
        assert str(bad.state) == "failed" and states["validate_source"] == "failed", (conf, states)
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["linked", "tiny-text"]
    assert not (tmp_path / "elsewhere").exists()
