"""The sensors: wait for a training launch to finish, and for node capacity, deferring meanwhile;
and the keeper of a launch's spare pool, which waits the same way between the nodes it replaces."""

from __future__ import annotations

import time
from typing import Any

from airflow.sdk import BaseOperator, BaseSensorOperator

from fsdp_resilience.control import ladder
from fsdp_resilience.control.backends import JobHandle, get_backend
from fsdp_resilience.control.progress import check_progress
from fsdp_resilience.control.triggers import NodeCapacityTrigger, SparePoolTrigger, TrainingProgressTrigger


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


class SparePoolKeeper(BaseOperator):
    """Keeps a launch's pool of hot spares whole while it trains (``spare_nodes`` > 0; skipped
    otherwise): deferred, holding no worker slot, until the launch shows a node out of the job (a
    lost node whose place a spare takes, or a spare that dropped out), then takes that node out of
    service and adds a new spare (``ladder.keep_spare_pool``: bounded by max_node_replacements),
    and defers again. It ends, successfully, when the launch ends, however it ended: what the
    launch's end means is the watch's and the ladder's to say. A refill it could not do is logged,
    never a failure; a bug fails it loudly.

    ``launch`` is the launch task's XCom (what the watch gets); the run is the XCom of task
    ``run_from`` and the DAG run's first launch (whose start bounds the replacements counted) the
    XCom of ``first_launch_from``, pulled when it runs."""

    template_fields = ("launch",)
    ui_color = "#e8f4ea"

    def __init__(self, *, launch: dict[str, Any] | str, run_from: str = "validate_config",
                 first_launch_from: str = "launch_training", poll_interval_s: float = 5.0, **kwargs: Any):
        super().__init__(**kwargs)
        self.launch = launch
        self.run_from = run_from
        self.first_launch_from = first_launch_from
        self.poll_interval_s = poll_interval_s

    def execute(self, context: Any) -> Any:
        from airflow.sdk.exceptions import AirflowSkipException

        run = context["ti"].xcom_pull(task_ids=self.run_from)
        spares = int(run["config"].get("spare_nodes") or 0)
        if not spares:
            raise AirflowSkipException("spare_nodes=0: launch "
                                       f"{self.launch['handle']['launch_id']} has no spare pool to keep")
        handled = ladder.handled_nodes(run, self.launch)
        self.log.info("launch %s: keeping its %d spare(s) (%s); nodes already made up for: %s",
                      self.launch["handle"]["launch_id"], spares, self.launch["handle"]["job_name"], handled or "none")
        self._wait(handled)

    def _wait(self, handled: list[str]) -> None:
        launch = self.launch
        # What was handled travels in the trigger and back in its event (not in the deferral's
        # kwargs, which dag.test() drops); the events log has the refills in any case.
        self.defer(trigger=SparePoolTrigger(backend=launch["backend"], handle=launch["handle"],
                                            run_dir=launch["run_dir"], handled=handled,
                                            poll_interval_s=self.poll_interval_s,
                                            checkpoints_s3=launch.get("checkpoints_s3")),
                   method_name="execute_complete")

    def execute_complete(self, context: Any, event: dict[str, Any]) -> dict[str, Any]:
        run = context["ti"].xcom_pull(task_ids=self.run_from)
        launch_id = self.launch["handle"]["launch_id"]
        handled = sorted(set(event.get("handled") or []))
        if event["ended"]:
            added = ladder.spares_added(run, self.launch)
            self.log.info("launch %s ended (%s: %s); spares added while it trained: %s", launch_id, event["state"],
                          event["message"], [f"node {r.get('node_rank')} ({r.get('node_id')}) for "
                                             f"{r.get('lost_node_id')}" for r in added] or "none")
            return {"launch_id": launch_id, "state": event["state"], "nodes_handled": handled,
                    "spares_added": [{k: r.get(k) for k in ("lost_node_id", "lost_node_rank", "quarantined",
                                                            "node_id", "node_rank")} for r in added]}
        first = context["ti"].xcom_pull(task_ids=self.first_launch_from) or self.launch
        results = ladder.keep_spare_pool(run, self.launch, event["nodes"], since=float(first["launched_at"]),
                                         log=self.log.info)
        # Handled either way: a node not refilled (budget spent, no capacity) is not retried on
        # every poll; the launch trains on with one spare fewer.
        self._wait(sorted(set(handled) | {r["key"] for r in results}))


class NodeCapacitySensor(BaseSensorOperator):
    """Waits, deferred, until the run's backend can place ``cfg.launch_nodes`` nodes (the training
    nodes and the spares; after a node was replaced: until its replacement has joined). Fails
    after ``timeout_s`` with what it saw. When the capacity is there at once it returns without
    deferring.

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
        if capacity.fits(launch_nodes(run)):
            return self.execute_complete(context, {"ready": True, "waited_s": round(time.time() - started_at, 1),
                                                   "capacity": capacity.to_dict()})
        self.defer(trigger=NodeCapacityTrigger(backend=run["backend"], nodes=launch_nodes(run),
                                               timeout_s=self.timeout_s, started_at=started_at,
                                               poll_interval_s=self.poll_interval_s),
                   method_name="execute_complete")

    def execute_complete(self, context: Any, event: dict[str, Any]) -> dict[str, Any]:
        capacity = event["capacity"]
        nodes = launch_nodes(self._run(context))
        summary = (f"{capacity['healthy']} of {capacity['total']} node(s) healthy, out of service "
                   f"{capacity['quarantined']}, after {event['waited_s']}s")
        if not event["ready"]:
            from airflow.sdk.exceptions import AirflowFailException

            raise AirflowFailException(f"not enough healthy nodes for {nodes} node(s) within "
                                       f"{self.timeout_s:.0f}s: {summary}; scale the node group up or lower nodes")
        self.log.info("capacity: %s", summary)
        return event


def launch_nodes(run: dict[str, Any]) -> int:
    """Nodes a launch of the run takes: the training nodes and the spares behind them."""
    return int(run["config"]["nodes"]) + int(run["config"].get("spare_nodes") or 0)
