"""End to end: real 2-rank CPU training under ft_launcher / torchrun with NVRx, with fault drills.

Every test runs `python -m fsdp_resilience.training.launch` as a pod would, and judges it by its exit code, the
run dir and events.jsonl, as the control plane does. No mocks.

The clean and the faulty run train the dropout preset: their randomness then includes dropout
masks, so their bitwise equal losses and weights also show that each rank saves and restores its
own RNG state. The faulty run meets a fault in every layer, each checked by a test of its own.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fsdp_resilience.training.contract import (
    CheckpointCatalog,
    ExitCode,
    RunConfig,
    final_status,
    read_events,
    read_stop,
    verify_checkpoint,
)
from fsdp_resilience.training.launch.command import nvrx_version

from training.support import REPO, Run, checkpoint_tensors, free_port, launch, run_config, run_training, write_config

pytestmark = pytest.mark.slow

STEPS = 12
MODEL = "tiny-dropout"


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory, dataset) -> Run:
    return run_training(tmp_path_factory.mktemp("clean"), dataset, "clean", model=MODEL, steps=STEPS)


@pytest.fixture(scope="module")
def faulty_run(tmp_path_factory, dataset) -> Run:
    """One fault per restart layer, a checkpoint writer that dies mid-save, and, in the second
    launcher round, one that freezes mid-save."""
    return run_training(
        tmp_path_factory.mktemp("faulty"),
        dataset,
        "faulty",
        model=MODEL,
        steps=STEPS,
        faults=[
            {"kind": "exception", "step": 4, "rank": 1},  # in-process
            {"kind": "checkpoint_crash", "step": 6, "rank": 0},  # writer dies mid-save: torn, in-process
            {"kind": "sigkill", "step": 8, "rank": 1},  # in-job
            {"kind": "writer_hang", "step": 9, "rank": 0, "attempt": 1},  # writer SIGSTOPped: replaced, in-process
        ],
    )


def train_begins(run, rank):
    return [r for r in run.of("train_begin") if r["rank"] == rank]


def test_clean_run_trains_commits_and_succeeds(clean_run):
    run = clean_run
    assert run.rc == ExitCode.SUCCESS, run.output[-3000:]
    losses = run.losses()
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert losses[STEPS] < 0.85 * losses[1], losses  # it learns
    assert final_status(run.cfg.run_dir)["failure_class"] == "success"
    # every interval checkpointed; retention kept the last 3 committed
    assert [c.step for c in CheckpointCatalog(run.cfg.run_dir).committed()] == [6, 9, 12]
    begins = run.of("checkpoint_begin")
    assert [r["step"] for r in begins] == [3, 6, 9, 12]
    assert all(r["blocking_s"] >= 0 for r in begins)
    assert {r["step"] for r in run.of("checkpoint_commit")} == {3, 6, 9, 12}


def final_model(cfg: RunConfig, tmp_path: Path) -> dict[str, torch.Tensor]:
    final = CheckpointCatalog(cfg.run_dir).latest()
    assert final is not None and final.step == cfg.steps
    return {
        k: t
        for k, t in checkpoint_tensors(final.path, tmp_path / f"{cfg.run_id}-final.pt").items()
        if k.startswith(("model.", "optim."))
    }


def test_faults_in_every_layer_recover_bitwise_identical(clean_run, faulty_run, tmp_path):
    run = faulty_run
    assert run.rc == ExitCode.SUCCESS, run.output[-3000:]
    # Resuming from checkpoints replays exactly: the same loss at every step, bit for bit, and
    # the same final weights and optimizer state.
    assert run.losses() == clean_run.losses()
    a, b = final_model(clean_run.cfg, tmp_path), final_model(run.cfg, tmp_path)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), [
        k for k in a if not torch.equal(a[k], b[k])
    ][:5]

    # exception -> in-process: rank 1 re-entered training in the same process
    rank1 = train_begins(run, 1)
    assert rank1[0]["pid"] == rank1[1]["pid"] and rank1[1]["iteration"] == 1
    # sigkill -> in-job: ft_launcher started new processes (attempt 1)
    assert rank1[-1]["attempt"] == 1 and rank1[-1]["pid"] != rank1[0]["pid"]
    layers = [r["layer"] for r in run.of("restart_end")]
    assert layers.count("inprocess") == 3 and layers.count("injob") == 1, run.of("restart_end")
    assert all(r["latency_s"] > 0 for r in run.of("restart_end"))

    # the writer crash: detected (not a hang), its torn save skipped, training resumed from the
    # newest committed checkpoint before it, and the step saved again later
    # (the drill kills the writer right after save(6) returns; the next poll, at step 7, finds it
    # on every rank at once, so no rank waits in a collective for a peer that will never come)
    assert {
        r["step"] for r in run.of("fault_detected") if r["kind"] == "CheckpointWriterError" and r["attempt"] == 0
    } == {7}
    after_crash = [r for r in train_begins(run, 0) if r["iteration"] == 2][0]
    assert after_crash["resumed_from"] == "step_00000003"
    assert "step_00000006" in {r["checkpoint_id"] for r in run.of("checkpoint_skip")}
    assert [c.step for c in CheckpointCatalog(run.cfg.run_dir).committed()] == [6, 9, 12]


def test_a_frozen_checkpoint_writer_is_replaced(faulty_run):
    run = faulty_run
    assert run.rc == ExitCode.SUCCESS, run.output[-3000:]
    assert [r["kind"] for r in run.of("fault_injected") if r["kind"] == "writer_hang"] == ["writer_hang"]
    # The checkpointer gave up on the frozen writer within its stall bound: killed and replaced
    # it, and failed the save it held (left uncommitted) on every rank at once.
    stalled = [r for r in run.of("fault_detected") if r["kind"] == "CheckpointWriterError" and r["attempt"] == 1]
    assert {r["rank"] for r in stalled} == {0, 1}, stalled
    mine = next(r for r in stalled if r["rank"] == 0)
    assert "made no progress" in mine["error"] and "killed and replaced" in mine["error"], mine
    assert "step_00000009 is left uncommitted" in mine["error"]
    # One in-process restart for it (and one for the crashed writer before), from the newest
    # commit before it; no layer waited on it twice
    over_writer = [r for r in run.of("restart_begin") if "CheckpointWriterError" in r["reason"]]
    assert [r["layer"] for r in over_writer] == ["inprocess", "inprocess"], run.of("restart_begin")
    after = [r for r in run.of("train_begin") if r["ts"] > mine["ts"]]
    assert {r["resumed_from"] for r in after} == {"step_00000006"}
    # step 9 saved again, by a fresh writer; what is committed verifies
    assert [c.step for c in CheckpointCatalog(run.cfg.run_dir).committed()] == [6, 9, 12]
    for c in CheckpointCatalog(run.cfg.run_dir).committed():
        assert verify_checkpoint(c.path) is None, c.checkpoint_id


def test_each_rank_saves_and_restores_its_own_rng_state(faulty_run, tmp_path):
    ckpt = CheckpointCatalog(faulty_run.cfg.run_dir).latest().path
    rng = {k: t for k, t in checkpoint_tensors(ckpt, tmp_path / "rng.pt").items() if k.startswith("trainer.rng.")}
    assert sorted(rng) == ["trainer.rng.rank_00000.cpu", "trainer.rng.rank_00001.cpu"], sorted(rng)
    assert not torch.equal(rng["trainer.rng.rank_00000.cpu"], rng["trainer.rng.rank_00001.cpu"])
    begins = faulty_run.of("train_begin")
    assert {r["rng"] for r in begins if r["resumed_from"] is None} == {"seeded"}
    resumed = [r for r in begins if r["resumed_from"] is not None]
    assert {r["rng"] for r in resumed} == {"restored"}
    # the in-process restarts after the writer crash and the in-job restart's new processes
    # resumed (the first in-process restart did too when step 3 was committed before the fault:
    # that depends on how fast the writers were)
    assert {(r["iteration"], r["attempt"]) for r in resumed} >= {(2, 0), (0, 1)}, resumed


def test_a_resume_on_another_world_size_reseeds_every_rank(faulty_run, tmp_path):
    """No saved RNG state belongs to a rank of another world size: each re-seeds
    deterministically, and training goes on."""
    run_dir = tmp_path / faulty_run.cfg.run_id
    shutil.copytree(faulty_run.cfg.run_dir, run_dir, symlinks=True)
    narrower = run_config(
        tmp_path,
        faulty_run.cfg.replace(
            run_dir=str(run_dir), procs_per_node=1, steps=STEPS + 2, faults=(), rdzv_port=free_port()
        ),
    )
    assert narrower.rc == ExitCode.SUCCESS, narrower.output[-3000:]
    last = [r for r in narrower.last_launch() if r["event"] == "train_begin"]
    assert [(r["resumed_from"], r["rng"], r["world_size"]) for r in last] == [("step_00000012", "reseeded", 1)]


def test_a_fault_while_a_save_is_pending_is_recovered_in_process(tmp_path, dataset):
    """Rank 0 fails at the save protocol's round while the save of step 3 is pending: rank 1 waits
    in that round's collective, on the protocol's own gloo group (the group a GPU run's pending
    saves use too). Rank 0 breaks the group's connections, so rank 1 fails at once and both
    restart in-process: no in-job restart. With log_interval=5 the protocol runs no round at step
    4, so the drill of step 4 fires at step 5's round (after rank 0 logged step 5)."""
    run = run_training(
        tmp_path,
        dataset,
        "whilesaving",
        steps=8,
        log_interval=5,
        faults=[{"kind": "exception", "step": 4, "rank": 0, "while_saving": True}],
    )
    assert run.rc == ExitCode.SUCCESS, run.output[-3000:]
    fired = run.of("fault_injected")
    assert [(r["kind"], r["step"], r["rank"]) for r in fired] == [("exception", 4, 0)]
    logged_5 = next(r for r in run.events if r["event"] == "step" and r["step"] == 5)
    assert fired[0]["ts"] > logged_5["ts"]  # at step 5's round, after the step was logged
    # The pending save never committed before the fault; it stays torn or is saved again.
    commits_before = [r for r in run.of("checkpoint_commit") if r["ts"] < fired[0]["ts"]]
    assert commits_before == []
    restarts = run.of("restart_begin") + run.of("restart_end") + run.of("fault_detected")
    assert any(r["layer"] == "inprocess" for r in run.of("restart_end")), (restarts, run.output[-6000:])
    assert not [r for r in run.of("restart_begin") if r["layer"] == "injob"], restarts
    assert {r["attempt"] for r in run.of("train_begin")} == {0}
    assert max(r["step"] for r in run.of("step")) == 8


