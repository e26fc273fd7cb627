"""Import S3 prefixes into FSx for Lustre, or export file-system paths to S3, with a data
repository task (deferrable).

    FsxDataRepositoryTaskOperator(task_id="import_to_fsx", kind="import", file_system_id="fs-...",
                                  paths=["s3://bucket/datasets/c4/"])

The operator starts the task, or reuses the in-flight one a previous try started (see
``FsxHook.start_task``), then waits in the triggerer (``FsxDataRepositoryTaskTrigger``) or, with
``deferrable=False``, in the worker. boto3 and the amazon provider are imported when a task runs,
not when a DAG that uses the operator is parsed.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowFailException

from fsdp_resilience.control.triggers.base import FAILURE, SUCCESS, read_event
from fsdp_resilience.control.triggers.fsx import FsxDataRepositoryTaskTrigger, task_event


class FsxDataRepositoryTaskOperator(BaseOperator):
    """Import S3 prefixes into FSx for Lustre, or export file-system paths to S3, with a data
    repository task; returns the task's summary (``fsx.task_summary``) as its XCom.

    :param kind: "import" (IMPORT_METADATA_FROM_REPOSITORY) or "export" (EXPORT_TO_REPOSITORY).
    :param file_system_id: the FSx for Lustre file system (fs-...). Templated.
    :param paths: S3 URIs or file-system paths, each under a data repository association. Templated.
    :param report_path: an s3:// URI inside an association's prefix for the report of failed files,
        or None for no report. Templated.
    :param aws_conn_id: the Airflow AWS connection. Templated, as is region_name.
    :param deferrable: wait in the triggerer (default) or poll from the worker.

    A retried try reuses the task the previous try started if it is still in flight; a task that
    ended FAILED, CANCELED, or with failed files fails this task without retries (the message says
    why and where the report is).
    """

    template_fields: Sequence[str] = ("file_system_id", "paths", "report_path", "aws_conn_id", "region_name")
    ui_color = "#d6eaf8"

    def __init__(
        self,
        *,
        kind: str,
        file_system_id: str,
        paths: str | list[str],
        report_path: str | None = None,
        aws_conn_id: str | None = "aws_default",
        region_name: str | None = None,
        poll_interval_s: float = 30.0,
        deferrable: bool = True,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        if kind not in ("import", "export"):
            raise ValueError(f"kind={kind!r} is not a data repository task kind; use 'import' or 'export'")
        self.kind = kind
        self.file_system_id = file_system_id
        self.paths = paths
        self.report_path = report_path
        self.aws_conn_id = aws_conn_id
        self.region_name = region_name
        self.poll_interval_s = poll_interval_s
        self.deferrable = deferrable

    def execute(self, context: Any) -> dict[str, Any]:
        from fsdp_resilience.control.fsx import RUNNING, FsxStagingError, task_outcome, task_summary
        from fsdp_resilience.control.hooks.fsx import FsxHook

        hook = FsxHook(aws_conn_id=self.aws_conn_id, region_name=self.region_name)
        ti = context["ti"]
        # Same try, same token: a create retried after a lost response makes no second task.
        # A new try may start a new task (the last one failed), unless one is still in flight.
        request_key = f"{ti.dag_id}.{ti.run_id}.{ti.task_id}.{ti.map_index}.{ti.try_number}"
        try:
            task = hook.start_task(self.kind, self.file_system_id, self.paths, self.report_path, request_key)
        except FsxStagingError as e:
            if e.retryable:
                raise
            raise AirflowFailException(str(e)) from None
        if self.deferrable:
            self.defer(
                trigger=FsxDataRepositoryTaskTrigger(
                    task_id=task["TaskId"],
                    file_system_id=self.file_system_id,
                    aws_conn_id=self.aws_conn_id,
                    region_name=self.region_name,
                    poll_interval_s=self.poll_interval_s,
                ),
                method_name="execute_complete",
            )
        while True:
            status, message = task_outcome(task)
            if status != RUNNING:
                return self.execute_complete(context, task_event(status, message, task_summary(task)))
            self.log.info("%s", message)
            time.sleep(self.poll_interval_s)
            task = hook.describe_task(task["TaskId"])

    def execute_complete(self, context: Any, event: dict[str, Any]) -> dict[str, Any]:
        event = read_event(event, SUCCESS, FAILURE)
        if event["status"] != SUCCESS:
            raise AirflowFailException(event["message"] or f"data repository task ended without a message: {event}")
        self.log.info("%s", event["message"])
        return event["task"]
