"""``FsxHook``: the Amazon FSx calls staging needs (client_type "fsx"), validated before anything
is created, with botocore's errors turned into ``FsxStagingError``s that say what to do. The path
mapping, request shapes and outcomes it uses are the pure helpers of ``fsdp_resilience.control.fsx``."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from airflow.providers.amazon.aws.hooks.base_aws import AwsBaseHook
from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

from fsdp_resilience.control.fsx import (
    FILE_SYSTEM_ID_ENV,
    FILE_SYSTEM_ID_RE,
    IN_FLIGHT,
    FsxStagingError,
    completion_report,
    describe_association,
    locate,
    locate_or_raise,
    normalize_s3_uri,
    request_token,
    resolve_path,
    same_paths,
    task_path,
    task_type,
)

#: Errors only a person can fix; anything else (another task running, limits, throttling, service
#: errors) may pass, so Airflow's retries apply.
_PERMANENT_CODES = {
    "FileSystemNotFound",
    "DataRepositoryTaskNotFound",
    "UnsupportedOperation",
    "BadRequest",
    "IncompatibleParameterError",
    "InvalidDataRepositoryType",
    "UnauthorizedOperation",
}


class FsxHook(AwsBaseHook):
    """Amazon FSx (client_type "fsx"): the data repository calls staging needs, validated.

    :param aws_conn_id: the Airflow AWS connection (None: boto3's default credential chain).
    :param region_name: overrides the connection's region.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs["client_type"] = "fsx"
        super().__init__(*args, **kwargs)

    # -- error mapping --------------------------------------------------------------------------
    def _where(self) -> str:
        try:
            region = self.conn.meta.region_name
        except Exception:  # noqa: BLE001 - only for the message
            region = self.region_name
        return f"region {region or '(none set)'}, connection {self.aws_conn_id!r}"

    @contextmanager
    def _errors(self, action: str, file_system_id: str | None = None, task_id: str | None = None) -> Iterator[None]:
        """Turn botocore errors into FsxStagingError with what was wrong and what to do."""
        try:
            yield
        except ClientError as e:
            code = e.response.get("Error", {}).get("Code", "")
            detail = e.response.get("Error", {}).get("Message") or str(e)
            if code == "FileSystemNotFound":
                msg = (
                    f"FSx file system {file_system_id} was not found ({self._where()}); check "
                    f"{FILE_SYSTEM_ID_ENV} and the region of the AWS connection"
                )
            elif code == "DataRepositoryTaskNotFound":
                msg = f"data repository task {task_id} was not found ({self._where()}); it may have been deleted"
            elif code == "DataRepositoryTaskExecuting":
                msg = (
                    f"another data repository task is running on {file_system_id} ({detail}); wait for it to end "
                    f"(aws fsx describe-data-repository-tasks --filters Name=file-system-id,Values={file_system_id})"
                    " and retry"
                )
            elif code == "UnsupportedOperation":
                msg = (
                    f"{file_system_id} cannot {action} ({detail}); data repository tasks need an FSx for Lustre "
                    "2.12+ file system (not Scratch 1) linked to S3 by a data repository association"
                )
            elif code in ("BadRequest", "IncompatibleParameterError", "InvalidDataRepositoryType"):
                msg = (
                    f"FSx rejected the request to {action} on {file_system_id}: {detail}; check that every path is "
                    "under a data repository association and the report path is inside an association's S3 prefix"
                )
            elif code == "ServiceLimitExceeded":
                msg = f"FSx limit reached while trying to {action} on {file_system_id}: {detail}; wait for queued tasks"
            elif code.startswith("AccessDenied") or code == "UnauthorizedOperation":
                msg = (
                    f"the AWS identity of connection {self.aws_conn_id!r} may not {action}: {detail}; grant it "
                    "fsx:DescribeFileSystems, fsx:DescribeDataRepositoryAssociations, "
                    "fsx:DescribeDataRepositoryTasks and fsx:CreateDataRepositoryTask"
                )
            else:
                msg = f"could not {action} ({self._where()}): {code or 'error'}: {detail}"
            permanent = code in _PERMANENT_CODES or code.startswith("AccessDenied")
            raise FsxStagingError(msg, retryable=not permanent) from None
        except NoCredentialsError:
            raise FsxStagingError(
                f"no AWS credentials to {action} ({self._where()}); configure the connection or "
                "the workers' IAM role (IRSA / Pod Identity)"
            ) from None
        except BotoCoreError as e:
            raise FsxStagingError(f"could not {action} ({self._where()}): {e}", retryable=True) from None

    # -- reads ----------------------------------------------------------------------------------
    def get_file_system(self, file_system_id: str) -> dict[str, Any]:
        """The file system, checked to exist and to be FSx for Lustre."""
        if not isinstance(file_system_id, str) or not FILE_SYSTEM_ID_RE.match(file_system_id):
            raise FsxStagingError(
                f"{file_system_id!r} is not an FSx file system id; it looks like fs-0123456789abcdef0"
            )
        with self._errors("describe the file system", file_system_id):
            systems = self.conn.describe_file_systems(FileSystemIds=[file_system_id]).get("FileSystems", [])
        if not systems:
            raise FsxStagingError(
                f"FSx file system {file_system_id} was not found ({self._where()}); check "
                f"{FILE_SYSTEM_ID_ENV} and the region of the AWS connection"
            )
        fs = systems[0]
        if fs.get("FileSystemType") != "LUSTRE":
            raise FsxStagingError(
                f"file system {file_system_id} is FSx for {fs.get('FileSystemType', '?')}, not "
                "FSx for Lustre; data repository tasks need a Lustre file system linked to S3"
            )
        return fs

    def get_associations(self, file_system_id: str) -> list[dict[str, Any]]:
        """Every data repository association of the file system."""
        out: list[dict[str, Any]] = []
        kwargs: dict[str, Any] = {"Filters": [{"Name": "file-system-id", "Values": [file_system_id]}], "MaxResults": 25}
        with self._errors("list the data repository associations", file_system_id):
            while True:
                page = self.conn.describe_data_repository_associations(**kwargs)
                out.extend(page.get("Associations", []))
                if not page.get("NextToken"):
                    return out
                kwargs["NextToken"] = page["NextToken"]

    def resolve_path(self, file_system_id: str, s3_uri_or_fs_path: str) -> tuple[dict[str, Any], str]:
        """(association, fs_path) for an ``s3://`` URI or a file-system path of ``file_system_id``."""
        return resolve_path(self.get_associations(file_system_id), s3_uri_or_fs_path)

    def get_in_flight_tasks(self, file_system_id: str) -> list[dict[str, Any]]:
        """The file system's PENDING and EXECUTING data repository tasks."""
        out: list[dict[str, Any]] = []
        kwargs: dict[str, Any] = {
            "Filters": [
                {"Name": "file-system-id", "Values": [file_system_id]},
                {"Name": "task-lifecycle", "Values": list(IN_FLIGHT)},
            ]
        }
        with self._errors("list data repository tasks", file_system_id):
            while True:
                page = self.conn.describe_data_repository_tasks(**kwargs)
                out.extend(page.get("DataRepositoryTasks", []))
                if not page.get("NextToken"):
                    return out
                kwargs["NextToken"] = page["NextToken"]

    def describe_task(self, task_id: str) -> dict[str, Any]:
        with self._errors("describe the data repository task", task_id=task_id):
            tasks = self.conn.describe_data_repository_tasks(TaskIds=[task_id]).get("DataRepositoryTasks", [])
        if not tasks:
            raise FsxStagingError(
                f"data repository task {task_id} was not found ({self._where()}); it may have been deleted"
            )
        return tasks[0]

    # -- the write --------------------------------------------------------------------------------
    def start_task(
        self,
        kind: str,
        file_system_id: str,
        paths: Iterable[str],
        report_path: str | None = None,
        request_key: str = "",
    ) -> dict[str, Any]:
        """Start an import or export task for ``paths`` (S3 URIs or file-system paths under data
        repository associations; end a folder with "/"), or return the in-flight task that already
        does exactly that.

        Validates first (the file system exists and is Lustre; every path and the report path are
        under an association), so a mistake fails with a message instead of a FAILED task later.
        ``request_key`` distinguishes deliberate repeats (e.g. the Airflow try number); the same
        key and request give the same ClientRequestToken.
        """
        type_ = task_type(kind)
        paths = [paths] if isinstance(paths, str) else list(paths)
        if not paths:
            raise FsxStagingError(f"no paths to {kind}; give the S3 URIs or file-system paths of what to {kind}")
        self.get_file_system(file_system_id)
        associations = self.get_associations(file_system_id)
        task_paths = sorted(
            {task_path(kind, *locate_or_raise(associations, path)[1:], folder=path.endswith("/")) for path in paths}
        )
        if report_path is not None:
            if not report_path.startswith("s3://") or locate(associations, report_path) is None:
                raise FsxStagingError(
                    f"report_path {report_path!r} must be an s3:// URI inside the S3 prefix of "
                    "one of the file system's data repository associations: "
                    f"{'; '.join(describe_association(a) for a in associations) or 'none'}"
                )
            report_path = normalize_s3_uri(report_path)

        for task in self.get_in_flight_tasks(file_system_id):
            if (
                task.get("Lifecycle") in IN_FLIGHT
                and task.get("Type") == type_
                and same_paths(task.get("Paths") or [], task_paths)
            ):
                self.log.info(
                    "Reusing data repository task %s (%s) for %s instead of starting another",
                    task.get("TaskId"),
                    task.get("Lifecycle"),
                    task_paths,
                )
                return task

        token = request_token(kind, file_system_id, task_paths, request_key)
        with self._errors(f"start a {type_} task", file_system_id):
            task = self.conn.create_data_repository_task(
                Type=type_,
                FileSystemId=file_system_id,
                Paths=task_paths,
                Report=completion_report(report_path),
                ClientRequestToken=token,
            )["DataRepositoryTask"]
        self.log.info("Started data repository task %s: %s of %s", task.get("TaskId"), type_, task_paths)
        return task
