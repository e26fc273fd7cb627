"""Checkpoint progress from a run dir's S3 export (FSx auto-export or an export task), for an
Airflow triggerer that does not mount FSx: the same answers as ``CheckpointCatalog`` gives on the
mount. boto3 and the amazon provider's ``S3Hook`` are imported when a read is made."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

from fsdp_resilience.control.fsx import FsxStagingError, parse_s3_uri
from fsdp_resilience.training.contract import COMMIT_MARKER, checkpoint_step, parse_commit_marker


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
        return FsxStagingError(
            f"could not read checkpoints under s3://{self.bucket}/{self.checkpoints_prefix} with "
            f"connection {self.aws_conn_id!r}: {e}; check the bucket, the export of the run dir "
            "and s3:ListBucket / s3:GetObject permissions",
            retryable=True,
        )

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
            step = checkpoint_step(prefix[len(self.checkpoints_prefix) :].rstrip("/"))
            if step is not None:
                candidates.append((step, prefix))
        client = hook.get_conn()
        for step, prefix in sorted(candidates, reverse=True):
            marker = self._read_marker(client, prefix + COMMIT_MARKER)
            if marker is not None:
                yield (
                    S3CheckpointInfo(
                        step,
                        f"s3://{self.bucket}/{prefix.rstrip('/')}",
                        True,
                        marker.get("world_size"),
                        marker.get("committed_at"),
                    ),
                    marker,
                )

    def latest(self) -> S3CheckpointInfo | None:
        """The newest committed checkpoint in S3, or None."""
        return next((info for info, _ in self.committed()), None)

    def object_sizes(self, checkpoint: S3CheckpointInfo) -> dict[str, int]:
        """Every object under a checkpoint's prefix: its name relative to the checkpoint (as the
        commit marker lists files) -> its size in bytes."""
        from botocore.exceptions import BotoCoreError, ClientError

        prefix = checkpoint.uri[len(f"s3://{self.bucket}/") :] + "/"
        sizes: dict[str, int] = {}
        try:
            for page in (
                self._s3().get_conn().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
            ):
                for obj in page.get("Contents", []):
                    sizes[obj["Key"][len(prefix) :]] = int(obj["Size"])
        except (ClientError, BotoCoreError) as e:
            raise self._error(e) from None
        return sizes


def latest_committed_in_s3(
    s3_uri: str, aws_conn_id: str | None = "aws_default", region_name: str | None = None
) -> S3CheckpointInfo | None:
    """The newest committed checkpoint of the run dir exported to ``s3_uri``, or None."""
    return S3CheckpointProgress(s3_uri, aws_conn_id, region_name).latest()
