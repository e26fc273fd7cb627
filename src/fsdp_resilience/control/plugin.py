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

from airflow.plugins_manager import AirflowPlugin

from fsdp_resilience.control.ui.app import URL_PREFIX, app

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
    fastapi_apps = [{"app": app, "url_prefix": URL_PREFIX, "name": "FSDP training reports"}]
    external_views = [REPORT_VIEW, FLEET_VIEW]
