"""A launcher that starts after its launch ended leaves at once with launch_ended (69): on EKS the
pod the Job recreates for an index after the launch's pods finished, which could not reach the
rendezvous (its pod and so its DNS name are gone) and would loop until backoffLimit."""

from __future__ import annotations

from fsdp_resilience.training.contract import Event, EventLog, ExitCode, FailureClass, read_events
from fsdp_resilience.training.launch.cli import main
from fsdp_resilience.training.launch.event_tail import EventTail
from fsdp_resilience.training.launch.node import NodeLauncher
from tests.training.support import write_config


def _finals(cfg, uid: str, *records: tuple[int, str]) -> None:
    log = EventLog(cfg.layout.events, run_id=cfg.run_id, launch_id="0", role="launcher")
    for node_rank, failure in records:
        log.emit(Event.FINAL, node_rank=node_rank, failure_class=failure, exit_code=0, launch_uid=uid, message="m")


def test_a_pod_started_after_its_launch_ended_exits_launch_ended_at_once(tmp_path, dataset, monkeypatch, capsys):
    cfg = write_config(tmp_path, dataset, "ended", nodes=2, spare_nodes=1)
    cfg.layout.create()
    log = EventLog(cfg.layout.events, run_id=cfg.run_id, launch_id="0", role="launcher")
    log.emit(Event.TRAIN_BEGIN, node_rank=0)  # read after the final: the final decides
    _finals(cfg, "job-uid", (0, "success"), (1, "success"))
    monkeypatch.setenv("TRAINING_LAUNCH_ID", "0")
    monkeypatch.setenv("TRAINING_LAUNCH_UID", "job-uid")
    before = cfg.layout.events.read_text()
    rc = main(["--config", str(tmp_path / "ended.json"), "--node-rank", "2", "--rdzv-host", "ended-0.svc"])
    assert rc == int(ExitCode.LAUNCH_ENDED) == 69
    assert "had already ended" in capsys.readouterr().err
    assert cfg.layout.events.read_text() == before  # no launch_begin, no final: the run's status stands
    assert not cfg.layout.launch_lock(2).exists()  # it never waited for a predecessor's lock


def test_an_earlier_incarnation_or_an_unknown_final_does_not_end_the_launch(tmp_path, dataset, monkeypatch):
    cfg = write_config(tmp_path, dataset, "again", nodes=2, spare_nodes=1)
    cfg.layout.create()
    _finals(cfg, "old-job-uid", (0, "storage_error"))
    _finals(cfg, "job-uid", (2, "unknown"))  # a spare dropped: the launch goes on
    monkeypatch.setenv("TRAINING_LAUNCH_ID", "0")
    monkeypatch.setenv("TRAINING_LAUNCH_UID", "job-uid")
    rc = main(["--config", str(tmp_path / "again.json"), "--node-rank", "0", "--rdzv-host", "x", "--dry-run"])
    assert rc == 0
    launcher = NodeLauncher(cfg, 2, "x")
    assert launcher.launch_state(EventTail(cfg.layout.events)) is None


def test_the_launch_state_reads_the_final_first(tmp_path, dataset, monkeypatch):
    cfg = write_config(tmp_path, dataset, "state", nodes=2, spare_nodes=1)
    cfg.layout.create()
    monkeypatch.setenv("TRAINING_LAUNCH_ID", "0")
    monkeypatch.setenv("TRAINING_LAUNCH_UID", "job-uid")
    log = EventLog(cfg.layout.events, run_id=cfg.run_id, launch_id="0", role="launcher")
    log.emit(Event.TRAIN_BEGIN, node_rank=0)
    launcher = NodeLauncher(cfg, 2, "x")
    assert launcher.launch_state(EventTail(cfg.layout.events))["event"] == "train_begin"
    log.emit(Event.TRAIN_BEGIN, node_rank=1)
    _finals(cfg, "job-uid", (0, "restarts_exhausted"))
    state = NodeLauncher(cfg, 2, "x").launch_state(EventTail(cfg.layout.events))
    assert state["event"] == "final" and state["failure_class"] == "restarts_exhausted"


def test_a_launchers_final_records_its_launchs_incarnation(tmp_path, dataset, monkeypatch):
    cfg = write_config(tmp_path, dataset, "uid", nodes=1)
    cfg.layout.create()
    monkeypatch.setenv("TRAINING_LAUNCH_ID", "0")
    monkeypatch.setenv("TRAINING_LAUNCH_UID", "job-uid")
    NodeLauncher(cfg, 0, "x")._final(FailureClass.UNKNOWN, "m", 1)
    monkeypatch.delenv("TRAINING_LAUNCH_UID")  # locally: no incarnation, no field
    NodeLauncher(cfg, 0, "x")._final(FailureClass.UNKNOWN, "m", 1)
    assert [r.get("launch_uid") for r in read_events(cfg.layout.events, Event.FINAL)] == ["job-uid", None]
