"""Checkpoints you can trust, end to end: real 2-rank CPU training through ``python -m
training.launch``, damaged the way disks, people and bugs damage runs, then judged as the control
plane judges it: exit code, final status, the run dir and events.jsonl. No mocks.

- damaged checkpoints (flipped bytes in model weights and in optimizer state, a deleted shard, a
  damaged ``.metadata``, a garbage or dangling ``latest`` pointer) -> the resume falls back to
  the newest checkpoint that verifies, quarantines the damaged one, and the run succeeds;
- evaluation of a damaged checkpoint -> the newest earlier one that verifies, or a one-line error;
- NaN drills -> rollback to the newest verified checkpoint; never a non-finite checkpoint; a
  persistent NaN ends ``non_finite`` (exit 65);
- a SIGSTOPped checkpoint writer -> replaced, the run succeeds;
- dropout with per-rank RNG state -> an interrupted run ends bitwise identical to a clean one.

In each case: no committed, verified checkpoint is lost, and no process is left behind.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from conftest import REPO, Run, launch, write_config
from training.contract import (
    QUARANTINE_RECORD,
    CheckpointCatalog,
    ExitCode,
    RunConfig,
    final_status,
    read_events,
    read_stop,
    verify_checkpoint,
)

pytestmark = pytest.mark.slow

STEPS = 9  # checkpoints at 3, 6, 9 (interval 3, keep 3)
LAUNCH_ENV = "TRAINING_LAUNCH_PID"


# -------------------------------------------------------------------------------------- helpers


def processes_of(launcher_pid: int) -> list[str]:
    """Live processes started under ``launcher_pid`` (training.launch hands its pid to everything
    below it, ranks and checkpoint writers included, in their environment)."""
    needle = f"{LAUNCH_ENV}={launcher_pid}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:200]
        except OSError:
            continue  # gone meanwhile, or not ours to read
        if state != "Z":
            found.append(f"{entry} ({state}) {cmd}")
    return found


def run_to_end(tmp_path: Path, cfg: RunConfig, timeout: float = 400) -> Run:
    """Launch ``cfg`` as a pod would, wait for it, and check that it left no process behind."""
    cfg_path = tmp_path / f"{cfg.run_id}.json"
    cfg_path.write_text(cfg.to_json())
    proc = launch(cfg, cfg_path)
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    output = cfg_path.with_suffix(".node0.log").read_text()
    left = processes_of(proc.pid)
    for _ in range(20):  # the launcher reaps before it exits; allow a loaded machine to catch up
        if not left:
            break
        time.sleep(0.5)
        left = processes_of(proc.pid)
    assert not left, f"processes left behind by the launcher (pid {proc.pid}):\n" + "\n".join(left)
    return Run(cfg, rc, output)


def train(tmp_path: Path, dataset: Path, run_id: str, **overrides) -> Run:
    return run_to_end(tmp_path, write_config(tmp_path, dataset, run_id, **overrides))


def committed_steps(cfg: RunConfig) -> list[int]:
    return [c.step for c in CheckpointCatalog(cfg.run_dir).committed()]


def checkpoint_tensors(path: Path, out: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint (model, optimizer, trainer state), by flattened key."""
    dcp_to_torch_save(str(path), str(out))
    flat: dict[str, torch.Tensor] = {}

    def walk(obj, prefix: str) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{prefix}.{k}" if prefix else str(k))
        elif isinstance(obj, torch.Tensor):
            flat[prefix] = obj

    walk(torch.load(out, weights_only=False), "")
    return flat


def flip_tensor_bytes(checkpoint: Path, fqn_prefix: str) -> str:
    """Invert 16 bytes in the middle of the stored bytes of the first tensor whose key starts with
    ``fqn_prefix`` (as a bad disk or a stray write would); returns the shard file it damaged."""
    metadata = FileSystemReader(str(checkpoint)).read_metadata()
    for index, where in sorted(metadata.storage_data.items(), key=lambda kv: kv[0].fqn):
        if index.fqn.startswith(fqn_prefix) and where.length >= 64:
            at = where.offset + where.length // 2
            with open(checkpoint / where.relative_path, "r+b") as f:
                f.seek(at)
                data = f.read(16)
                f.seek(at)
                f.write(bytes(b ^ 0xFF for b in data))
            return where.relative_path
    raise AssertionError(f"no stored tensor under {fqn_prefix!r} in {checkpoint}")