def test_a_killed_rank_0_is_on_record_as_its_survivors_fault(tmp_path, dataset):
    """A SIGKILLed rank logs nothing. When it is rank 0, which holds the in-process layer's store,
    rank 1 either fails a collective with it or loses that store first, and ft_launcher ends rank 1
    moments later. Either way rank 1 logs the fault before it goes, so the fault the in-job restart
    recovered is on record (the report's faults table is built from these records)."""
    run = run_training(tmp_path, dataset, "rank0killed", steps=6, faults=[{"kind": "sigkill", "step": 3, "rank": 0}])
    assert run.rc == ExitCode.SUCCESS, run.output[-3000:]
    (killed,) = run.of("fault_injected")
    seen = [r for r in run.of("fault_detected") if r["attempt"] == 0]
    assert seen and all(r["rank"] == 1 and r["ts"] >= killed["ts"] for r in seen), seen
    assert {r["failure_class"] for r in seen} == {"restarts_exhausted"}
    (restart,) = run.of("restart_end")
    assert restart["layer"] == "injob" and restart["ts"] > seen[0]["ts"]


def wait_for_lock_free(path, timeout):
    deadline = time.monotonic() + timeout
    while True:
        with open(path, "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(f, fcntl.LOCK_UN)
                return
            except BlockingIOError as e:
                if time.monotonic() > deadline:
                    raise AssertionError(f"{path} is still locked after {timeout}s: {path.read_text()!r}") from e
        time.sleep(0.2)


@pytest.mark.parametrize("rank0_on", ["survivor", "lost_node"])
def test_node_loss_recovered_when_the_node_comes_back(tmp_path, dataset, rank0_on):
    """Two 'nodes' (one rank each) on this machine; node 1 vanishes at step 5 — its launcher and
    workers are SIGKILLed — and this test, playing the Kubernetes Job controller, starts a
    replacement pod for index 1, which rejoins the rendezvous.

    With rank 0 on the lost node, the in-process Wrapper's store (hosted by rank 0) goes with it:
    the survivor's Wrapper monitor thread dies, and the survivor must exit for ft_launcher to
    restart it instead of waiting forever (seen on NVRx 0.7, whose rendezvous may rank node 1
    first). NVRx 0.7 places ranks by GROUP_RANK, so the test puts rank 0 where it wants it; 0.4.1's
    rendezvous has no such knob."""
    if rank0_on == "lost_node" and nvrx_version() < (0, 6):
        pytest.skip("NVRx 0.4.1's rendezvous orders nodes by address and pid: rank 0 cannot be placed")
    # On NVRx 0.7, GROUP_RANK orders the nodes (rank 0 to the lowest); 0.4.1 ignores it.
    group_rank = {0: "0", 1: "1"} if rank0_on == "survivor" else {0: "1", 1: "0"}
    cfg = write_config(
        tmp_path,
        dataset,
        "nodeloss",
        steps=10,
        nodes=2,
        procs_per_node=1,
        faults=[{"kind": "node_loss", "step": 5, "node": 1}],
    )
    cfg_path = tmp_path / "nodeloss.json"
    node0 = launch(cfg, cfg_path, node_rank=0, env={"GROUP_RANK": group_rank[0]})
    node1 = launch(cfg, cfg_path, node_rank=1, env={"GROUP_RANK": group_rank[1]})
    assert node1.wait(timeout=240) == -9  # killed with its node
    # The Job controller replaces a pod once all its processes are gone (podReplacementPolicy
    # Failed); here: once the dead node's launch lock is free (its guard is still ending the tree).
    wait_for_lock_free(cfg.layout.launch_lock(1), timeout=60)
    replacement = launch(cfg, cfg_path, node_rank=1, env={"GROUP_RANK": group_rank[1]})
    try:
        rc0, rc1 = node0.wait(timeout=300), replacement.wait(timeout=300)
    finally:
        for p in (node0, replacement):
            p.kill()
    logs = (tmp_path / "nodeloss.node0.log").read_text()[-3000:]
    assert (rc0, rc1) == (0, 0), logs
    events = read_events(cfg.layout.events)
    lost = [r for r in events if r["event"] == "fault_injected" and r["kind"] == "node_loss"]
    assert [r["node_rank"] for r in lost] == [1]
    if nvrx_version() >= (0, 6):
        assert lost[0]["rank"] == (0 if rank0_on == "lost_node" else 1)
    assert any(r["event"] == "restart_end" and r["layer"] == "injob" for r in events)
    assert max(r["step"] for r in events if r["event"] == "step") == 10


def test_timeouts_are_derived_and_a_frozen_rank_is_found_by_them(tmp_path, dataset):
    """Once warm (steps and two saves), each attempt derives ft_launcher's heartbeat and section
    timeouts from what it measured and records them. An exception and saves after that still
    recover in-process (the derived timeouts outlast an in-process restart); a SIGSTOPped rank is
    found by the derived timeout, not the configured one, and recovered by ft_launcher."""
    from fsdp_resilience.training.contract import DERIVED_TIMEOUT_MARGIN_S

    run = run_training(
        tmp_path,
        dataset,
        "derived",
        steps=16,
        faults=[
            {"kind": "exception", "step": 8, "rank": 1},  # in-process, with derived timeouts in force
            {"kind": "sigstop", "step": 14, "rank": 0},  # frozen: found by the derived heartbeat timeout
        ],
    )
    assert run.rc == ExitCode.SUCCESS, run.output[-3000:]
    cfg, timeouts = run.cfg, run.cfg.timeouts("gloo")
    derived = run.of("timeouts_derived")
    # Derived by rank 0 in each in-process iteration, at the first heartbeat after its second
    # save (saves every 3 steps): at step 7, and again after the restart at step 8.
    resumed = [r for r in train_begins(run, 0) if r["iteration"] == 1][0]["start_step"]
    second_save = [s for s in range(resumed + 1, cfg.steps + 1) if s % cfg.checkpoint_interval == 0][1]
    assert [(r["rank"], r["iteration"], r["step"]) for r in derived if r["attempt"] == 0] == [
        (0, 0, 7),
        (0, 1, second_save + 1),
    ]
    in_force = [r for r in derived if r["attempt"] == 0][-1]  # when the rank froze (step 14)
    for record in derived:
        # From the measured intervals, with the safety factor, above the restart layers' order.
        measured = record["measured_heartbeat_interval_s"]
        assert measured > 0 and set(record["measured_section_s"]) == {"step", "checkpoint"}
        assert record["safety_factor"] == cfg.timeout_safety_factor and record["ceiling_s"] == cfg.heartbeat_timeout_s
        assert (
            record["floor_s"]
            >= max(timeouts.collective_s + measured, timeouts.soft_s) + DERIVED_TIMEOUT_MARGIN_S - 1e-3
        )
        assert record["heartbeat_s"] == pytest.approx(
            min(cfg.heartbeat_timeout_s, max(record["floor_s"], cfg.timeout_safety_factor * measured)), abs=1e-3
        )
        assert record["initial_heartbeat_s"] == cfg.initial_heartbeat_timeout_s
    # The run dir records the latest derivation; run.json stays what was asked for.
    on_disk = json.loads(cfg.layout.derived_timeouts.read_text())
    assert on_disk["heartbeat_s"] == derived[-1]["heartbeat_s"] and on_disk["step"] == derived[-1]["step"]
    assert RunConfig.load(cfg.layout.config).heartbeat_timeout_s == cfg.heartbeat_timeout_s

    # The exception (step 8, after the derivation) was recovered in-process: same processes.
    rank1 = train_begins(run, 1)
    assert rank1[1]["iteration"] == 1 and rank1[1]["pid"] == rank1[0]["pid"] and rank1[1]["attempt"] == 0
    assert [r["layer"] for r in run.of("restart_end")] == ["inprocess", "injob"], run.of("restart_end")
    # The frozen rank was found by a derived timeout (the rank monitor names the one that fired).
    fired = {f"{t:.2f} seconds" for t in (in_force["heartbeat_s"], *in_force["sections"].values())}
    lines = [line for line in run.output.splitlines() if "Waited" in line or "Timeout is" in line]
    assert any(value in line for line in lines for value in fired), lines
    assert in_force["heartbeat_s"] < cfg.heartbeat_timeout_s, in_force
    assert not any(f"{cfg.heartbeat_timeout_s:.2f} seconds" in line for line in lines), lines


def test_restarts_exhausted_ends_with_its_exit_code_and_class(tmp_path, dataset):
    run = run_training(
        tmp_path,
        dataset,
        "exhausted",
        steps=6,
        restart_mode="injob",
        max_restarts=1,
        faults=[
            {"kind": "sigkill", "step": 3, "rank": 1, "attempt": 0},
            {"kind": "oom", "step": 3, "rank": 0, "attempt": 1},
        ],
    )
    assert run.rc == ExitCode.RESTARTS_EXHAUSTED, run.output[-3000:]
    final = final_status(run.cfg.run_dir)
    assert final["failure_class"] == "restarts_exhausted" and final["exit_code"] == 75
    assert "max_restarts=1" in final["message"]


def test_user_bug_is_never_retried(tmp_path, dataset):
    run = run_training(
        tmp_path, dataset, "userbug", steps=8, max_restarts=3, faults=[{"kind": "user_bug", "step": 5, "rank": 1}]
    )
    assert run.rc == ExitCode.USER_ERROR, run.output[-3000:]
    final = final_status(run.cfg.run_dir)
    assert final["failure_class"] == "user_error" and final["exit_code"] == 78
    assert "InjectedUserBug" in final["message"]
    # One retry (in-process, normally) showed it repeats; once known, nothing trained again.
    detected = [r for r in run.of("fault_detected") if r["rank"] == 1 and r["kind"] == "InjectedUserBug"]
    assert [r["repeated"] for r in detected] == [False, True]
    known = detected[-1]["ts"]
    assert not [r for r in run.of("train_begin") if r["ts"] > known]
    stop = read_stop(run.cfg.layout)
    assert stop["failure_class"] == "user_error" and stop["rank"] == 1 and "InjectedUserBug" in stop["error"]
    assert [r["failure_class"] for r in detected] == ["restarts_exhausted", "user_error"]


def test_evaluate_a_two_rank_checkpoint_in_one_process(clean_run):
    cfg_path = Path(clean_run.cfg.run_dir) / "run.json"
    out = subprocess.run(
        [sys.executable, "-m", "fsdp_resilience.training.evaluate", "--config", str(cfg_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(clean_run.cfg.layout.eval_result.read_text())
    assert result["checkpoint_id"] == "step_00000012" and result["step"] == STEPS
    assert result["saved_world_size"] == 2
    assert 0 < result["val_loss"] < math.log(256)  # better than uniform over bytes
    assert result["perplexity"] == pytest.approx(math.exp(result["val_loss"]))


def test_launch_rejects_bad_input_before_starting_anything(tmp_path, dataset):
    bad = tmp_path / "bad.json"
    bad.write_text(
        json.dumps(
            {"run_id": "bad", "run_dir": str(tmp_path / "bad"), "dataset_dir": str(dataset), "procs_per_node": 0}
        )
    )
    t0 = time.time()
    out = subprocess.run(
        [sys.executable, "-m", "fsdp_resilience.training.launch", "--config", str(bad)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == ExitCode.CONFIG_ERROR
    assert "procs_per_node=0 is out of range" in out.stderr
    assert not (tmp_path / "bad").exists() and time.time() - t0 < 30

    missing = tmp_path / "missing.json"
    missing.write_text(
        json.dumps({"run_id": "m", "run_dir": str(tmp_path / "m"), "dataset_dir": str(tmp_path / "nowhere")})
    )
    out = subprocess.run(
        [sys.executable, "-m", "fsdp_resilience.training.launch", "--config", str(missing)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == ExitCode.CONFIG_ERROR and "prepare_data" in out.stderr


def test_launch_reads_config_and_node_rank_from_a_pods_env(tmp_path, dataset):
    """An EKS pod gets its config as TRAINING_RUN_CONFIG and its rank as the Indexed Job's
    JOB_COMPLETION_INDEX; no file is shipped."""
    cfg = {"run_id": "pod", "run_dir": str(tmp_path / "pod"), "dataset_dir": str(dataset), "nodes": 2}
    env = {
        **os.environ,
        "TRAINING_RUN_CONFIG": json.dumps(cfg),
        "JOB_COMPLETION_INDEX": "1",
        "TRAINING_RDZV_HOST": "job-0.job.ns.svc",
    }
    (tmp_path / "pod").mkdir()
    (tmp_path / "pod" / "run.json").write_text(json.dumps(cfg))  # node 1 waits for node 0's copy
    out = subprocess.run(
        [sys.executable, "-m", "fsdp_resilience.training.launch", "--dry-run"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "ft-launcher-node1.yaml" in out.stdout  # this node is rank 1
    assert "job-0.job.ns.svc" in out.stdout

    env.pop("TRAINING_RUN_CONFIG")
    out = subprocess.run(
        [sys.executable, "-m", "fsdp_resilience.training.launch"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == ExitCode.CONFIG_ERROR and "TRAINING_RUN_CONFIG" in out.stderr
