"""Airflow pieces for FSx for Lustre: run a data repository task (deferrable), and read a run's
checkpoint progress from its S3 export when the triggerer does not mount FSx.

    FsxDataRepositoryTaskOperator(task_id="import_to_fsx", kind="import", file_system_id="fs-...",
                                  paths=["s3://bucket/datasets/c4/"])

The operator starts the task, or reuses the in-flight one a previous try started (see
``FsxHook.start_task``), then waits in the triggerer (``FsxDataRepositoryTaskTrigger``) or, with
``deferrable=False``, in the worker. boto3 and the amazon provider are imported when a task runs,
not when a DAG that uses the operator is parsed.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Iterator, Sequence

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowFailException
from airflow.triggers.base import BaseTrigger, TriggerEvent

from fsdp_resilience.training.contract import COMMIT_MARKER, checkpoint_step, parse_commit_marker

if TYPE_CHECKING:
    from fsdp_resilience.control.fsx import FsxHook


class FsxDataRepositoryTaskTrigger(BaseTrigger):
    """Fires once, when data repository task ``task_id`` has ended: ``{"status": "succeeded" |
    "failed", "message": ..., "task": task_summary or None}``.

    Stateless between polls, so a restarted triggerer resumes it as it was. The sync hook runs in
    a thread (``asyncio.to_thread``): connection lookup and botocore block, and the triggerer's
    event loop must not.
    """

    def __init__(self, *, task_id: str, file_system_id: str, aws_conn_id: str | None = "aws_default",
                 region_name: str | None = None, poll_interval_s: float = 30.0):
        super().__init__()
        self.task_id = task_id
        self.file_system_id = file_system_id
        self.aws_conn_id = aws_conn_id
        self.region_name = region_name
        self.poll_interval_s = poll_interval_s

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{type(self).__module__}.{type(self).__qualname__}", {
            "task_id": self.task_id, "file_system_id": self.file_system_id, "aws_conn_id": self.aws_conn_id,
            "region_name": self.region_name, "poll_interval_s": self.poll_interval_s,
        })

    def _hook(self) -> "FsxHook":
        from fsdp_resilience.control.fsx import FsxHook

        return FsxHook(aws_conn_id=self.aws_conn_id, region_name=self.region_name)

    async def run(self) -> AsyncIterator[TriggerEvent]:
        hook = await asyncio.to_thread(self._hook)  # first, so boto3 is imported off the event loop
        from fsdp_resilience.control.fsx import RUNNING, FsxStagingError, task_outcome, task_summary

        while True:
            try:
                task = await asyncio.to_thread(hook.describe_task, self.task_id)
            except FsxStagingError as e:
                if not e.retryable:
                    yield TriggerEvent({"status": "failed", "message": str(e), "task": None})
                    return
                self.log.warning("%s; polling again in %ss", e, self.poll_interval_s)
            else:
                status, message = task_outcome(task)
                if status != RUNNING:
                    yield TriggerEvent({"status": status, "message": message, "task": task_summary(task)})
                    return
                self.log.info("%s", message)
            await asyncio.sleep(self.poll_interval_s)


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

    def __init__(self, *, kind: str, file_system_id: str, paths: str | list[str], report_path: str | None = None,
                 aws_conn_id: str | None = "aws_default", region_name: str | None = None,
                 poll_interval_s: float = 30.0, deferrable: bool = True, **kwargs: Any):
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
        from fsdp_resilience.control.fsx import RUNNING, FsxHook, FsxStagingError, task_outcome, task_summary

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
            self.defer(trigger=FsxDataRepositoryTaskTrigger(
                task_id=task["TaskId"], file_system_id=self.file_system_id, aws_conn_id=self.aws_conn_id,
                region_name=self.region_name, poll_interval_s=self.poll_interval_s), method_name="execute_complete")
        while True:
            status, message = task_outcome(task)
            if status != RUNNING:
                return self.execute_complete(context, {"status": status, "message": message,
                                                       "task": task_summary(task)})
            self.log.info("%s", message)
            time.sleep(self.poll_interval_s)
            task = hook.describe_task(task["TaskId"])

    def execute_complete(self, context: Any, event: dict[str, Any]) -> dict[str, Any]:
        if event.get("status") != "succeeded":
            raise AirflowFailException(event.get("message") or f"data repository task ended without a message: {event}")
        self.log.info("%s", event["message"])
        return event["task"]


# --------------------------------------------------------------------------------------------
# Checkpoint progress from a run dir's S3 export
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class S3CheckpointInfo:
    """A checkpoint in S3, with the fields of ``fsdp_resilience.training.contract.CheckpointInfo`` that progress
    checks read (``step``, ``checkpoint_id``, ``committed``, ``world_size``, ``committed_at``)."""

    step: int
    uri: str
    committed: bool
    world_size: int | None = None
    committed_at: float | None = None

    @property
    def checkpoint_id(self) -> str:
        return self.uri.rstrip("/").rsplit("/", 1)[-1]


class S3CheckpointProgress:
    """``CheckpointCatalog(run_dir).latest()`` over the run dir's S3 export (FSx auto-export or an
    export task), for an Airflow triggerer that does not mount FSx.

    Same semantics as the catalog: the commit marker, not the ``latest`` pointer, decides; a
    ``step_N/`` folder without a readable marker is torn and skipped. Folders are read newest
    first and the search stops at the first committed one, so a long run costs one listing and a
    few GETs. A marker in S3 shows the step was committed; it does not prove that every shard has
    been exported yet (auto-export has no order), so restore from FSx, not from this.

    :param run_dir_uri: ``s3://bucket/prefix/runs/<run_id>`` (the S3 side of the run dir).
    """

    def __init__(self, run_dir_uri: str, aws_conn_id: str | None = "aws_default", region_name: str | None = None):
        from fsdp_resilience.control.fsx import parse_s3_uri

        self.run_dir_uri = run_dir_uri
        self.bucket, key = parse_s3_uri(run_dir_uri)
        key = key.strip("/")
        self.checkpoints_prefix = f"{key}/checkpoints/" if key else "checkpoints/"
        self.aws_conn_id = aws_conn_id
        self.region_name = region_name

    def _s3(self):
        from airflow.providers.amazon.aws.hooks.s3 import S3Hook

        return S3Hook(aws_conn_id=self.aws_conn_id, region_name=self.region_name)

    def _read_marker(self, client: Any, key: str) -> dict[str, Any] | None:
        from botocore.exceptions import ClientError

        try:
            body = client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise self._error(e) from None
        return parse_commit_marker(body)

    def _error(self, e: Exception):
        from fsdp_resilience.control.fsx import FsxStagingError

        return FsxStagingError(f"could not read checkpoints under s3://{self.bucket}/{self.checkpoints_prefix} with "
                               f"connection {self.aws_conn_id!r}: {e}; check the bucket, the export of the run dir "
                               "and s3:ListBucket / s3:GetObject permissions", retryable=True)

    def committed(self) -> Iterator[tuple[S3CheckpointInfo, dict[str, Any]]]:
        """The committed checkpoints in S3 with their commit markers, newest first (lazily: each
        next one costs a GET of its marker)."""
        from botocore.exceptions import BotoCoreError, ClientError

        hook = self._s3()
        try:
            prefixes = hook.list_prefixes(bucket_name=self.bucket, prefix=self.checkpoints_prefix, delimiter="/")
        except (ClientError, BotoCoreError) as e:
            raise self._error(e) from None
        candidates = []
        for prefix in prefixes:
            step = checkpoint_step(prefix[len(self.checkpoints_prefix):].rstrip("/"))
            if step is not None:
                candidates.append((step, prefix))
        client = hook.get_conn()
        for step, prefix in sorted(candidates, reverse=True):
            marker = self._read_marker(client, prefix + COMMIT_MARKER)
            if marker is not None:
                yield S3CheckpointInfo(step, f"s3://{self.bucket}/{prefix.rstrip('/')}", True,
                                       marker.get("world_size"), marker.get("committed_at")), marker

    def latest(self) -> S3CheckpointInfo | None:
        """The newest committed checkpoint in S3, or None."""
        return next((info for info, _ in self.committed()), None)

    def object_sizes(self, checkpoint: S3CheckpointInfo) -> dict[str, int]:
        """Every object under a checkpoint's prefix: its name relative to the checkpoint (as the
        commit marker lists files) -> its size in bytes."""
        from botocore.exceptions import BotoCoreError, ClientError

        prefix = checkpoint.uri[len(f"s3://{self.bucket}/"):] + "/"
        sizes: dict[str, int] = {}
        try:
            for page in self._s3().get_conn().get_paginator("list_objects_v2").paginate(Bucket=self.bucket,
                                                                                         Prefix=prefix):
                for obj in page.get("Contents", []):
                    sizes[obj["Key"][len(prefix):]] = int(obj["Size"])
        except (ClientError, BotoCoreError) as e:
            raise self._error(e) from None
        return sizes


def latest_committed_in_s3(s3_uri: str, aws_conn_id: str | None = "aws_default",
                           region_name: str | None = None) -> S3CheckpointInfo | None:
    """The newest committed checkpoint of the run dir exported to ``s3_uri``, or None."""
    return S3CheckpointProgress(s3_uri, aws_conn_id, region_name).latest()
