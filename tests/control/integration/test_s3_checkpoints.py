"""Checkpoint progress read from a run dir's S3 export (``hooks.s3_checkpoints``) agrees with the
catalog on the run dir. S3 is moto's server on 127.0.0.1."""

from __future__ import annotations

from pathlib import Path

import boto3
import pytest

from fsdp_resilience.control.hooks.s3_checkpoints import S3CheckpointProgress, latest_committed_in_s3
from fsdp_resilience.training.contract import COMMIT_MARKER, CheckpointCatalog, RunDir

from control.fakes.saved_checkpoints import save_checkpoint

# -- checkpoint progress from the S3 export -------------------------------------------------------


@pytest.fixture()
def s3(aws):
    """A bucket in moto's server (the ``aws`` fixture: tests/control/eks_cluster.py)."""
    client = boto3.client("s3")
    client.create_bucket(Bucket="exports", CreateBucketConfiguration={"LocationConstraint": client.meta.region_name})
    yield client
    for page in client.get_paginator("list_objects_v2").paginate(Bucket="exports"):
        for obj in page.get("Contents", []):
            client.delete_object(Bucket="exports", Key=obj["Key"])
    client.delete_bucket(Bucket="exports")


def save(catalog: CheckpointCatalog, step: int, world_size: int = 2, commit: bool = True) -> None:
    """A checkpoint as the trainer leaves it: a shard per rank with its checksums and DCP's
    .metadata, then the commit."""
    save_checkpoint(catalog.layout.root, step, world_size, commit=commit)


def upload(client, run_dir: Path, prefix: str) -> None:
    for f in sorted(p for p in run_dir.rglob("*") if p.is_file()):
        client.put_object(Bucket="exports", Key=f"{prefix}/{f.relative_to(run_dir).as_posix()}", Body=f.read_bytes())


def test_s3_progress_agrees_with_the_catalog_skipping_torn_checkpoints(s3, tmp_path):
    run_dir = tmp_path / "r1"
    catalog = CheckpointCatalog(run_dir)
    RunDir(run_dir).create()
    uri = "s3://exports/runs/r1/"
    assert latest_committed_in_s3(uri, aws_conn_id=None) is None and catalog.latest() is None

    for step in (10, 20):
        save(catalog, step)
    save(catalog, 30, commit=False)  # torn: the writer died before the marker
    save(catalog, 40)
    (catalog.layout.checkpoint_dir(40) / COMMIT_MARKER).write_text('{"step": 40, "world')  # torn: half a marker
    save(catalog, 5)  # an old one, committed after the others in time
    (run_dir / "checkpoints" / "step_latest-notes").mkdir()  # not a checkpoint folder name
    (run_dir / "checkpoints" / "step_latest-notes" / "x").write_text("x")
    upload(s3, run_dir, "runs/r1")

    local = catalog.latest()
    remote = S3CheckpointProgress(uri, aws_conn_id=None).latest()
    assert local.step == 20 and [c.step for c in catalog.torn()] == [30, 40]
    assert (remote.step, remote.checkpoint_id, remote.committed, remote.world_size, remote.committed_at) == (
        local.step,
        local.checkpoint_id,
        True,
        local.world_size,
        local.committed_at,
    )
    assert remote.uri == "s3://exports/runs/r1/checkpoints/step_00000020"

    # Only torn checkpoints: no progress, on both sides.
    torn_only = tmp_path / "r2"
    save(CheckpointCatalog(torn_only), 10, commit=False)
    upload(s3, torn_only, "runs/r2")
    assert CheckpointCatalog(torn_only).latest() is None
    assert latest_committed_in_s3("s3://exports/runs/r2", aws_conn_id=None) is None


# -- the events log from the S3 export, read as it grows (the run report in the UI) ----------------


def test_the_s3_event_feed_reads_only_what_was_exported_since(s3, tmp_path):
    from fsdp_resilience.control.report.event_feed import S3EventFeed
    from fsdp_resilience.training.contract import EventLog

    feed = S3EventFeed("s3://exports/runs/r1", aws_conn_id=None)
    assert feed.source == "s3://exports/runs/r1/events.jsonl"
    assert feed.read(0) == ([], 0)  # not exported yet

    log = EventLog(tmp_path / "events.jsonl", run_id="r1")
    for step in range(1, 4):
        log.emit("step", step=step)
    exported = (tmp_path / "events.jsonl").read_bytes()
    s3.put_object(Bucket="exports", Key="runs/r1/events.jsonl", Body=exported + b'{"event": "step", "st')
    records, offset = feed.read(0)
    assert [r["step"] for r in records] == [1, 2, 3] and offset == len(exported)  # the torn line waits
    assert feed.read(offset) == ([], offset)  # nothing new past the whole lines

    log.emit("step", step=4)
    s3.put_object(Bucket="exports", Key="runs/r1/events.jsonl", Body=(tmp_path / "events.jsonl").read_bytes())
    records, end = feed.read(offset)
    assert [r["step"] for r in records] == [4] and end == (tmp_path / "events.jsonl").stat().st_size
    assert feed.read(end) == ([], end)  # a range past the end: nothing new
