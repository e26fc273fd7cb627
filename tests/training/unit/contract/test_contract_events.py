"""The events log (fsdp_resilience.training.contract.events): append-only, torn lines skipped, never raises."""

from fsdp_resilience.training.contract.events import Event, EventLog, read_events
from fsdp_resilience.training.contract.rundir import final_status


def test_events_log_appends_and_skips_a_torn_line(tmp_path):
    log = EventLog(tmp_path / "events.jsonl", run_id="r", rank=0)
    log.emit(Event.STEP, step=1, loss=5.0)
    with open(tmp_path / "events.jsonl", "a") as f:
        f.write('{"ts": 1, "event": "st')  # a writer killed mid-line
    log.emit(Event.FINAL, failure_class="success", exit_code=0)
    recs = read_events(tmp_path / "events.jsonl")
    assert [r["event"] for r in recs] == ["step", "final"]
    assert recs[0]["run_id"] == "r" and "host" in recs[0] and "pid" in recs[0]
    assert final_status(tmp_path)["failure_class"] == "success"


def test_events_log_never_raises_when_the_run_dir_is_gone(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    log = EventLog(tmp_path / "file" / "events.jsonl", run_id="r")
    rec = log.emit(Event.FINAL, failure_class="storage_error", exit_code=74)
    assert rec["event"] == "final"
    assert "cannot append" in capsys.readouterr().err
