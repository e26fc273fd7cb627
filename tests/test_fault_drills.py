"""End to end: real 2-rank CPU training under ft_launcher / torchrun with NVRx, with fault drills.

Every test runs `python -m training.launch` as a pod would, and judges it by its exit code, the
run dir and events.jsonl, as the control plane does. No mocks.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, launch, run_training, write_config
from training.contract import CheckpointCatalog, ExitCode, final_status, read_events, read_stop

pytestmark = pytest.mark.slow

STEPS = 12


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory, dataset):
    return run_training(tmp_path_factory.mktemp("clean"), dataset, "clean", steps=STEPS)


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


def test_faults_in_every_layer_recover_with_bitwise_identical_losses(clean_run, tmp_path, dataset):
    run = run_training(tmp_path, dataset, "faulty", steps=STEPS, faults=[
        {"kind": "exception", "step": 4, "rank": 1},         # in-process
        {"kind": "checkpoint_crash", "step": 6, "rank": 0},  # writer dies mid-save: torn, in-process
        {"kind": "sigkill", "step": 8, "rank": 1},           # in-job
    ])
    assert run.rc == ExitCode.SUCCESS, run.output[-3000:]
    # Resuming from checkpoints replays exactly: the same loss at every step, bit for bit.
    assert run.losses() == clean_run.losses()

    # exception -> in-process: rank 1 re-entered training in the same process
    rank1 = train_begins(run, 1)
    assert rank1[0]["pid"] == rank1[1]["pid"] and rank1[1]["iteration"] == 1
    # sigkill -> in-job: ft_launcher started new processes (attempt 1)
    assert rank1[-1]["attempt"] == 1 and rank1[-1]["pid"] != rank1[0]["pid"]
    layers = [r["layer"] for r in run.of("restart_end")]
    assert layers.count("inprocess") == 2 and layers.count("injob") == 1, run.of("restart_end")
    assert all(r["latency_s"] > 0 for r in run.of("restart_end"))

    # the writer crash: detected (not a hang), its torn save skipped, training resumed from the
    # newest committed checkpoint before it, and the step saved again later
    # (the drill kills the writer right after save(6) returns; the next poll, at step 7, finds it
    # on every rank at once, so no rank waits in a collective for a peer that will never come)
    assert {r["step"] for r in run.of("fault_detected") if r["kind"] == "CheckpointWriterError"} == {7}
    after_crash = [r for r in train_begins(run, 0) if r["iteration"] == 2][0]
    assert after_crash["resumed_from"] == "step_00000003"
    assert "step_00000006" in {r["checkpoint_id"] for r in run.of("checkpoint_skip")}
    assert [c.step for c in CheckpointCatalog(run.cfg.run_dir).committed()] == [6, 9, 12]


def wait_for_lock_free(path, timeout):
    deadline = time.monotonic() + timeout
    while True:
        with open(path, "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(f, fcntl.LOCK_UN)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise AssertionError(f"{path} is still locked after {timeout}s: {path.read_text()!r}")
        time.sleep(0.2)


def test_node_loss_recovered_when_the_node_comes_back(tmp_path, dataset):
    """Two 'nodes' (one rank each) on this machine; node 1 vanishes at step 5 — its launcher and
    workers are SIGKILLed — and this test, playing the Kubernetes Job controller, starts a
    replacement pod for index 1, which rejoins the rendezvous."""
    cfg = write_config(tmp_path, dataset, "nodeloss", steps=10, nodes=2, procs_per_node=1,
                       faults=[{"kind": "node_loss", "step": 5, "node": 1}])
    cfg_path = tmp_path / "nodeloss.json"
    node0 = launch(cfg, cfg_path, node_rank=0)
    node1 = launch(cfg, cfg_path, node_rank=1)
    assert node1.wait(timeout=240) == -9  # killed with its node
    # The Job controller replaces a pod once all its processes are gone (podReplacementPolicy
    # Failed); here: once the dead node's launch lock is free (its guard is still ending the tree).
    wait_for_lock_free(cfg.layout.launch_lock(1), timeout=60)
    replacement = launch(cfg, cfg_path, node_rank=1)
    try:
        rc0, rc1 = node0.wait(timeout=300), replacement.wait(timeout=300)
    finally:
        for p in (node0, replacement):
            p.kill()
    logs = (tmp_path / "nodeloss.node0.log").read_text()[-3000:]
    assert (rc0, rc1) == (0, 0), logs
    events = read_events(cfg.layout.events)
    assert any(r["event"] == "fault_injected" and r["kind"] == "node_loss" for r in events)
    assert any(r["event"] == "restart_end" and r["layer"] == "injob" for r in events)
    assert max(r["step"] for r in events if r["event"] == "step") == 10


def test_restarts_exhausted_ends_with_its_exit_code_and_class(tmp_path, dataset):
    run = run_training(tmp_path, dataset, "exhausted", steps=6, restart_mode="injob", max_restarts=1,
                       faults=[{"kind": "sigkill", "step": 3, "rank": 1, "attempt": 0},
                               {"kind": "oom", "step": 3, "rank": 0, "attempt": 1}])
    assert run.rc == ExitCode.RESTARTS_EXHAUSTED, run.output[-3000:]
    final = final_status(run.cfg.run_dir)
    assert final["failure_class"] == "restarts_exhausted" and final["exit_code"] == 75
    assert "max_restarts=1" in final["message"]


def test_user_bug_is_never_retried(tmp_path, dataset):
    run = run_training(tmp_path, dataset, "userbug", steps=8, max_restarts=3,
                       faults=[{"kind": "user_bug", "step": 5, "rank": 1}])
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
    out = subprocess.run([sys.executable, "-m", "training.evaluate", "--config", str(cfg_path)],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(clean_run.cfg.layout.eval_result.read_text())
    assert result["checkpoint_id"] == "step_00000012" and result["step"] == STEPS
    assert result["saved_world_size"] == 2
    assert 0 < result["val_loss"] < math.log(256)  # better than uniform over bytes
    assert result["perplexity"] == pytest.approx(math.exp(result["val_loss"]))


def test_launch_rejects_bad_input_before_starting_anything(tmp_path, dataset):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"run_id": "bad", "run_dir": str(tmp_path / "bad"), "dataset_dir": str(dataset),
                               "procs_per_node": 0}))
    t0 = time.time()
    out = subprocess.run([sys.executable, "-m", "training.launch", "--config", str(bad)],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == ExitCode.CONFIG_ERROR
    assert "procs_per_node=0 is out of range" in out.stderr
    assert not (tmp_path / "bad").exists() and time.time() - t0 < 30

    missing = tmp_path / "missing.json"
    missing.write_text(json.dumps({"run_id": "m", "run_dir": str(tmp_path / "m"), "dataset_dir": str(tmp_path / "nowhere")}))
    out = subprocess.run([sys.executable, "-m", "training.launch", "--config", str(missing)],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == ExitCode.CONFIG_ERROR and "prepare_data" in out.stderr


def test_launch_reads_config_and_node_rank_from_a_pods_env(tmp_path, dataset):
    """An EKS pod gets its config as TRAINING_RUN_CONFIG and its rank as the Indexed Job's
    JOB_COMPLETION_INDEX; no file is shipped."""
    cfg = {"run_id": "pod", "run_dir": str(tmp_path / "pod"), "dataset_dir": str(dataset), "nodes": 2}
    env = {**os.environ, "TRAINING_RUN_CONFIG": json.dumps(cfg), "JOB_COMPLETION_INDEX": "1",
           "TRAINING_RDZV_HOST": "job-0.job.ns.svc"}
    (tmp_path / "pod").mkdir()
    (tmp_path / "pod" / "run.json").write_text(json.dumps(cfg))  # node 1 waits for node 0's copy
    out = subprocess.run([sys.executable, "-m", "training.launch", "--dry-run"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "ft-launcher-node1.yaml" in out.stdout  # this node is rank 1
    assert "job-0.job.ns.svc" in out.stdout

    env.pop("TRAINING_RUN_CONFIG")
    out = subprocess.run([sys.executable, "-m", "training.launch"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == ExitCode.CONFIG_ERROR and "TRAINING_RUN_CONFIG" in out.stderr
