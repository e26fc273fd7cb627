"""The control plane: what Airflow runs (DAG helpers, hooks, operators, sensors, triggers, the
training backends, the run report). It never imports torch; of the data plane it imports only
the seam, ``fsdp_resilience.training.contract``."""
