"""FSx for Lustre: data repository associations and data repository tasks.

On EKS every training pod (and the Airflow workers) mounts one FSx for Lustre file system. S3
prefixes are linked to folders of it by data repository associations (DRA: ``s3://b/datasets/``
<-> ``/datasets``). Staging a dataset is an ``IMPORT_METADATA_FROM_REPOSITORY`` task for its S3
prefix (file contents then load lazily on first read); checkpoints and the evaluation go back to
S3 with ``EXPORT_TO_REPOSITORY``. This module holds the pure helpers (path mapping, request
shapes, outcomes), with no Airflow or boto3 import; ``fsdp_resilience.control.hooks.fsx.FsxHook``
makes the calls, validating before it creates anything and reusing an in-flight task instead of
queueing a second one.

Environment of the Airflow processes (read when a task runs, never at DAG parse):

  FSDP_FSX_FILE_SYSTEM_ID  the file system (fs-...)
  FSDP_FSX_MOUNT_PATH      where it is mounted in the Airflow workers; default /fsx
  FSDP_AWS_CONN_ID         the Airflow AWS connection; default aws_default
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

from fsdp_resilience.control import settings

FILE_SYSTEM_ID_ENV = "FSDP_FSX_FILE_SYSTEM_ID"

IMPORT, EXPORT = "import", "export"
TASK_TYPES = {IMPORT: "IMPORT_METADATA_FROM_REPOSITORY", EXPORT: "EXPORT_TO_REPOSITORY"}
#: Task lifecycles in which a task still holds (or waits for) the file system's task queue.
IN_FLIGHT = ("PENDING", "EXECUTING")
#: Outcomes of ``task_outcome``.
RUNNING, SUCCEEDED, FAILED = "running", "succeeded", "failed"
REPORT_FORMAT = "REPORT_CSV_20191124"
REPORT_SCOPE = "FAILED_FILES_ONLY"
#: Lifecycles of an association that can serve tasks (UPDATING: a settings change, still linked).
USABLE_ASSOCIATION = ("AVAILABLE", "UPDATING")

FILE_SYSTEM_ID_RE = re.compile(r"^fs-[0-9a-f]{8,}$")
_S3_URI_RE = re.compile(r"^s3://([a-z0-9][a-z0-9.-]{1,61}[a-z0-9])(/.*)?$")


class FsxStagingError(RuntimeError):
    """An FSx staging or export step cannot go on. The message says what was wrong and what to do.

    ``retryable`` is True when trying again later can help (another task is running, a limit or a
    throttle, a service error); False for configuration errors that only a person can fix.
    """

    def __init__(self, message: str, *, retryable: bool = False):
        super().__init__(message)
        self.retryable = retryable


# --------------------------------------------------------------------------------------------
# Settings (the Airflow processes' environment)
# --------------------------------------------------------------------------------------------


def file_system_id() -> str:
    """The FSx for Lustre file system of this deployment, from ``FSDP_FSX_FILE_SYSTEM_ID``."""
    value = os.environ.get(FILE_SYSTEM_ID_ENV, "").strip()
    if not value:
        raise FsxStagingError(
            f"{FILE_SYSTEM_ID_ENV} is not set: set it in the Airflow workers' and triggerer's "
            "environment to the id of the FSx for Lustre file system (fs-...)"
        )
    if not FILE_SYSTEM_ID_RE.match(value):
        raise FsxStagingError(
            f"{FILE_SYSTEM_ID_ENV}={value!r} is not an FSx file system id; it looks like "
            "fs-0123456789abcdef0 (aws fsx describe-file-systems lists yours)"
        )
    return value


def local_path(fs_path: str, mount: str | os.PathLike | None = None) -> Path:
    """A file-system path (``/datasets/c4``) as the workers see it (``/fsx/datasets/c4``)."""
    return Path(mount if mount is not None else settings.fsx_mount_path()) / normalize_fs_path(fs_path).lstrip("/")


# --------------------------------------------------------------------------------------------
# Paths: S3 URIs, file-system paths and the associations that link them
# --------------------------------------------------------------------------------------------


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix/`` -> ("bucket", "some/prefix/"), or a clear error."""
    match = _S3_URI_RE.match(uri) if isinstance(uri, str) else None
    if not match:
        raise FsxStagingError(f"{uri!r} is not an S3 URI; give one like s3://my-bucket/datasets/c4/")
    return match.group(1), (match.group(2) or "/")[1:]


