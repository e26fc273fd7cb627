"""The run contract (src/fsdp_resilience/training/contract.py): torch-free, validated, stable on disk."""

import json
import subprocess
import sys

import pytest

from fsdp_resilience.training.contract import (
    COMMIT_MARKER,
    CheckpointCatalog,
    ConfigError,
    Event,
    EventLog,
    ExitCode,
    FailureClass,
    RunConfig,
    RunDir,
    declare_stop,
    failure_class_for_exit,
    final_status,
    probe_writable,
    read_events,
    read_stop,
    storage_errno,
    verify_checkpoint,
    write_rank_sums,
)


def make(**kw):
    base = dict(run_id="demo-1", run_dir="/tmp/run", dataset_dir="/tmp/data")
    base.update(kw)
    return RunConfig(**base)


def test_json_round_trip_keeps_every_field():
    cfg = make(nodes=2, procs_per_node=4, faults=[{"kind": "sigkill", "step": 5, "rank": 3, "attempt": 1}])
    again = RunConfig.from_json(cfg.to_json())
    assert again == cfg
    assert again.faults[0].kind == "sigkill" and again.world_size == 8


@pytest.mark.parametrize("field,value,needle", [
    ("run_id", "Bad_ID", "run_id"),
    ("nodes", 0, "nodes=0 is out of range"),
    ("procs_per_node", "2", "procs_per_node must be an integer"),
    ("steps", True, "steps must be an integer"),
    ("lr", -1.0, "lr=-1.0 is out of range"),
    ("restart_mode", "magic", "restart_mode='magic' is not valid; use one of layered"),
    ("model", "70b", "model='70b' is not valid"),
    ("device", "tpu", "device='tpu'"),
    ("checkpoint_interval", 0, "checkpoint_interval=0"),
])
def test_bad_values_are_rejected_with_the_field_named(field, value, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace("[", r"\[")):
        make(**{field: value})


def test_bad_fault_drills_are_rejected():
    with pytest.raises(ConfigError, match=r"faults\[0\].kind='meteor'"):
        make(faults=[{"kind": "meteor", "step": 1}])
    with pytest.raises(ConfigError, match=r"faults\[0\].rank=2 must be a global rank in \[0, 2\)"):
        make(faults=[{"kind": "sigkill", "step": 1, "rank": 2}])
    with pytest.raises(ConfigError, match=r"faults\[0\].step=500 must be between 1 and steps=100"):
        make(faults=[{"kind": "exception", "step": 500}])
    with pytest.raises(ConfigError, match="unknown field"):
        make(faults=[{"kind": "exception", "step": 1, "when": "now"}])


def test_unknown_and_missing_fields_are_named():
    with pytest.raises(ConfigError, match=r"unknown run config field\(s\) \['stepz'\]"):
        RunConfig.from_dict({"run_id": "a", "run_dir": "r", "dataset_dir": "d", "stepz": 3})
    with pytest.raises(ConfigError, match=r"missing required field\(s\) \['dataset_dir'\]"):
        RunConfig.from_dict({"run_id": "a", "run_dir": "r"})
    with pytest.raises(ConfigError, match="not valid JSON"):
        RunConfig.from_json("{nope")


def test_heartbeat_must_outlast_an_inprocess_restart():
    with pytest.raises(ConfigError, match="heartbeat_timeout_s=3.0 must exceed"):
        make(heartbeat_timeout_s=3.0, collective_timeout_s=3.0, device="cpu")


def test_nccl_timeout_must_exceed_the_wrappers_hard_timeout():
    """On NCCL the watchdog kills ranks whose collective timed out: below the Wrapper's hard
    timeout, it would kill the healthy ranks before a hang is recovered in-process."""
    with pytest.raises(ConfigError, match=r"collective_timeout_s=30.0 must exceed the in-process hard timeout"):
        make(device="cuda", collective_timeout_s=30.0, hang_timeout_s=60.0)
    # "auto" may run on either backend, so both orders must hold.
    with pytest.raises(ConfigError, match="on nccl"):
        make(device="auto", collective_timeout_s=3.0, hang_timeout_s=15.0, heartbeat_timeout_s=30.0)
    # Without a Wrapper there is nothing to outlast.
    make(device="cuda", collective_timeout_s=30.0, hang_timeout_s=60.0, restart_mode="injob")
    # The tests' CPU settings are a valid gloo order.
    make(device="cpu", collective_timeout_s=3.0, hang_timeout_s=15.0, heartbeat_timeout_s=30.0)


