"""The report view of a training DAG run, and the fleet page of every run of the DAG, served by the
Airflow API server under ``/fsdp-report`` (``control.plugin`` registers the app, and the views
that put them in the UI: a "Training report" tab on each DAG run, a "Training fleet" tab on the DAG).

Every route needs Airflow's own login (the UI's ``_token`` cookie, or a bearer token: 401
without) and, through the deployment's auth manager, read access to the DAG's runs (403 without):
a plugin's routes get no auth from Airflow unless they ask for it. Pages are static; their data
comes from ``/api/...``, which tops the run's events up from its ``EventFeed`` on each look.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path
from typing import Any

from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity
from airflow.api_fastapi.common.db.common import SessionDep
from airflow.api_fastapi.core_api.security import GetUserDep, requires_access_dag
from airflow.models.dagrun import DagRun
from fastapi import Depends, FastAPI, HTTPException, Query
from fastapi.responses import FileResponse, HTMLResponse
from sqlalchemy import select

from fsdp_resilience.control import settings
from fsdp_resilience.control.backends import TrainingBackend
from fsdp_resilience.control.report.live import LiveReports, numbers_only

STATIC = Path(__file__).parent / "static"
#: The run names the DAG accepts (``run_name``'s pattern): nothing else becomes a path.
RUN_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")

reports = LiveReports()
can_read_runs = Depends(requires_access_dag("GET", DagAccessEntity.RUN))

app = FastAPI(
    title="FSDP training reports",
    description="The run report and fleet page of the fsdp_training DAG (fsdp_resilience).",
    docs_url=None,
    redoc_url=None,
)


def _training_dag(dag_id: str) -> None:
    if dag_id not in settings.report_dag_ids():
        raise HTTPException(
            404,
            f"DAG {dag_id!r} does not train with fsdp_resilience: the training report covers "
            f"{', '.join(sorted(settings.report_dag_ids()))} (FSDP_REPORT_DAG_IDS)",
        )


def run_dir_of(dag_run: DagRun) -> str:
    """The run dir a DAG run trains in: as validate_config names it (``ladder.run_id_for``), under
    the runs root. A conf that names something else (it passed no schema) is refused."""
    from fsdp_resilience.control.ladder import run_id_for

    conf = dag_run.conf if isinstance(dag_run.conf, dict) else {}
    name = conf.get("run_name") or None
    if name is not None and (not isinstance(name, str) or not RUN_NAME.match(name)):
        raise HTTPException(404, f"DAG run {dag_run.run_id!r} has run_name {name!r}, which names no run dir")
    return str(settings.under_root(settings.runs_root(), run_id_for(dag_run.run_id, name), what="run"))


@cache
def _backend(name: str) -> TrainingBackend:
    return TrainingBackend.from_config(settings.backend_config(name))


def _report(dag_run: DagRun):
    conf = dag_run.conf if isinstance(dag_run.conf, dict) else {}
    try:
        backend = _backend(settings.backend_name(conf.get("backend")))
    except ValueError as e:
        raise HTTPException(404, str(e)) from None
    run_dir = run_dir_of(dag_run)
    return reports.get(run_dir, lambda: backend.event_feed(run_dir))


@cache
def _markdown():
    from markdown_it import MarkdownIt

    # html=False: the events log's text (error messages, reasons) is shown, never run as HTML;
    # and no links or images: nothing in a log may make the page load or point elsewhere.
    return MarkdownIt("commonmark", {"html": False}).enable("table").disable(["image", "link", "autolink"])


def _airflow_state(dag_run: DagRun) -> dict[str, Any]:
    return {
        "dag_id": dag_run.dag_id,
        "dag_run_id": dag_run.run_id,
        "state": str(dag_run.state.value if hasattr(dag_run.state, "value") else dag_run.state),
        "start_date": dag_run.start_date.isoformat() if dag_run.start_date else None,
        "end_date": dag_run.end_date.isoformat() if dag_run.end_date else None,
    }


#: no-store: a page behind a login is never served from a shared cache to someone else. The
#: policy: scripts and styles from here only (the pages have no inline script), shown only in
#: Airflow's own UI.
HEADERS = {
    "Cache-Control": "no-store",
    "Content-Security-Policy": "default-src 'self'; style-src 'self' 'unsafe-inline'; frame-ancestors 'self'",
    "X-Content-Type-Options": "nosniff",
}


def _page(name: str) -> HTMLResponse:
    return HTMLResponse((STATIC / name).read_text(), headers=HEADERS)


@app.get("/runs/{dag_id}/{run_id}", response_class=HTMLResponse, dependencies=[can_read_runs])
def report_page(dag_id: str, run_id: str) -> HTMLResponse:
    """The report view of one DAG run (the run's "Training report" tab)."""
    _training_dag(dag_id)
    return _page("report.html")


@app.get("/dags/{dag_id}/fleet", response_class=HTMLResponse, dependencies=[can_read_runs])
def fleet_page(dag_id: str) -> HTMLResponse:
    """Every run of the DAG (the DAG's "Training fleet" tab)."""
    _training_dag(dag_id)
    return _page("fleet.html")


@app.get("/assets/{name}")
def asset(name: str, user: GetUserDep) -> FileResponse:
    """The pages' script and style (logged-in users only, like everything here)."""
    if name not in {"report.js", "fleet.js", "common.js", "style.css"}:
        raise HTTPException(404, f"no asset {name!r}")
    return FileResponse(STATIC / name, headers=HEADERS)


@app.get("/api/runs/{dag_id}/{run_id}", dependencies=[can_read_runs])
def report_data(dag_id: str, run_id: str, session: SessionDep) -> dict[str, Any]:
    """The report of one DAG run as the view draws it, read up to now."""
    _training_dag(dag_id)
    dag_run = session.scalar(select(DagRun).where(DagRun.dag_id == dag_id, DagRun.run_id == run_id))
    if dag_run is None:
        raise HTTPException(404, f"DAG {dag_id!r} has no run {run_id!r}")
    report = _report(dag_run)
    return numbers_only({**report.view(_markdown().render), "airflow": _airflow_state(dag_run)})


@app.get("/api/dags/{dag_id}/fleet", dependencies=[can_read_runs])
def fleet_data(dag_id: str, session: SessionDep, limit: int = Query(50, ge=1, le=500)) -> dict[str, Any]:
    """The newest ``limit`` runs of the DAG, one row each, and the nodes their escalations replaced."""
    _training_dag(dag_id)
    dag_runs = session.scalars(
        select(DagRun).where(DagRun.dag_id == dag_id).order_by(DagRun.id.desc()).limit(limit)
    ).all()
    rows, nodes = [], {}
    for dag_run in dag_runs:
        try:
            brief = _report(dag_run).brief()
        except HTTPException as e:
            brief = {"state": "unknown", "message": e.detail}
        rows.append({**brief, "airflow": _airflow_state(dag_run)})
        for node, count in (brief.get("nodes_replaced") or {}).items():
            entry = nodes.setdefault(node, {"node": node, "replacements": 0, "runs": []})
            entry["replacements"] += count
            entry["runs"].append(brief.get("run_id"))
    return numbers_only(
        {
            "dag_id": dag_id,
            "runs": rows,
            "nodes": sorted(nodes.values(), key=lambda n: -n["replacements"]),
        }
    )
