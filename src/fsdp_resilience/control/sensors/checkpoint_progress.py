"""The watch of a training launch: waits until it commits its final step, fails, or stalls,
deferring meanwhile."""

from __future__ import annotations

import time
from typing import Any

from airflow.sdk import BaseSensorOperator

from fsdp_resilience.control.backends import JobHandle, get_backend
from fsdp_resilience.control.progress import SUCCESS as PROGRESS_SUCCESS
from fsdp_resilience.control.progress import check_progress
from fsdp_resilience.control.task_data import Launch, Outcome
from fsdp_resilience.control.triggers.base import FAILURE, SUCCESS, read_event
from fsdp_resilience.control.triggers.training_progress import TrainingProgressTrigger


class CheckpointProgressSensor(BaseSensorOperator):
    """Waits until a launch commits its final step, fails, or stalls; returns what it saw
    (``Outcome.to_dict()``) as its XCom, so the DAG can decide what to do next.

    It does not fail the task on a failed launch: a failed launch is an input to the escalation
    ladder, not an Airflow error. With ``deferrable=True`` (the default) it holds no worker slot
    while training runs; ``deferrable=False`` pokes from a worker instead.
    """

    template_fields = ("launch",)

    def __init__(
        self,
        *,
        launch: Launch | dict[str, Any] | str,
        poll_interval_s: float = 5.0,
        deferrable: bool = True,
        **kwargs: Any,
    ):
        super().__init__(poke_interval=poll_interval_s, **kwargs)
        self.launch = launch  # launch_training's XCom (``Launch.to_dict()``), or a Launch
        self.poll_interval_s = poll_interval_s
        self.deferrable = deferrable

    def _trigger_kwargs(self) -> dict[str, Any]:
        return Launch.of(self.launch).to_dict()

    def execute(self, context: Any) -> Any:
        if not self.deferrable:
            return super().execute(context)
        self.defer(
            trigger=TrainingProgressTrigger(**self._trigger_kwargs(), poll_interval_s=self.poll_interval_s),
            method_name="execute_complete",
        )

    def poke(self, context: Any):
        from airflow.sdk import PokeReturnValue

        kw = self._trigger_kwargs()
        progress = check_progress(
            get_backend(**kw.pop("backend")), JobHandle.from_dict(kw.pop("handle")), **kw, now=time.time()
        )
        self.log.info("%s", progress.message)
        return PokeReturnValue(is_done=progress.outcome is not None, xcom_value=progress.to_dict())

    def execute_complete(self, context: Any, event: dict[str, Any]) -> dict[str, Any]:
        # Either status: a failed or stalled launch is the ladder's to judge, not a task failure.
        outcome = Outcome.from_dict({k: v for k, v in read_event(event, SUCCESS, FAILURE).items() if k != "status"})
        self.log.info(
            "launch %s: %s (%s) — %s", outcome.launch_id, outcome.outcome, outcome.failure_class, outcome.message
        )
        if outcome.outcome == PROGRESS_SUCCESS:
            self._settle(outcome)
        return outcome.to_dict()

    def _settle(self, outcome: Outcome) -> None:
        """One status from this worker after the triggerer saw the launch succeed: a backend
        finishes there what the read-only triggerer cannot (the EKS backend suspends a Job with
        spares whose training nodes succeeded, on a cluster without the Job's successPolicy).
        Best effort: the launch succeeded whatever this call meets."""
        try:
            get_backend(**Launch.of(self.launch).backend).status(JobHandle.from_dict(outcome.handle))
        except Exception as e:  # noqa: BLE001 - the outcome stands; the log says what was left
            self.log.warning("launch %s succeeded, but its job could not be settled: %s", outcome.launch_id, e)