def test_collective_timeout_unset_is_derived_per_backend():
    cfg = make(device="auto", hang_timeout_s=60.0, heartbeat_timeout_s=120.0)
    gloo, nccl = cfg.timeouts("gloo"), cfg.timeouts("nccl")
    assert gloo.collective_s == 30.0
    assert nccl.collective_s > nccl.hard_s == 120.0
    assert nccl.soft_s < nccl.hard_s < nccl.collective_s
    assert cfg.collective_backends == ("gloo", "nccl")
    assert make(device="cuda").collective_backends == ("nccl",)
    assert RunConfig.from_json(cfg.to_json()).collective_timeout_s is None


def test_derived_timeouts_keep_the_restart_layers_order():
    """ft_launcher's timeouts derived from measured intervals: safety factor x the measure, but
    never short enough to cut an in-process restart (gloo: collective timeout + a step) nor to act
    before the Wrapper's soft timeout (layered), and never longer than configured."""
    from fsdp_resilience.training.contract import DERIVED_TIMEOUT_MARGIN_S

    gloo = make(device="cpu", collective_timeout_s=3.0, hang_timeout_s=2.0, heartbeat_timeout_s=30.0).timeouts("gloo")
    # A short step: the in-process restart's pause (collective + the step) is the floor.
    derived = gloo.derive("layered", 5.0, heartbeat_interval_s=0.2, section_s={"step": 0.15, "checkpoint": 0.1})
    assert derived.floor_s == pytest.approx(3.0 + 0.2 + DERIVED_TIMEOUT_MARGIN_S)
    assert derived.heartbeat_s == derived.floor_s == derived.sections["step"] == derived.sections["checkpoint"]
    assert derived.heartbeat_s < 30.0 and derived.initial_heartbeat_s == 600.0  # never derived
    # Slow steps: the safety factor rules, up to the configured ceiling.
    slow = gloo.derive("layered", 5.0, heartbeat_interval_s=2.0, section_s={"step": 1.5, "checkpoint": 0.5})
    assert slow.heartbeat_s == 10.0 and slow.sections == {"step": 7.5, "checkpoint": slow.floor_s}
    assert gloo.derive("layered", 5.0, 8.0, {"step": 8.0, "checkpoint": 8.0}).heartbeat_s == 30.0
    # Layered: the Wrapper's soft timeout acts first.
    layered = make(device="cpu", collective_timeout_s=3.0, hang_timeout_s=15.0,
                   heartbeat_timeout_s=30.0).timeouts("gloo").derive("layered", 5.0, 0.2, {"step": 0.15})
    assert layered.heartbeat_s > 15.0 and layered.floor_s == 15.0 + DERIVED_TIMEOUT_MARGIN_S
    # A section not measured keeps its configured timeout; what was measured is recorded.
    assert layered.sections["checkpoint"] == 30.0 and layered.measured_section_s == {"step": 0.15}
    record = json.loads(json.dumps(layered.to_dict()))
    assert record["measured_heartbeat_interval_s"] == 0.2 and record["safety_factor"] == 5.0
    # Only the sections the warm steps measure are derived; the others stay as configured.
    cfg = make(initial_heartbeat_timeout_s=90.0, heartbeat_timeout_s=30.0, collective_timeout_s=3.0, hang_timeout_s=15.0,
               device="cpu")
    assert cfg.section_timeouts() == {"setup": 90.0, "step": 30.0, "checkpoint": 30.0, "final_checkpoint": 90.0}
    with pytest.raises(ConfigError, match="timeout_safety_factor"):
        make(timeout_safety_factor=0.5, device="cpu")