def normalize_s3_uri(uri: str) -> str:
    """The URI without trailing slashes, so prefixes compare on whole path segments."""
    bucket, key = parse_s3_uri(uri)
    key = key.strip("/")
    if any(part in (".", "..") for part in key.split("/")):
        raise FsxStagingError(f"{uri!r} contains '.' or '..' segments; give the prefix as S3 stores it")
    return f"s3://{bucket}/{key}" if key else f"s3://{bucket}"


def normalize_fs_path(path: str) -> str:
    """An absolute file-system path without '.', '..' or trailing slashes ("/" for the root)."""
    if not isinstance(path, str) or not path.startswith("/"):
        raise FsxStagingError(
            f"{path!r} is not an absolute file-system path; give one like /datasets/c4 "
            "(relative to the file system root, not to the mount point)"
        )
    parts = [p for p in path.split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise FsxStagingError(f"{path!r} contains '.' or '..' segments; give the path from the file system root")
    return "/" + "/".join(parts)


def _under(path: str, base: str) -> bool:
    """Whether ``path`` is ``base`` or inside it, on whole path segments (``/a/bc`` is not under ``/a/b``)."""
    return path == base or path.startswith(base.rstrip("/") + "/")


def describe_association(a: dict[str, Any]) -> str:
    return (
        f"{a.get('AssociationId', '?')}: {a.get('DataRepositoryPath', '?')} <-> {a.get('FileSystemPath', '?')} "
        f"({a.get('Lifecycle', '?')})"
    )


def locate(associations: Iterable[dict[str, Any]], path: str) -> tuple[dict[str, Any], str, str] | None:
    """The association covering ``path`` (an ``s3://`` URI or a file-system path), and the path on
    both sides: (association, fs_path, s3_uri). The longest match wins; None if none covers it."""
    is_s3 = isinstance(path, str) and path.lower().startswith("s3:")  # so "s3:/b" gets the S3 URI error
    target = normalize_s3_uri(path) if is_s3 else normalize_fs_path(path)
    best: tuple[int, dict[str, Any], str, str] | None = None
    for a in associations:
        repo, fs_root = a.get("DataRepositoryPath", ""), a.get("FileSystemPath", "")
        if not (repo.startswith("s3://") and fs_root.startswith("/")):
            continue  # an NFS repository (File Cache), or an association still being described
        repo, fs_root = normalize_s3_uri(repo), normalize_fs_path(fs_root)
        base = repo if is_s3 else fs_root
        if not _under(target, base) or (best is not None and len(base) <= best[0]):
            continue
        rest = target[len(base) :].strip("/")
        fs_path = posixpath.join(fs_root, rest) if rest else fs_root
        s3_uri = f"{repo}/{rest}" if rest else repo
        best = (len(base), a, fs_path, s3_uri)
    return None if best is None else best[1:]


def locate_or_raise(associations: Iterable[dict[str, Any]], path: str) -> tuple[dict[str, Any], str, str]:
    """Like ``locate``, but raises a clear error if no usable association covers ``path``."""
    associations = list(associations)
    found = locate(associations, path)
    if found is None:
        existing = "; ".join(describe_association(a) for a in associations) or "none"
        raise FsxStagingError(
            f"no data repository association covers {path}; associations of the file system: "
            f"{existing}. Link the S3 prefix to a folder with a data repository association "
            "(aws fsx create-data-repository-association) or give a path under one of these"
        )
    association = found[0]
    if association.get("Lifecycle") not in USABLE_ASSOCIATION:
        reason = (association.get("FailureDetails") or {}).get("Message")
        raise FsxStagingError(
            f"data repository association {describe_association(association)} covers {path} but "
            f"is not AVAILABLE{f': {reason}' if reason else ''}; wait until it is AVAILABLE, or "
            "fix or recreate it",
            retryable=association.get("Lifecycle") == "CREATING",
        )
    return found


def resolve_path(associations: Iterable[dict[str, Any]], path: str) -> tuple[dict[str, Any], str]:
    """(association, fs_path) for ``path``, e.g. DRA ``s3://b/datasets/`` <-> ``/datasets``:
    ``s3://b/datasets/c4/`` -> ``/datasets/c4``. Raises if no usable association covers it."""
    association, fs_path, _ = locate_or_raise(associations, path)
    return association, fs_path


# --------------------------------------------------------------------------------------------
# Data repository tasks: request shapes and outcomes
# --------------------------------------------------------------------------------------------


def task_type(kind: str) -> str:
    try:
        return TASK_TYPES[kind]
    except KeyError:
        raise FsxStagingError(
            f"kind={kind!r} is not a data repository task kind; use one of {', '.join(TASK_TYPES)}"
        ) from None


def task_path(kind: str, fs_path: str, s3_uri: str, folder: bool = False) -> str:
    """A path as CreateDataRepositoryTask wants it: import tasks name the S3 prefix to import
    (``s3://bucket/prefix``; with a trailing slash for a ``folder``, so ``c4/`` does not also
    import ``c4-old/``); export tasks name a path relative to the file system root."""
    if kind == IMPORT:
        return s3_uri + "/" if folder else s3_uri
    if fs_path == "/":
        raise FsxStagingError(
            "refusing to export the whole file system: give the run dir or file to export, "
            "e.g. /runs/<run_id>/checkpoints"
        )
    return fs_path.lstrip("/")


def _path_key(path: str) -> str:
    return path.rstrip("/") if path.startswith("s3://") else path.strip("/")


def same_paths(a: Iterable[str], b: Iterable[str]) -> bool:
    """Whether two task path lists name the same paths (order and trailing slashes aside)."""
    return {_path_key(p) for p in a} == {_path_key(p) for p in b}


def request_token(kind: str, file_system_id: str, paths: Iterable[str], key: str) -> str:
    """A ClientRequestToken (<= 63 of [A-Za-z0-9_.-]) that is the same for the same request and
    caller key: a create that botocore retries after a lost response makes no second task."""
    digest = hashlib.sha256(json.dumps([kind, file_system_id, sorted(paths), key]).encode()).hexdigest()
    return f"fsdp-{kind}-{digest[:40]}"


def completion_report(report_path: str | None) -> dict[str, Any]:
    if report_path is None:
        return {"Enabled": False}
    return {"Enabled": True, "Path": report_path, "Format": REPORT_FORMAT, "Scope": REPORT_SCOPE}


def _report_hint(task: dict[str, Any]) -> str:
    report = task.get("Report") or {}
    if report.get("Enabled") and report.get("Path"):
        return f"; the report of failed files is under {report['Path']}"
    return "; no completion report was requested (give report_path to get a list of the failed files)"


def task_outcome(task: dict[str, Any]) -> tuple[str, str]:
    """("running" | "succeeded" | "failed", message) for a DescribeDataRepositoryTasks entry.
    A task that ended SUCCEEDED with failed files is a failure: a dataset missing files is not staged."""
    task_id, lifecycle = task.get("TaskId", "?"), task.get("Lifecycle", "?")
    status = task.get("Status") or {}
    total, done, failed = status.get("TotalCount"), status.get("SucceededCount", 0), status.get("FailedCount", 0)
    paths = ", ".join(task.get("Paths") or ["the whole file system"])
    what = f"{task.get('Type', 'data repository task')} {task_id} of {paths}"
    if lifecycle in IN_FLIGHT or lifecycle == "CANCELING":
        progress = f"{done} of {total} files" if total is not None else "no file counts yet"
        return RUNNING, f"{what} is {lifecycle.lower()}: {progress}"
    if lifecycle == "SUCCEEDED":
        if failed:
            return FAILED, f"{what} finished, but {failed} of {total} files failed{_report_hint(task)}"
        return SUCCEEDED, f"{what} succeeded: {done} of {total} files"
    if lifecycle == "FAILED":
        reason = (task.get("FailureDetails") or {}).get("Message") or "FSx gave no reason"
        return FAILED, f"{what} failed: {reason}{_report_hint(task)}"
    if lifecycle == "CANCELED":
        return FAILED, f"{what} was canceled ({done} of {total} files done){_report_hint(task)}"
    return FAILED, (
        f"{what} is in an unknown lifecycle {lifecycle!r}; look at it with aws fsx describe-data-repository-tasks"
    )


def task_summary(task: dict[str, Any]) -> dict[str, Any]:
    """The JSON-safe facts of a task (for XCom and trigger events)."""
    status, report = task.get("Status") or {}, task.get("Report") or {}

    def iso(value: Any) -> str | None:
        return value.isoformat() if isinstance(value, datetime) else value

    return {
        "task_id": task.get("TaskId"),
        "type": task.get("Type"),
        "lifecycle": task.get("Lifecycle"),
        "file_system_id": task.get("FileSystemId"),
        "paths": list(task.get("Paths") or []),
        "report_path": report.get("Path") if report.get("Enabled") else None,
        "total_files": status.get("TotalCount"),
        "succeeded_files": status.get("SucceededCount"),
        "failed_files": status.get("FailedCount"),
        "start_time": iso(task.get("StartTime")),
        "end_time": iso(task.get("EndTime")),
    }
