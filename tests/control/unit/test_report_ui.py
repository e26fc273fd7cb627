"""The report app's own rules, without a server (the deployment test runs it in the real API server):
what a DAG run's conf can name, and that event text is never HTML."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from fastapi import HTTPException

from fsdp_resilience.control.ladder import run_id_for
from fsdp_resilience.control.ui import app as ui


def test_event_text_is_shown_as_text_never_as_html_or_a_link():
    html = ui._markdown().render(
        "| a | b |\n|---|---|\n| <script>alert(1)</script> | ![x](http://elsewhere/x.png) [y](javascript:1) |\n"
    )
    assert "<script>" not in html and "&lt;script&gt;" in html
    assert "<img" not in html and "<a " not in html


def test_a_dag_run_names_its_run_dir_under_the_runs_root_only(tmp_path, monkeypatch):
    monkeypatch.setenv("FSDP_RUNS_ROOT", str(tmp_path))
    named = SimpleNamespace(run_id="manual__2026-12-05T04:00:00+00:00", conf={"run_name": "my-run"})
    assert ui.run_dir_of(named) == str(tmp_path.resolve() / "my-run")
    derived = SimpleNamespace(run_id="scheduled__2026-12-05T04:00:00+00:00", conf={})
    assert ui.run_dir_of(derived) == str(tmp_path.resolve() / run_id_for(derived.run_id, None))
    for bad in ("../etc", "/etc", "A_B", 7):
        with pytest.raises(HTTPException) as refused:
            ui.run_dir_of(SimpleNamespace(run_id="r", conf={"run_name": bad}))
        assert refused.value.status_code == 404


def test_only_the_training_dags_have_a_report(monkeypatch):
    with pytest.raises(HTTPException) as refused:
        ui._training_dag("stage_dataset")
    assert refused.value.status_code == 404 and "FSDP_REPORT_DAG_IDS" in refused.value.detail
    monkeypatch.setenv("FSDP_REPORT_DAG_IDS", "fsdp_training, nightly_llama")
    ui._training_dag("nightly_llama")