def test_fault_selection_by_step_rank_attempt_and_node():
    cfg = make(nodes=2, procs_per_node=1, faults=[
        {"kind": "exception", "step": 3, "rank": 1},
        {"kind": "sigkill", "step": 5, "rank": 0, "attempt": 1},
        {"kind": "node_loss", "step": 7, "node": 1},
        {"kind": "user_bug", "step": 9, "rank": 0},
    ])
    assert cfg.fault_at(3, rank=1, attempt=0, node=1).kind == "exception"
    assert cfg.fault_at(3, rank=0, attempt=0, node=0) is None
    assert cfg.fault_at(5, rank=0, attempt=0, node=0) is None
    assert cfg.fault_at(5, rank=0, attempt=1, node=0).kind == "sigkill"
    assert cfg.fault_at(7, rank=1, attempt=0, node=1).kind == "node_loss"
    assert cfg.fault_at(7, rank=0, attempt=0, node=0) is None
    assert cfg.fault_at(9, rank=0, attempt=4, node=0).kind == "user_bug"  # every attempt


def test_a_bad_node_drill_fires_every_attempt_on_that_node_only():
    cfg = make(faults=[{"kind": "sigkill", "step": 4, "rank": 1, "attempt": None, "node_id": "slot-0"}])
    assert RunConfig.from_json(cfg.to_json()) == cfg
    for attempt in (0, 1, 7):
        assert cfg.fault_at(4, rank=1, attempt=attempt, node=0, node_id="slot-0").kind == "sigkill"
    assert cfg.fault_at(4, rank=1, attempt=0, node=0, node_id="slot-1") is None
    with pytest.raises(ConfigError, match="or null for every attempt"):
        make(faults=[{"kind": "sigkill", "step": 4, "attempt": -1}])


def test_exit_codes_map_to_failure_classes_both_ways():
    assert failure_class_for_exit(0) is FailureClass.SUCCESS
    assert failure_class_for_exit(ExitCode.USER_ERROR) is FailureClass.USER_ERROR
    assert failure_class_for_exit(75) is FailureClass.RESTARTS_EXHAUSTED
    assert failure_class_for_exit(93) is FailureClass.NO_PROGRESS
    assert failure_class_for_exit(137) is FailureClass.UNKNOWN
    assert not FailureClass.USER_ERROR.retryable and FailureClass.RESTARTS_EXHAUSTED.retryable


def _fake_checkpoint(layout, step, committed):
    d = layout.checkpoint_dir(step)
    d.mkdir(parents=True)
    for rank in (0, 1):
        (d / f"__{rank}_0.distcp").write_bytes(bytes([rank]) * 4096)
        write_rank_sums(d, rank, [f"__{rank}_0.distcp"])
    (d / ".metadata").write_bytes(b"m")
    if committed:
        CheckpointCatalog(layout).commit(step, world_size=2)
    return d


def test_catalog_ignores_torn_checkpoints_and_retention_keeps_last_k(tmp_path):
    layout = RunDir(tmp_path)
    layout.create()
    for step in (10, 20, 30, 40):
        _fake_checkpoint(layout, step, committed=True)
    _fake_checkpoint(layout, 25, committed=False)  # torn, older than the newest
    _fake_checkpoint(layout, 50, committed=False)  # torn or still being written
    cat = CheckpointCatalog(layout)
    assert cat.latest().step == 40
    assert layout.latest_pointer.read_text().strip() == "step_00000040"
    assert [c.step for c in cat.torn()] == [25, 50]
    deleted = cat.apply_retention(keep=2)
    assert sorted(p.name for p in deleted) == ["step_00000010", "step_00000020", "step_00000025"]
    assert [c.step for c in cat.all()] == [30, 40, 50]  # a newer torn folder is not ours to delete
    assert json.loads((layout.checkpoint_dir(40) / COMMIT_MARKER).read_text())["world_size"] == 2


