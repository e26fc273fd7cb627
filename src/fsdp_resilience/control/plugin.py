"""The project's Airflow plugin: the run report and the fleet page in the Airflow UI, and the
control plane's name in the deployment's plugin list (``airflow plugins``, Admin > Plugins).

- ``fastapi_apps``: ``control.ui.app``, served by the API server under ``/fsdp-report``, behind
  Airflow's own login and DAG permissions.
- ``external_views``: a "Training report" tab on every run of a training DAG (destination
  ``dag_run``) and a "Training fleet" tab on the DAG (destination ``dag``). Airflow shows them in
  an iframe on the same origin, so the UI's login cookie authenticates the page's requests.

Airflow loads it through the thin module in the repository's ``plugins/`` folder, the one place
Airflow looks for a deployment's own plugins. The control plane itself is an installed package.
"""

from __future__ import annotations

from typing import Any

from airflow.plugins_manager import AirflowPlugin

#: Where the API server mounts the app (``control.ui.app``'s routes live under it).
URL_PREFIX = "/fsdp-report"


class ReportApp:
    """``control.ui.app.app``, imported on its first request. Every Airflow component loads the
    plugins (the scheduler, each task process); only the API server serves the app, and importing
    it (FastAPI, Airflow's API security) costs about 0.6 s that the others need not pay."""

    def __init__(self) -> None:
        self._app: Any = None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if self._app is None:
            from fsdp_resilience.control.ui.app import app

            self._app = app
        await self._app(scope, receive, send)


#: The views' hrefs are relative (no leading slash): the UI resolves them against its base URL,
#: so they work behind a proxy that serves Airflow under a sub-path.
REPORT_VIEW = {
    "name": "Training report",
    "href": URL_PREFIX.lstrip("/") + "/runs/{DAG_ID}/{RUN_ID}",
    "destination": "dag_run",
    "url_route": "training-report",
}
FLEET_VIEW = {
    "name": "Training fleet",
    "href": URL_PREFIX.lstrip("/") + "/dags/{DAG_ID}/fleet",
    "destination": "dag",
    "url_route": "training-fleet",
}


class FsdpResiliencePlugin(AirflowPlugin):
    name = "fsdp_resilience"
    fastapi_apps = [{"app": ReportApp(), "url_prefix": URL_PREFIX, "name": "FSDP training reports"}]
    external_views = [REPORT_VIEW, FLEET_VIEW]
