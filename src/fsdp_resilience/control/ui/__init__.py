"""The run report and the fleet page in the Airflow UI: a FastAPI app the Airflow API server
serves as a plugin app (``control.plugin``), behind Airflow's own auth."""
