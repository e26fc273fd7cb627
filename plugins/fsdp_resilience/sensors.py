"""The sensors: wait for a training launch to finish, and for node capacity, deferring meanwhile."""

from __future__ import annotations

import time
from typing import Any

from airflow.sdk import BaseSensorOperator

from fsdp_resilience.backends import JobHandle, get_backend
from fsdp_resilience.progress import check_progress
from fsdp_resilience.triggers import NodeCapacityTrigger, TrainingProgressTrigger


class CheckpointProgressSensor(BaseSensorOperator):
    """Waits until a launch commits its final step, fails, or stalls; returns what it saw
    (``Progress.to_dict()``) as its XCom, so the DAG can decide what to do next.

    It does not fail the task on a failed launch: a failed launch is an input to the escalation
    ladder, not an Airflow error. With ``deferrable=True`` (the default) it holds no worker slot
    while training runs; ``deferrable=False`` pokes from a worker instead.
    """

    template_fields = ("launch",)

    def __init__(self, *, launch: dict[str, Any] | str, poll_interval_s: float = 5.0, deferrable: bool = True,
                 **kwargs: Any):
        super().__init__(poke_interval=poll_interval_s, **kwargs)
        self.launch = launch  # launch_training's XCom: backend, handle, run_dir, final_step, ...
        self.poll_interval_s = poll_interval_s
        self.deferrable = deferrable

    def _trigger_kwargs(self) -> dict[str, Any]:
        launch = self.launch
        return {"backend": launch["backend"], "handle": launch["handle"], "run_dir": launch["run_dir"],
                "final_step": launch["final_step"], "stall_timeout_s": launch["stall_timeout_s"],
                "launched_at": launch["launched_at"], "checkpoints_s3": launch.get("checkpoints_s3"),
                "aws_conn_id": launch.get("aws_conn_id")}

    def execute(self, context: Any) -> Any:
        if not self.deferrable:
            return super().execute(context)
        self.defer(trigger=TrainingProgressTrigger(**self._trigger_kwargs(), poll_interval_s=self.poll_interval_s),
                   method_name="execute_complete")

    def poke(self, context: Any):
        from airflow.sdk import PokeReturnValue

        kw = self._trigger_kwargs()
        progress = check_progress(get_backend(**kw.pop("backend")), JobHandle.from_dict(kw.pop("handle")), **kw,
                                  now=time.time())
        self.log.info("%s", progress.message)
        return PokeReturnValue(is_done=progress.outcome is not None, xcom_value=progress.to_dict())

    def execute_complete(self, context: Any, event: dict[str, Any]) -> dict[str, Any]:
        self.log.info("launch %s: %s (%s) — %s", event["launch_id"], event["outcome"], event["failure_class"],
                      event["message"])
        return event


class NodeCapacitySensor(BaseSensorOperator):
    """Waits, deferred, until the run's backend can place ``cfg.nodes`` nodes (after a node was
    replaced: until its replacement has joined). Fails after ``timeout_s`` with what it saw. When
    the capacity is there at once it returns without deferring.

    The run (config and backend) is ``run``, or the XCom of task ``run_from`` (validate_config's),
    pulled when the sensor runs."""

    template_fields = ("run",)

    def __init__(self, *, run: dict[str, Any] | str | None = None, run_from: str | None = None,
                 timeout_s: float = 1800.0, poll_interval_s: float = 10.0, **kwargs: Any):
        super().__init__(poke_interval=poll_interval_s, timeout=timeout_s, **kwargs)
        if (run is None) == (run_from is None):
            raise ValueError("NodeCapacitySensor needs one of run (the run dict) or run_from (a task id)")
        self.run = run
        self.run_from = run_from
        self.timeout_s = timeout_s
        self.poll_interval_s = poll_interval_s

    def _run(self, context: Any) -> dict[str, Any]:
        return self.run if self.run is not None else context["ti"].xcom_pull(task_ids=self.run_from)

    def execute(self, context: Any) -> Any:
        run = self._run(context)
        started_at = time.time()
        # Ask once here first: capacity is usually there already (a spare slot, a node group with
        # room), and then the relaunch goes at once instead of after a round trip through the
        # triggerer. Only a wait defers.
        capacity = get_backend(**run["backend"]).capacity()
        if capacity.fits(run["config"]["nodes"]):
            return self.execute_complete(context, {"ready": True, "waited_s": round(time.time() - started_at, 1),
                                                   "capacity": capacity.to_dict()})
        self.defer(trigger=NodeCapacityTrigger(backend=run["backend"], nodes=run["config"]["nodes"],
                                               timeout_s=self.timeout_s, started_at=started_at,
                                               poll_interval_s=self.poll_interval_s),
                   method_name="execute_complete")

    def execute_complete(self, context: Any, event: dict[str, Any]) -> dict[str, Any]:
        capacity = event["capacity"]
        nodes = self._run(context)["config"]["nodes"]
        summary = (f"{capacity['healthy']} of {capacity['total']} node(s) healthy, out of service "
                   f"{capacity['quarantined']}, after {event['waited_s']}s")
        if not event["ready"]:
            from airflow.sdk.exceptions import AirflowFailException

            raise AirflowFailException(f"not enough healthy nodes for {nodes} node(s) within "
                                       f"{self.timeout_s:.0f}s: {summary}; scale the node group up or lower nodes")
        self.log.info("capacity: %s", summary)
        return event
