"""The control plane evaluates, exports and publishes only a checkpoint that verifies: the newest
committed one whose files match the sizes and CRC32C its commit marker lists. Checkpoints as the
training plane leaves them (shards, each rank's checksum record, .metadata, the commit), damaged
the way disks and people damage them; S3 is moto's server."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import boto3
import pytest

from fsdp_resilience.control import ladder, settings
from fsdp_resilience.control.report.build import build_report
from fsdp_resilience.control.task_data import Run
from fsdp_resilience.control.trusted_checkpoint import CHECKSUMS, SIZES, NoTrustedCheckpoint
from fsdp_resilience.training.contract import COMMIT_MARKER, CheckpointCatalog, Event, read_events

from control.fakes.saved_checkpoints import flip_bytes, save_checkpoint


@pytest.fixture()
def runs_root(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "fsx" / "runs"
    monkeypatch.setenv("FSDP_RUNS_ROOT", str(root))
    monkeypatch.setenv("FSDP_FSX_MOUNT_PATH", str(tmp_path / "fsx"))
    return root


def run_for(name: str, backend: str = "local") -> Run:
    """A run as validate_config builds it, placed on ``backend`` (the checkpoint checks never call
    the backend, so an EKS run needs no cluster here)."""
    run = ladder.build_run_config({"run_name": name, "dataset": "c4", "backend": "local"}, dag_run_id=name)
    return dataclasses.replace(run, backend=settings.backend_config(backend))


def damaged_run(run_dir: Path) -> None:
    """Four committed checkpoints: 10 and 20 intact, 30 missing a shard, 40 with flipped bytes;
    and a torn 50 (no marker) that nothing ever counts."""
    for step in (10, 20, 30, 40):
        save_checkpoint(run_dir, step)
    save_checkpoint(run_dir, 50, commit=False)
    (run_dir / "checkpoints" / "step_00000030" / "__0_0.distcp").unlink()
    flip_bytes(run_dir / "checkpoints" / "step_00000040" / "__1_0.distcp")


def test_publish_skips_flipped_bytes_and_a_missing_shard_and_quarantines_them_on_the_local_backend(runs_root):
    run = run_for("damaged")
    run_dir = Path(run.config["run_dir"])
    damaged_run(run_dir)

    published = ladder.publish(run, {"checkpoint_id": "step_00000020"})
    assert published["checkpoint_id"] == "step_00000020" and published["step"] == 20
    assert published["checkpoint"] == str(run_dir / "checkpoints" / "step_00000020")
    assert published["verified"] == CHECKSUMS and "note" not in published
    newest_first = [(s["checkpoint_id"], s["reason"]) for s in published["skipped"]]
    assert newest_first == [("step_00000040", newest_first[0][1]), ("step_00000030", "__0_0.distcp is missing")]
    assert "__1_0.distcp fails its crc32c check" in newest_first[0][1]

    # The local run dir is the trainers' own disk: both are moved aside, so no layer loads them again.
    catalog = CheckpointCatalog(run_dir)
    assert [c.step for c in catalog.committed()] == [10, 20]
    quarantined = catalog.quarantined()
    assert [(q["checkpoint_id"], q["by"]) for q in quarantined] == [
        ("step_00000040", "control plane (publish)"),
        ("step_00000030", "control plane (publish)"),
    ]
    assert all(Path(s["quarantined_to"]).is_dir() for s in published["skipped"])
    events = read_events(run_dir / "events.jsonl", Event.CHECKPOINT_QUARANTINED)
    assert [(r["checkpoint_id"], r["role"], r["task"]) for r in events] == [
        ("step_00000040", "control-plane", "publish"),
        ("step_00000030", "control-plane", "publish"),
    ]
    assert all(r["reason"] and r["moved_to"] for r in events)

    # Publishing again finds the same one at once: nothing left to skip.
    again = ladder.publish(run, {"checkpoint_id": "step_00000020"})
    assert again["checkpoint_id"] == "step_00000020" and again["skipped"] == []

    # The run report names them, with the reasons and where they are now.
    text = build_report(run_dir).markdown.read_text()
    assert "## Checkpoints that failed" in text and "Quarantined" in text
    assert "| step_00000040 | 40 | control plane (publish) |" in text
    assert "__0_0.distcp is missing" in text and "checkpoints/quarantine/step_00000030." in text
    assert "| checkpoints quarantined / skipped / stale saves | 2 / 0 / 0 |" in text


def test_on_eks_a_checkpoint_that_fails_is_skipped_and_left_where_it_is(runs_root):
    run = run_for("on-fsx", backend="eks")
    run_dir = Path(run.config["run_dir"])
    damaged_run(run_dir)
    for task in ("evaluate", "publish"):  # both tasks check, and say so
        choice = ladder.trusted_checkpoint(run, task=task)
        assert choice.checkpoint_id == "step_00000020" and choice.verified == CHECKSUMS
        assert [s["checkpoint_id"] for s in choice.skipped] == ["step_00000040", "step_00000030"]
        assert not any("quarantined_to" in s for s in choice.skipped)
    catalog = CheckpointCatalog(run_dir)
    assert [c.step for c in catalog.committed()] == [10, 20, 30, 40] and catalog.quarantined() == []
    skips = read_events(run_dir / "events.jsonl", Event.CHECKPOINT_SKIP)
    assert len(skips) == 4 and {r["task"] for r in skips} == {"evaluate", "publish"}
    # The report lists each skipped checkpoint once, whichever task found it.
    text = build_report(run_dir).markdown.read_text()
    assert text.count("| step_00000040 |") == 1 and text.count("| step_00000030 |") == 1
    assert "| checkpoints quarantined / skipped / stale saves | 0 / 2 / 0 |" in text
    assert "— fails verification: __1_0.distcp" not in text  # same size: only a checksum finds it
    assert "(step 40)" in text


def test_when_no_checkpoint_verifies_nothing_is_published_and_the_error_says_why(runs_root):
    run = run_for("all-bad", backend="eks")
    run_dir = Path(run.config["run_dir"])
    run_dir.mkdir(parents=True)
    with pytest.raises(NoTrustedCheckpoint, match="has no committed checkpoint"):
        ladder.publish(run, {})  # no checkpoint yet: train first
    save_checkpoint(run_dir, 10)
    (run_dir / "checkpoints" / "step_00000010" / ".metadata").write_bytes(b"truncated")
    # A marker from before checksums: committed, but nothing to verify it against.
    save_checkpoint(run_dir, 20)
    (run_dir / "checkpoints" / "step_00000020" / COMMIT_MARKER).write_text(json.dumps({"step": 20, "world_size": 2}))
    with pytest.raises(NoTrustedCheckpoint) as error:
        ladder.publish(run, {})
    message = str(error.value)
    assert "step_00000020: the commit marker lists no checksummed files" in message
    assert "step_00000010: .metadata is 9 bytes" in message
    assert "Nothing was evaluated or published" in message and "checkpoints/quarantine/" in message
    assert [s["checkpoint_id"] for s in error.value.skipped] == ["step_00000020", "step_00000010"]


def test_publish_says_so_when_the_evaluated_checkpoint_no_longer_verifies(runs_root):
    run = run_for("changed")
    run_dir = Path(run.config["run_dir"])
    for step in (10, 20):
        save_checkpoint(run_dir, step)
    evaluation = {"checkpoint_id": ladder.trusted_checkpoint(run, task="evaluate").checkpoint_id}
    assert evaluation["checkpoint_id"] == "step_00000020"
    (run_dir / "checkpoints" / "step_00000020" / "__1_0.distcp").write_bytes(b"")  # emptied since
    published = ladder.publish(run, evaluation)
    assert published["checkpoint_id"] == "step_00000010"
    assert published["evaluated_checkpoint_id"] == "step_00000020"
    assert "the evaluation is of step_00000020, not of the published step_00000010" in published["note"]
    assert "__1_0.distcp is 0 bytes, the commit recorded 256" in published["skipped"][0]["reason"]


def test_without_the_mount_the_s3_export_is_checked_by_its_marker_and_sizes(runs_root, tmp_path, monkeypatch, aws):
    client = boto3.client("s3")
    client.create_bucket(Bucket="trusted", CreateBucketConfiguration={"LocationConstraint": client.meta.region_name})
    monkeypatch.setenv("FSDP_CHECKPOINTS_S3", "s3://trusted/exports/runs")
    monkeypatch.setenv("FSDP_AWS_CONN_ID", "aws_fake")
    run = run_for("exported", backend="eks")
    assert not Path(run.config["run_dir"]).exists()  # FSx is not mounted in this worker
    written = tmp_path / "on-fsx"  # what the pods wrote, as the export copied it to S3
    damaged_run(written)
    (written / "checkpoints" / "step_00000030").rename(written / "checkpoints" / "step_00000035")  # keep 30's
    save_checkpoint(written, 30)
    for f in sorted(p for p in written.rglob("*") if p.is_file()):
        client.put_object(
            Bucket="trusted", Key=f"exports/runs/exported/{f.relative_to(written).as_posix()}", Body=f.read_bytes()
        )
    # In S3: step 40 is complete but its bytes flipped; a shard of step 30 was cut short.
    client.put_object(
        Bucket="trusted", Key="exports/runs/exported/checkpoints/step_00000030/__1_0.distcp", Body=b"short"
    )

    choice = ladder.trusted_checkpoint(run, task="publish")
    # Sizes cannot see flipped bytes: the pods' checksums at load do. They do see a short shard.
    assert choice.checkpoint_id == "step_00000040" and choice.verified == SIZES
    assert choice.location == "s3://trusted/exports/runs/exported/checkpoints/step_00000040"
    client.delete_object(Bucket="trusted", Key="exports/runs/exported/checkpoints/step_00000040/.metadata")
    choice = ladder.trusted_checkpoint(run, task="publish")
    assert choice.checkpoint_id == "step_00000020"
    assert [(s["checkpoint_id"], s["reason"]) for s in choice.skipped] == [
        ("step_00000040", ".metadata is missing"),
        ("step_00000035", "__0_0.distcp is missing"),
        ("step_00000030", "__1_0.distcp is 5 bytes, the commit recorded 256"),
    ]
    assert not Path(run.config["run_dir"]).exists()  # nothing was written anywhere

    monkeypatch.delenv("FSDP_CHECKPOINTS_S3")
    with pytest.raises(NoTrustedCheckpoint, match="not readable here and no S3 export"):
        ladder.trusted_checkpoint(run, task="publish")


def test_the_export_takes_the_run_records_and_the_verified_checkpoint_only(runs_root, monkeypatch):
    run = run_for("export", backend="eks")
    run_dir = Path(run.config["run_dir"])
    assert ladder.export_plan(run, {"checkpoint_id": "step_00000020"})[0] is None  # no file system configured
    monkeypatch.setenv("FSDP_FSX_FILE_SYSTEM_ID", "fs-0123456789abcdef0")
    damaged_run(run_dir)
    for name in ("run.json", "events.jsonl", "eval.json", ".eval.json.tmp.77"):
        (run_dir / name).write_text("{}")
    for folder in ("report", "logs"):
        (run_dir / folder).mkdir()
    plan, why = ladder.export_plan(run, {"checkpoint_id": "step_00000020"})
    assert plan["paths"] == [
        f"/runs/export/{name}" for name in ("eval.json", "events.jsonl", "logs", "report", "run.json")
    ] + ["/runs/export/checkpoints/step_00000020"]
    assert "no other checkpoint" in why and plan["file_system_id"] == "fs-0123456789abcdef0"
    with pytest.raises(ladder.EscalationError, match="names no checkpoint"):
        ladder.export_plan(run, {})
