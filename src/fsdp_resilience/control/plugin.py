"""The project's Airflow plugin, so that a deployment's plugin list (``airflow plugins``, the UI's
Admin > Plugins) shows the control plane it runs.

Airflow loads it through the thin module in the repository's ``plugins/`` folder, the one place
Airflow looks for a deployment's own plugins. The control plane itself is an installed package.
"""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin


class FsdpResiliencePlugin(AirflowPlugin):
    name = "fsdp_resilience"
