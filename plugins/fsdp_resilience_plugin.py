"""Airflow's plugins folder holds only this shim. The control plane is the installed package
``fsdp_resilience`` (``pip install fsdp-resilience``: the Airflow image and ``make setup`` install
it); this module hands its plugin to Airflow's plugin manager, and where the package is missing
it says so among the plugin import errors before any DAG fails on it.

Its name must not be ``fsdp_resilience``: Airflow puts this folder on ``sys.path``, where a
module of that name would hide the package.
"""

try:
    from fsdp_resilience.control.plugin import FsdpResiliencePlugin
except ModuleNotFoundError as e:
    if e.name is None or not e.name.startswith("fsdp_resilience"):
        raise
    raise ImportError(
        "the control plane package fsdp_resilience is not installed in this Airflow environment: "
        "install it with `pip install --no-deps <repository root>` (the Airflow image does, "
        "images/airflow/Dockerfile)"
    ) from e

__all__ = ["FsdpResiliencePlugin"]
