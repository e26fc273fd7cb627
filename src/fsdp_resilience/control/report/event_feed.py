"""A run's events log, read as it grows: each read returns only what was appended since the last.

Where the log is read from is the backend's to say (``TrainingBackend.event_feed``): the run dir
where it is mounted (a local folder, FSx for Lustre on EKS), or else the run dir's S3 export
(``FSDP_CHECKPOINTS_S3``: FSx auto-export), read with a ranged GET from the offset on. Either
way a reader that looks every few seconds reads each byte of the log once.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol

from fsdp_resilience.training.contract import RunDir, parse_event_lines, read_events_since


class EventFeed(Protocol):
    """Where a run's ``events.jsonl`` is read from."""

    #: where, for a human (a path or an s3:// URI)
    source: str

    def read(self, offset: int) -> tuple[list[dict[str, Any]], int]:
        """The records after byte ``offset`` (whole lines only), and the offset to read from next."""


class RunDirEventFeed:
    """The events log in a run dir on a file system this process mounts."""

    def __init__(self, run_dir: str | os.PathLike):
        self.path = RunDir(run_dir).events
        self.source = str(self.path)

    def read(self, offset: int) -> tuple[list[dict[str, Any]], int]:
        return read_events_since(self.path, offset)


class S3EventFeed:
    """The events log in the run dir's S3 export (``s3://bucket/prefix/<run>/events.jsonl``). A
    ranged GET from ``offset`` reads only what was exported since; an object not exported yet, or
    not grown, reads as nothing new."""

    def __init__(self, run_dir_uri: str, aws_conn_id: str | None = "aws_default", region_name: str | None = None):
        from fsdp_resilience.control.fsx import parse_s3_uri

        self.bucket, prefix = parse_s3_uri(run_dir_uri)
        self.key = f"{prefix.strip('/')}/events.jsonl".lstrip("/")
        self.source = f"s3://{self.bucket}/{self.key}"
        self.aws_conn_id, self.region_name = aws_conn_id, region_name

    def read(self, offset: int) -> tuple[list[dict[str, Any]], int]:
        from airflow.providers.amazon.aws.hooks.s3 import S3Hook
        from botocore.exceptions import ClientError

        client = S3Hook(aws_conn_id=self.aws_conn_id, region_name=self.region_name).get_conn()
        try:
            body = client.get_object(Bucket=self.bucket, Key=self.key, Range=f"bytes={offset}-")["Body"].read()
        except ClientError as e:
            # NoSuchKey: not exported yet; InvalidRange: nothing past the offset yet.
            if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "InvalidRange", "416"):
                return [], offset
            raise
        records, consumed = parse_event_lines(body)
        return records, offset + consumed


def event_feed_for(run_dir: str | os.PathLike) -> EventFeed:
    """The run dir where it is mounted here; else its S3 export when ``FSDP_CHECKPOINTS_S3`` is
    set (an API server without the FSx mount); else the run dir (a run not started yet)."""
    from fsdp_resilience.control import settings

    if not Path(run_dir).is_dir() and (uri := settings.checkpoints_s3_uri(str(run_dir))):
        return S3EventFeed(uri, aws_conn_id=settings.aws_conn_id())
    return RunDirEventFeed(run_dir)
