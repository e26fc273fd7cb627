"""The run configuration (fsdp_resilience.training.contract.config, .timeouts): validated, JSON round-trip."""

import json

import pytest

from fsdp_resilience.training.contract.config import RunConfig
from fsdp_resilience.training.contract.failures import ConfigError
from fsdp_resilience.training.contract.timeouts import DERIVED_TIMEOUT_MARGIN_S


def make(**kw):
    base = dict(run_id="demo-1", run_dir="/tmp/run", dataset_dir="/tmp/data")
    base.update(kw)
    return RunConfig(**base)


def test_json_round_trip_keeps_every_field():
    cfg = make(nodes=2, procs_per_node=4, faults=[{"kind": "sigkill", "step": 5, "rank": 3, "attempt": 1}])
    again = RunConfig.from_json(cfg.to_json())
    assert again == cfg
    assert again.faults[0].kind == "sigkill" and again.world_size == 8


@pytest.mark.parametrize(
    "field,value,needle",
    [
        ("run_id", "Bad_ID", "run_id"),
        ("nodes", 0, "nodes=0 is out of range"),
        ("procs_per_node", "2", "procs_per_node must be an integer"),
        ("steps", True, "steps must be an integer"),
        ("lr", -1.0, "lr=-1.0 is out of range"),
        ("restart_mode", "magic", "restart_mode='magic' is not valid; use one of layered"),
        ("model", "70b", "model='70b' is not valid"),
        ("device", "tpu", "device='tpu'"),
        ("checkpoint_interval", 0, "checkpoint_interval=0"),
    ],
)
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


def test_a_drill_while_saving_is_a_ranks_own_fault_after_the_first_save():
    cfg = make(checkpoint_interval=3, faults=[{"kind": "exception", "step": 4, "rank": 1, "while_saving": True}])
    assert cfg.faults[0].while_saving and RunConfig.from_json(cfg.to_json()) == cfg
    assert make(faults=[{"kind": "exception", "step": 4}]).faults[0].while_saving is False
    with pytest.raises(ConfigError, match=r"faults\[0\].while_saving=True.*one of exception, hang.*e.g. step 4"):
        make(checkpoint_interval=3, faults=[{"kind": "exception", "step": 3, "while_saving": True}])
    with pytest.raises(ConfigError, match=r"faults\[0\].while_saving=True"):
        make(checkpoint_interval=3, faults=[{"kind": "node_loss", "step": 7, "while_saving": True}])
    with pytest.raises(ConfigError, match=r"faults\[0\].while_saving='yes': true or false"):
        make(faults=[{"kind": "exception", "step": 4, "while_saving": "yes"}])


def test_log_interval_unset_is_one_on_cpu_and_twenty_on_cuda():
    assert make().log_interval is None
    assert (make().log_every("gloo"), make().log_every("nccl")) == (1, 20)
    assert (make(log_interval=5).log_every("gloo"), make(log_interval=5).log_every("nccl")) == (5, 5)
    with pytest.raises(ConfigError, match="log_interval=0 is out of range"):
        make(log_interval=0)


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
    layered = (
        make(device="cpu", collective_timeout_s=3.0, hang_timeout_s=15.0, heartbeat_timeout_s=30.0)
        .timeouts("gloo")
        .derive("layered", 5.0, 0.2, {"step": 0.15})
    )
    assert layered.heartbeat_s > 15.0 and layered.floor_s == 15.0 + DERIVED_TIMEOUT_MARGIN_S
    # A section not measured keeps its configured timeout; what was measured is recorded.
    assert layered.sections["checkpoint"] == 30.0 and layered.measured_section_s == {"step": 0.15}
    record = json.loads(json.dumps(layered.to_dict()))
    assert record["measured_heartbeat_interval_s"] == 0.2 and record["safety_factor"] == 5.0
    # Only the sections the warm steps measure are derived; the others stay as configured.
    cfg = make(
        initial_heartbeat_timeout_s=90.0,
        heartbeat_timeout_s=30.0,
        collective_timeout_s=3.0,
        hang_timeout_s=15.0,
        device="cpu",
    )
    assert cfg.section_timeouts() == {"setup": 90.0, "step": 30.0, "checkpoint": 30.0, "final_checkpoint": 90.0}
    with pytest.raises(ConfigError, match="timeout_safety_factor"):
        make(timeout_safety_factor=0.5, device="cpu")


def test_fault_selection_by_step_rank_attempt_and_node():
    cfg = make(
        nodes=2,
        procs_per_node=1,
        faults=[
            {"kind": "exception", "step": 3, "rank": 1},
            {"kind": "sigkill", "step": 5, "rank": 0, "attempt": 1},
            {"kind": "node_loss", "step": 7, "node": 1},
            {"kind": "user_bug", "step": 9, "rank": 0},
        ],
    )
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


@pytest.mark.parametrize("field", ["run_dir", "dataset_dir"])
def test_a_folder_path_that_is_or_sits_under_a_file_is_a_config_error(tmp_path, field):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError, match=f"{field}=.* sits under .*afile, which is a file"):
        make(**{field: str(tmp_path / "afile" / "run")})
    with pytest.raises(ConfigError, match=f"{field}=.*afile is a file, not a folder"):
        make(**{field: str(tmp_path / "afile")})
    make(**{field: str(tmp_path / "not" / "yet")})  # created later: fine