def test_commit_refuses_a_checkpoint_without_metadata(tmp_path):
    layout = RunDir(tmp_path)
    layout.checkpoint_dir(5).mkdir(parents=True)
    with pytest.raises(RuntimeError, match="metadata is missing"):
        CheckpointCatalog(layout).commit(5, world_size=1)


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


def test_final_status_reports_a_failed_node_over_a_successful_one(tmp_path):
    log = EventLog(RunDir(tmp_path).events, run_id="r")
    log.emit(Event.FINAL, node_rank=1, failure_class="restarts_exhausted", exit_code=75)
    log.emit(Event.FINAL, node_rank=0, failure_class="success", exit_code=0)
    assert final_status(tmp_path)["failure_class"] == "restarts_exhausted"
    assert final_status(tmp_path / "nothing") is None


def test_the_contract_and_launcher_never_import_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import fsdp_resilience.training.contract, fsdp_resilience.training.launch\n"
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_commit_records_every_file_and_refuses_without_checksums(tmp_path):
    layout = RunDir(tmp_path)
    d = _fake_checkpoint(layout, 10, committed=True)
    marker = json.loads((d / COMMIT_MARKER).read_text())
    assert marker["checksum"] == "crc32c"
    assert sorted(marker["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert marker["files"]["__1_0.distcp"]["size"] == 4096
    assert verify_checkpoint(d) is None
    # a rank's checksums missing: not committed
    d2 = _fake_checkpoint(layout, 20, committed=False)
    (d2 / ".sums" / "rank_00001.json").unlink()
    with pytest.raises(RuntimeError, match=r"no checksums from rank\(s\) \[1\]"):
        CheckpointCatalog(layout).commit(20, world_size=2)
    # a file nobody checksummed: not committed
    d3 = _fake_checkpoint(layout, 30, committed=False)
    (d3 / "__2_0.distcp").write_bytes(b"stray")
    with pytest.raises(RuntimeError, match="no checksum for"):
        CheckpointCatalog(layout).commit(30, world_size=2)
    assert [c.step for c in CheckpointCatalog(layout).committed()] == [10]


@pytest.mark.parametrize("damage, reason", [
    (lambda d: (d / "__1_0.distcp").unlink(), "__1_0.distcp is missing"),
    (lambda d: (d / "__0_0.distcp").write_bytes(b"\0" * 100), "is 100 bytes"),
    (lambda d: _flip(d / "__0_0.distcp", 17), "fails its crc32c check"),
    (lambda d: _flip(d / ".metadata", 0), ".metadata fails its crc32c check"),
])
def test_verify_names_what_is_wrong(tmp_path, damage, reason):
    d = _fake_checkpoint(RunDir(tmp_path), 10, committed=True)
    damage(d)
    assert reason in verify_checkpoint(d)


def _flip(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_marker_without_checksums_does_not_verify(tmp_path):
    d = _fake_checkpoint(RunDir(tmp_path), 10, committed=True)
    (d / COMMIT_MARKER).write_text(json.dumps({"step": 10, "world_size": 2}))
    assert "lists no checksummed files" in verify_checkpoint(d)


def test_quarantine_moves_aside_with_the_reason_and_fixes_latest(tmp_path):
    layout = RunDir(tmp_path)
    for step in (10, 20):
        _fake_checkpoint(layout, step, committed=True)
    cat = CheckpointCatalog(layout)
    moved = cat.quarantine(cat.latest(), "__0_0.distcp fails its crc32c check", rank=1)
    assert not layout.checkpoint_dir(20).exists() and moved.parent == layout.quarantine
    assert [c.step for c in cat.committed()] == [10]
    assert cat.latest_hint() == "step_00000010" and layout.latest_step.read_text().strip() == "10"
    (rec,) = cat.quarantined()
    assert rec["checkpoint_id"] == "step_00000020" and "crc32c" in rec["reason"] and rec["rank"] == 1
    # retention never looks inside the quarantine
    assert cat.apply_retention(keep=1) == [] and moved.exists()


def test_latest_pointer_is_only_a_hint(tmp_path):
    layout = RunDir(tmp_path)
    _fake_checkpoint(layout, 10, committed=True)
    layout.latest_pointer.write_text("../../etc/passwd\n")
    cat = CheckpointCatalog(layout)
    assert cat.latest_hint() is None and cat.latest().step == 10
    layout.latest_pointer.write_text("step_00000099\n")  # dangling
    assert cat.latest().step == 10


def test_retention_never_deletes_the_newest_checkpoint_that_verifies(tmp_path):
    layout = RunDir(tmp_path)
    for step in (10, 20, 30, 40):
        _fake_checkpoint(layout, step, committed=True)
    # the two newest are damaged (a shard gone, a shard truncated): 20 is the newest good one
    (layout.checkpoint_dir(40) / "__0_0.distcp").unlink()
    (layout.checkpoint_dir(30) / "__1_0.distcp").write_bytes(b"short")
    deleted = CheckpointCatalog(layout).apply_retention(keep=2)
    assert [p.name for p in deleted] == ["step_00000010"]
    assert verify_checkpoint(layout.checkpoint_dir(20)) is None
    # and a protected step survives however old it is
    for step in (50, 60):
        _fake_checkpoint(layout, step, committed=True)
    deleted = CheckpointCatalog(layout).apply_retention(keep=2, protect={30})
    assert sorted(p.name for p in deleted) == ["step_00000020", "step_00000040"]


def test_stop_marker_first_writer_wins(tmp_path):
    layout = RunDir(tmp_path)
    assert read_stop(layout) is None
    assert declare_stop(layout, FailureClass.NON_FINITE, rank=1, step=7, error="loss is nan")
    assert not declare_stop(layout, FailureClass.USER_ERROR, rank=0, step=7, error="x")
    assert read_stop(layout)["failure_class"] == "non_finite" and read_stop(layout)["rank"] == 1
    layout.stop_marker.write_text("{torn")
    assert read_stop(layout)["failure_class"] == "user_error"
    with pytest.raises(ValueError):
        declare_stop(layout, FailureClass.RESTARTS_EXHAUSTED)


def test_new_failure_classes_have_documented_exit_codes():
    assert failure_class_for_exit(65) is FailureClass.NON_FINITE
    assert failure_class_for_exit(73) is FailureClass.ALREADY_RUNNING
    assert failure_class_for_exit(74) is FailureClass.STORAGE_ERROR
    for cls in (FailureClass.NON_FINITE, FailureClass.ALREADY_RUNNING, FailureClass.STORAGE_ERROR):
        assert not cls.retryable  # none of them is the machine's fault


def test_storage_errors_are_recognised_through_causes_and_text(tmp_path):
    import errno
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as e:
            raise RuntimeError("save failed") from e
    except RuntimeError as e:
        assert storage_errno(e) == errno.ENOSPC
    assert storage_errno(RuntimeError("rank 1: [Errno 30] Read-only file system: '/fsx/x'")) == errno.EROFS
    assert storage_errno(RuntimeError("[Errno 2] No such file")) is None
    assert probe_writable(tmp_path) is None
    (tmp_path / "f").write_text("x")
    assert "not writable" in probe_writable(tmp_path / "f" / "sub")


def test_events_log_never_raises_when_the_run_dir_is_gone(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    log = EventLog(tmp_path / "file" / "events.jsonl", run_id="r")
    rec = log.emit(Event.FINAL, failure_class="storage_error", exit_code=74)
    assert rec["event"] == "final"
    assert "cannot append" in capsys.readouterr().err


@pytest.mark.parametrize("field", ["run_dir", "dataset_dir"])
def test_a_folder_path_that_is_or_sits_under_a_file_is_a_config_error(tmp_path, field):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError, match=f"{field}=.* sits under .*afile, which is a file"):
        make(**{field: str(tmp_path / "afile" / "run")})
    with pytest.raises(ConfigError, match=f"{field}=.*afile is a file, not a folder"):
        make(**{field: str(tmp_path / "afile")})
    make(**{field: str(tmp_path / "not" / "yet")})  # created later: fine
