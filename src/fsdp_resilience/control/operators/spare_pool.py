"""The keeper of a launch's pool of hot spares: while the launch trains, it makes up for each node
out of the job (takes it out of service, adds a new spare), deferring between them."""

from __future__ import annotations

from typing import Any

from airflow.sdk import BaseOperator

from fsdp_resilience.control import spare_refill
from fsdp_resilience.control.task_data import Launch, Run
from fsdp_resilience.control.triggers.base import LAUNCH_ENDED, NODES_OUT, read_event
from fsdp_resilience.control.triggers.spare_pool import SparePoolTrigger


class SparePoolKeeper(BaseOperator):
    """Keeps a launch's pool of hot spares whole while it trains (``spare_nodes`` > 0; skipped
    otherwise): deferred, holding no worker slot, until the launch shows a node out of the job (a
    lost node whose place a spare takes, or a spare that dropped out), then takes that node out of
    service and adds a new spare (``spare_refill.keep_spare_pool``: bounded by max_node_replacements),
    and defers again. It ends, successfully, when the launch ends, however it ended: what the
    launch's end means is the watch's and the ladder's to say. A refill it could not do is logged,
    never a failure; a bug fails it loudly.

    ``launch`` is the launch task's XCom (what the watch gets); the run is the XCom of task
    ``run_from`` and the DAG run's first launch (whose start bounds the replacements counted) the
    XCom of ``first_launch_from``, pulled when it runs."""

    template_fields = ("launch",)
    ui_color = "#e8f4ea"

    def __init__(
        self,
        *,
        launch: Launch | dict[str, Any] | str,
        run_from: str = "validate_config",
        first_launch_from: str = "launch_training",
        poll_interval_s: float = 5.0,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        self.launch = launch
        self.run_from = run_from
        self.first_launch_from = first_launch_from
        self.poll_interval_s = poll_interval_s

    def execute(self, context: Any) -> Any:
        from airflow.sdk.exceptions import AirflowSkipException

        run, launch = Run.of(context["ti"].xcom_pull(task_ids=self.run_from)), Launch.of(self.launch)
        spares = int(run.config.get("spare_nodes") or 0)
        if not spares:
            raise AirflowSkipException(f"spare_nodes=0: launch {launch.launch_id} has no spare pool to keep")
        handled = spare_refill.handled_nodes(run, launch)
        self.log.info(
            "launch %s: keeping its %d spare(s) (%s); nodes already made up for: %s",
            launch.launch_id,
            spares,
            launch.handle["job_name"],
            handled or "none",
        )
        self._wait(context, run, handled)

    def _wait(self, context: Any, run: Run, handled: list[str]) -> None:
        launch = Launch.of(self.launch)
        first = Launch.of(context["ti"].xcom_pull(task_ids=self.first_launch_from) or launch)
        left = spare_refill.replacements_left(run, since=float(first.launched_at))
        # What was handled travels in the trigger and back in its event (not in the deferral's
        # kwargs, which dag.test() drops); the events log has the refills in any case.
        self.defer(
            trigger=SparePoolTrigger(
                backend=launch.backend,
                handle=launch.handle,
                run_dir=launch.run_dir,
                handled=handled,
                poll_interval_s=self.poll_interval_s,
                checkpoints_s3=launch.checkpoints_s3,
                standby_s=spare_refill.KEEPER_NOTICE_S if left > 0 else 0.0,
                standby_why=f"the pool keeper ({self.task_id}) watches launch {launch.launch_id} and adds a spare "
                f"for a lost node ({left} of max_node_replacements={run.max_node_replacements} left)",
            ),
            method_name="execute_complete",
        )

    def execute_complete(self, context: Any, event: dict[str, Any]) -> dict[str, Any]:
        run, launch = Run.of(context["ti"].xcom_pull(task_ids=self.run_from)), Launch.of(self.launch)
        launch_id = launch.launch_id
        event = read_event(event, LAUNCH_ENDED, NODES_OUT)
        handled = sorted(set(event.get("handled") or []))
        if event["status"] == LAUNCH_ENDED:
            added = spare_refill.spares_added(run, launch)
            self.log.info(
                "launch %s ended (%s: %s); spares added while it trained: %s",
                launch_id,
                event["state"],
                event["message"],
                [f"node {r.get('node_rank')} ({r.get('node_id')}) for {r.get('lost_node_id')}" for r in added]
                or "none",
            )
            return {
                "launch_id": launch_id,
                "state": event["state"],
                "nodes_handled": handled,
                "spares_added": [
                    {k: r.get(k) for k in ("lost_node_id", "lost_node_rank", "quarantined", "node_id", "node_rank")}
                    for r in added
                ],
            }
        first = Launch.of(context["ti"].xcom_pull(task_ids=self.first_launch_from) or launch)
        results = spare_refill.keep_spare_pool(
            run, launch, event["nodes"], since=float(first.launched_at), log=self.log.info
        )
        # Handled either way: a node not refilled (budget spent, no capacity) is not retried on
        # every poll; the launch trains on with one spare fewer.
        self._wait(context, run, sorted(set(handled) | {r["key"] for r in results}))
