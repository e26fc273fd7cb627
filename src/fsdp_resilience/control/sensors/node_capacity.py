"""The wait for node capacity: until the run's backend can place a launch's nodes, deferring meanwhile."""

from __future__ import annotations

import time
from typing import Any

from airflow.sdk import BaseSensorOperator

from fsdp_resilience.control.backends import get_backend
from fsdp_resilience.control.task_data import Run
from fsdp_resilience.control.triggers.base import SUCCESS, TIMEOUT, read_event
from fsdp_resilience.control.triggers.node_capacity import NodeCapacityTrigger, capacity_event


class NodeCapacitySensor(BaseSensorOperator):
    """Waits, deferred, until the run's backend can place ``cfg.launch_nodes`` nodes (the training
    nodes and the spares; after a node was replaced: until its replacement has joined). Fails
    after ``timeout_s`` with what it saw. When the capacity is there at once it returns without
    deferring.

    The run (config and backend) is ``run``, or the XCom of task ``run_from`` (validate_config's),
    pulled when the sensor runs."""

    template_fields = ("run",)

    def __init__(
        self,
        *,
        run: Run | dict[str, Any] | str | None = None,
        run_from: str | None = None,
        timeout_s: float = 1800.0,
        poll_interval_s: float = 10.0,
        **kwargs: Any,
    ):
        super().__init__(poke_interval=poll_interval_s, timeout=timeout_s, **kwargs)
        if (run is None) == (run_from is None):
            raise ValueError("NodeCapacitySensor needs one of run (the run dict) or run_from (a task id)")
        self.run = run
        self.run_from = run_from
        self.timeout_s = timeout_s
        self.poll_interval_s = poll_interval_s

    def _run(self, context: Any) -> Run:
        return Run.of(self.run if self.run is not None else context["ti"].xcom_pull(task_ids=self.run_from))

    def execute(self, context: Any) -> Any:
        run = self._run(context)
        started_at = time.time()
        # Ask once here first: capacity is usually there already (a spare slot, a node group with
        # room), and then the relaunch goes at once instead of after a round trip through the
        # triggerer. Only a wait defers.
        capacity = get_backend(**run.backend).capacity()
        if capacity.fits(launch_nodes(run)):
            return self.execute_complete(context, capacity_event(capacity, launch_nodes(run), time.time() - started_at))
        self.defer(
            trigger=NodeCapacityTrigger(
                backend=run.backend,
                nodes=launch_nodes(run),
                timeout_s=self.timeout_s,
                started_at=started_at,
                poll_interval_s=self.poll_interval_s,
            ),
            method_name="execute_complete",
        )

    def execute_complete(self, context: Any, event: dict[str, Any]) -> dict[str, Any]:
        event = read_event(event, SUCCESS, TIMEOUT)
        nodes = launch_nodes(self._run(context))
        summary = event["message"]
        if event["status"] != SUCCESS:
            from airflow.sdk.exceptions import AirflowFailException

            raise AirflowFailException(
                f"not enough healthy nodes for {nodes} node(s) (nodes + spare_nodes) within "
                f"{self.timeout_s:.0f}s: {summary}; scale the node group up or lower nodes or spare_nodes"
            )
        self.log.info("capacity: %s", summary)
        return event


def launch_nodes(run: Run) -> int:
    """Nodes a launch of the run takes: the training nodes and the spares behind them."""
    return int(run.config["nodes"]) + int(run.config.get("spare_nodes") or 0)