def last_launch(run: Run) -> list[dict]:
    """The events of the newest launch (from its node-0 ``launch_begin`` on)."""
    events = run.events
    begins = [i for i, r in enumerate(events) if r["event"] == "launch_begin" and r.get("node_rank") == 0]
    return events[begins[-1]:]


def assert_every_committed_checkpoint_verifies(cfg: RunConfig) -> None:
    for c in CheckpointCatalog(cfg.run_dir).committed():
        assert verify_checkpoint(c.path) is None, c.checkpoint_id


def error_lines(out: subprocess.CompletedProcess) -> list[str]:
    """What a command said was wrong (stderr also carries library warnings)."""
    return [line for line in out.stderr.splitlines() if line.startswith("error:")]


def evaluate(cfg: RunConfig, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "training.evaluate", "--config",
                           str(Path(cfg.run_dir) / "run.json"), *args],
                          cwd=REPO, capture_output=True, text=True, timeout=180)


# -------------------------------------------------------------------------- damaged checkpoints


@pytest.fixture(scope="module")
def trained(tmp_path_factory, dataset) -> Run:
    """A clean run with three committed checkpoints, to copy and damage."""
    tmp = tmp_path_factory.mktemp("trained")
    run = train(tmp, dataset, "trust", steps=STEPS)
    assert run.rc == ExitCode.SUCCESS, run.output[-3000:]
    assert committed_steps(run.cfg) == [3, 6, 9]
    return run


def copy_of(trained: Run, tmp_path: Path) -> Path:
    """A copy of the trained run's dir at ``tmp_path/<run_id>`` (where ``write_config`` puts it)."""
    dst = tmp_path / trained.cfg.run_id
    shutil.copytree(trained.cfg.run_dir, dst, symlinks=True)
    return dst


def damage(run_dir: Path, how: str) -> str | None:
    """Damage run_dir's newest checkpoint (step 9) or its ``latest`` pointer; returns the file
    the quarantine record must name (None: nothing gets quarantined)."""
    newest = run_dir / "checkpoints" / "step_00000009"
    if how == "model_bytes":
        return flip_tensor_bytes(newest, "model.")
    if how == "optimizer_bytes":
        return flip_tensor_bytes(newest, "optim.state.")
    if how == "deleted_shard":
        (newest / "__1_0.distcp").unlink()
        return "__1_0.distcp"
    if how == "damaged_metadata":
        metadata = newest / ".metadata"
        metadata.write_bytes(metadata.read_bytes()[: metadata.stat().st_size // 2])
        return ".metadata"
    if how == "garbage_latest":
        (run_dir / "checkpoints" / "latest").write_bytes(b"\x00\xffnot a checkpoint\n")
        return None
    if how == "dangling_latest":
        (run_dir / "checkpoints" / "latest").write_text("step_00000042\n")
        return None
    raise ValueError(how)


DAMAGE = ["model_bytes", "optimizer_bytes", "deleted_shard", "damaged_metadata", "garbage_latest",
          "dangling_latest"]


@pytest.mark.parametrize("how", DAMAGE)
def test_resume_falls_back_past_a_damaged_checkpoint(trained, tmp_path, dataset, how):
    run_dir = copy_of(trained, tmp_path)
    damaged_file = damage(run_dir, how)
    run = train(tmp_path, dataset, trained.cfg.run_id, steps=STEPS + 3)
    assert run.rc == ExitCode.SUCCESS, run.output[-3000:]
    final = final_status(run.cfg.run_dir)
    assert final["failure_class"] == "success" and final["exit_code"] == 0

    events = last_launch(run)
    begins = [r for r in events if r["event"] == "train_begin"]
    quarantined = CheckpointCatalog(run.cfg.run_dir).quarantined()
    if damaged_file is None:  # the pointer is a hint: the newest verified checkpoint wins anyway
        assert {r["resumed_from"] for r in begins} == {"step_00000009"}, begins
        assert quarantined == []
    else:  # every rank fell back to the same, earlier, verified checkpoint
        assert {r["resumed_from"] for r in begins} == {"step_00000006"}, begins
        assert {r["rank"] for r in begins} == {0, 1}
        assert [q["checkpoint_id"] for q in quarantined] == ["step_00000009"], quarantined
        record = quarantined[0]
        assert damaged_file in record["reason"], record
        moved = Path(record["path"])
        assert (moved / QUARANTINE_RECORD).is_file() and (moved / "COMMITTED.json").is_file()  # kept, not deleted
        said = [r for r in events if r["event"] == "checkpoint_quarantined"]
        assert [r["checkpoint_id"] for r in said] == ["step_00000009"] and damaged_file in said[0]["reason"]
    # a damaged checkpoint is set aside before anything loads it: never a fault, never retried
    assert not [r for r in events if r["event"] == "fault_detected" and r.get("restoring")]
    # nothing verified was lost; what is committed verifies; training went on to the end
    assert committed_steps(run.cfg) == [6, 9, 12]
    assert_every_committed_checkpoint_verifies(run.cfg)
    assert max(run.losses()) == STEPS + 3


def test_evaluation_never_trusts_a_damaged_checkpoint(trained, tmp_path):
    run_dir = copy_of(trained, tmp_path)
    cfg = trained.cfg.replace(run_dir=str(run_dir))
    (run_dir / "run.json").write_text(cfg.to_json())
    ckpts = run_dir / "checkpoints"

    # The newest is damaged: the newest earlier one that verifies is evaluated, the damaged one
    # quarantined.
    flip_tensor_bytes(ckpts / "step_00000009", "model.")
    out = evaluate(cfg)
    assert out.returncode == 0, out.stderr
    result = read_events(cfg.layout.events, "eval")[-1]
    assert (result["checkpoint_id"], result["step"]) == ("step_00000006", 6)
    assert "step_00000009" in out.stderr and "Traceback" not in out.stderr
    assert [q["checkpoint_id"] for q in CheckpointCatalog(run_dir).quarantined()] == ["step_00000009"]

    # A requested checkpoint that fails verification: a one-line error, and it is quarantined.
    flip_tensor_bytes(ckpts / "step_00000006", "model.")
    out = evaluate(cfg, "--checkpoint", "step_00000006")
    assert out.returncode == 66, out.stderr
    assert len(error_lines(out)) == 1 and "fails verification" in error_lines(out)[0], out.stderr
    assert "Traceback" not in out.stderr
    assert [q["checkpoint_id"] for q in CheckpointCatalog(run_dir).quarantined()] == ["step_00000009",
                                                                                     "step_00000006"]
    out = evaluate(cfg, "--checkpoint", "step_00000009")  # asked again: says where it went
    assert out.returncode == 66 and "quarantined" in out.stderr and "Traceback" not in out.stderr

    # Nothing left that verifies: a one-line error with its own exit code, never a traceback.
    (ckpts / "step_00000003" / "__0_0.distcp").unlink()
    out = evaluate(cfg)
    assert out.returncode == 66, out.stderr
    assert len(error_lines(out)) == 1 and "Traceback" not in out.stderr, out.stderr
    assert CheckpointCatalog(run_dir).committed() == []
    assert len(CheckpointCatalog(run_dir).quarantined()) == 3


# --------------------------------------------------------------------------------- NaN drills


def assert_all_finite(cfg: RunConfig, tmp_path: Path) -> None:
    """Every committed checkpoint holds finite state: model, optimizer and trainer tensors."""
    for c in CheckpointCatalog(cfg.run_dir).committed():
        tensors = checkpoint_tensors(c.path, tmp_path / f"{c.checkpoint_id}.pt")
        assert any(k.startswith("model.") for k in tensors) and any(k.startswith("optim.") for k in tensors)
        bad = [k for k, t in tensors.items() if t.is_floating_point() and not torch.isfinite(t).all()]
        assert not bad, f"{c.checkpoint_id} holds non-finite tensors: {bad[:5]}"


def nonfinite_faults(run: Run) -> list[dict]:
    """The non-finite detections (a loaded machine may add an unrelated collective timeout)."""
    return [r for r in run.of("fault_detected") if r["failure_class"] == "non_finite"]


def test_a_nan_rolls_back_and_no_nonfinite_state_is_committed(tmp_path, dataset):
    # log_interval=4: the NaN of step 5 is first compared at the save of step 6, which it must
    # never reach.
    run = train(tmp_path, dataset, "nanonce", steps=STEPS, log_interval=4,
                faults=[{"kind": "nan", "step": 5, "rank": 1}])
    assert run.rc == ExitCode.SUCCESS, run.output[-3000:]
    assert final_status(run.cfg.run_dir)["failure_class"] == "success"

    detected = nonfinite_faults(run)
    assert [(r["failure_class"], r["step"], r["first_step"], r["ranks"], r["layer"]) for r in detected] == [
        ("non_finite", 6, 5, [1], "rollback")], detected
    # rolled back in place: same processes, the newest verified checkpoint, then on to the end
    after = [r for r in run.of("train_begin") if r["ts"] > detected[0]["ts"]]
    assert {r["resumed_from"] for r in after} == {"step_00000003"} and {r["rank"] for r in after} == {0, 1}
    assert {r["pid"] for r in after} <= {r["pid"] for r in run.of("train_begin") if r["ts"] < detected[0]["ts"]}
    assert [r["layer"] for r in run.of("restart_begin") if r["layer"] == "rollback"] == ["rollback"]
    assert [r["layer"] for r in run.of("restart_end") if r["layer"] == "rollback"] == ["rollback"]
    assert not run.of("checkpoint_quarantined")

    assert committed_steps(run.cfg) == [3, 6, 9]
    assert_all_finite(run.cfg, tmp_path)
    losses = run.losses()
    assert sorted(losses) == [4, 8, 9] and all(map(lambda x: x == x and abs(x) < 100, losses.values()))
    assert read_stop(run.cfg.layout) is None


@pytest.mark.parametrize("restart_mode", ["layered", "injob", "none"])
def test_a_persistent_nan_ends_non_finite_after_bounded_rollbacks(tmp_path, dataset, restart_mode):
    # attempt null: the NaN comes back on every pass, as a diverging run's would. Rollbacks happen
    # in place, so they need no restart layer (restart_mode none), and spend none.
    if restart_mode == "none" and os.environ.get("USE_LIBUV", "1").lower() in ("0", "false", "no"):
        pytest.skip("torchrun's rendezvous store needs libuv, which this torch lacks (the NVRx 0.7 lane's "
                    "Debian build): restart_mode=none cannot launch here")
    run = train(tmp_path, dataset, "nanforever", steps=STEPS, log_interval=4, max_nonfinite_rollbacks=2,
                restart_mode=restart_mode, faults=[{"kind": "nan", "step": 5, "rank": 1, "attempt": None}])
    assert run.rc == ExitCode.NON_FINITE == 65, run.output[-3000:]
    final = final_status(run.cfg.run_dir)
    assert final["failure_class"] == "non_finite" and final["exit_code"] == 65, final
    stop = read_stop(run.cfg.layout)
    assert stop["failure_class"] == "non_finite" and stop["step"] == 6, stop

    detected = nonfinite_faults(run)
    assert [(r["failure_class"], r["step"], r["rollbacks_before"]) for r in detected] == [
        ("non_finite", 6, 0), ("non_finite", 6, 1), ("non_finite", 6, 2)], detected
    assert [r["layer"] for r in detected] == ["rollback", "rollback", "none"]
    # stopped: nothing trained after the last detection, no restart layer retried it
    assert not [r for r in run.of("train_begin") if r["ts"] > detected[-1]["ts"]]
    assert [r["layer"] for r in run.of("restart_begin") if r["layer"] == "rollback"] == ["rollback", "rollback"]
    assert not [r for r in run.of("restart_begin") if r["ts"] > detected[-1]["ts"]]

    # the last finite checkpoint is kept and verifies; nothing newer was committed
    assert committed_steps(run.cfg) == [3]
    assert_every_committed_checkpoint_verifies(run.cfg)
    assert_all_finite(run.cfg, tmp_path)

    # a relaunch refuses to train past the stop
    again = train(tmp_path, dataset, "nanforever", steps=STEPS, log_interval=4, restart_mode=restart_mode)
    assert again.rc == 65 and committed_steps(again.cfg) == [3], again.output[-2000:]


# ------------------------------------------------------------------------------ a frozen writer


def test_a_frozen_checkpoint_writer_is_replaced(tmp_path, dataset):
    run = train(tmp_path, dataset, "writerhang", steps=STEPS,
                faults=[{"kind": "writer_hang", "step": 6, "rank": 0}])
    assert run.rc == ExitCode.SUCCESS, run.output[-3000:]
    assert final_status(run.cfg.run_dir)["failure_class"] == "success"
    assert [r["kind"] for r in run.of("fault_injected")] == ["writer_hang"]
    # The checkpointer gave up on the frozen writer within its stall bound: killed and replaced
    # it, and failed the save it held (left uncommitted) on every rank at once.
    stalled = [r for r in run.of("fault_detected") if r["kind"] == "CheckpointWriterError"]
    assert {r["rank"] for r in stalled} == {0, 1}, stalled
    mine = next(r for r in stalled if r["rank"] == 0)
    assert "made no progress" in mine["error"] and "killed and replaced" in mine["error"], mine
    assert "step_00000006 is left uncommitted" in mine["error"]
    # One in-process restart, from the newest commit before it; no layer waited on it twice
    over_writer = [r for r in run.of("restart_begin") if "CheckpointWriterError" in r["reason"]]
    assert [r["layer"] for r in over_writer] == ["inprocess"], run.of("restart_begin")
    after = [r for r in run.of("train_begin") if r["ts"] > mine["ts"]]
    assert {r["resumed_from"] for r in after} == {"step_00000003"}
    assert committed_steps(run.cfg) == [3, 6, 9]  # step 6 saved again, by a fresh writer
    assert_every_committed_checkpoint_verifies(run.cfg)
    assert max(run.losses()) == STEPS


# ------------------------------------------------------------------------- per-rank RNG state


def final_model(cfg: RunConfig, tmp_path: Path) -> dict[str, torch.Tensor]:
    final = CheckpointCatalog(cfg.run_dir).latest()
    assert final is not None and final.step == cfg.steps
    return {k: t for k, t in checkpoint_tensors(final.path, tmp_path / f"{cfg.run_id}-final.pt").items()
            if k.startswith(("model.", "optim."))}


def test_dropout_resumes_bitwise_with_per_rank_rng_state(tmp_path, dataset):
    clean = train(tmp_path, dataset, "dropclean", model="tiny-dropout", steps=STEPS)
    assert clean.rc == ExitCode.SUCCESS, clean.output[-3000:]
    faulty = train(tmp_path, dataset, "dropfaulty", model="tiny-dropout", steps=STEPS, faults=[
        {"kind": "exception", "step": 5, "rank": 1},  # in-process: the same processes restore
        {"kind": "sigkill", "step": 8, "rank": 0},    # in-job: new processes restore the newest commit
    ])
    assert faulty.rc == ExitCode.SUCCESS, faulty.output[-3000:]

    # Each rank saved its own RNG state, seeded per rank; every resume restored it.
    ckpt = CheckpointCatalog(faulty.cfg.run_dir).latest().path
    rng = {k: t for k, t in checkpoint_tensors(ckpt, tmp_path / "rng.pt").items() if k.startswith("trainer.rng.")}
    assert sorted(rng) == ["trainer.rng.rank_00000.cpu", "trainer.rng.rank_00001.cpu"], sorted(rng)
    assert not torch.equal(rng["trainer.rng.rank_00000.cpu"], rng["trainer.rng.rank_00001.cpu"])
    begins = faulty.of("train_begin")
    assert {r["rng"] for r in begins if r["resumed_from"] is None} == {"seeded"}
    resumed = [r for r in begins if r["resumed_from"] is not None]
    assert {r["rng"] for r in resumed} == {"restored"}
    # at least the in-job restart's new processes resumed (the in-process restart did too when
    # step 3 was committed before the fault: that depends on how fast the writers were)
    assert {(r["iteration"], r["attempt"]) for r in resumed} >= {(0, 1)}, resumed

    # Interrupted twice, it ends bitwise where the clean run ends: every loss, every weight.
    assert faulty.losses() == clean.losses()
    a, b = final_model(clean.cfg, tmp_path), final_model(faulty.cfg, tmp_path)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), \
        [k for k in a if not torch.equal(a[k], b[k])][:5]

    # Resumed on another world size, no saved RNG state belongs to a rank: each re-seeds
    # deterministically, and training goes on.
    narrower = run_to_end(tmp_path, faulty.cfg.replace(procs_per_node=1, steps=STEPS + 2, faults=()))
    assert narrower.rc == ExitCode.SUCCESS, narrower.output[-3000:]
    last = [r for r in last_launch(narrower) if r["event"] == "train_begin"]
    assert [(r["resumed_from"], r["rng"], r["world_size"]) for r in last] == [("step_00000009", "reseeded", 1)]
