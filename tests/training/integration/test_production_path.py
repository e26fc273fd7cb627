"""What the GPU image's path (NVRx 0.7, CUDA, NCCL) needs of the training plane, checked where a
CPU can see it. Both NVRx lanes run this file (``make test-training``: 0.4.1; ``make
test-nvrx07``: 0.7.0); what only a GPU can show is in ``make gpu-check``."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import sysconfig
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch

from fsdp_resilience.training.checkpointing.snapshot import _BUCKETS_IN_WRITER
from fsdp_resilience.training.checkpointing.writer import _PersistentWriter, _WriterQueue
from fsdp_resilience.training.contract import Event, ExitCode, FailureClass, read_events
from fsdp_resilience.training.launch import command as launch_command
from fsdp_resilience.training.launch.cli import main as launch_main
from fsdp_resilience.training.parallelize import build_optimizer
from fsdp_resilience.training.restart.fault_kinds import is_platform_fault
from fsdp_resilience.training.restart.process_group import process_group_options
from fsdp_resilience.training.restart.wrapper import inprocess_wrapper, restart_health_checks_wanted

from training.support import REPO, free_port, launch, write_config

NVRX_07 = _BUCKETS_IN_WRITER


# ------------------------------------------------------------------ the checkpoint writer process

#: A trainer of world size 1 that saves a 64 MiB state four times and reports what it saw: the
#: writer's pid, the blocking time of each save and the peak of /dev/shm while saving.
TRAINER = textwrap.dedent("""
    import json, os, sys, threading, time
    import torch, torch.distributed as dist
    from fsdp_resilience.training.checkpointing.checkpointer import AsyncCheckpointer

    def shm_used():
        st = os.statvfs("/dev/shm")
        return (st.f_blocks - st.f_bfree) * st.f_frsize


    def main():
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%(port)d", rank=0, world_size=1)
        state = {"model": {f"w{i}": torch.randn(1024, 1024) for i in range(16)}, "trainer": {"step": 0}}
        state["model"]["empty"] = torch.empty(0)  # an empty shard (uneven sharding) has no memory to share
        ckpt = AsyncCheckpointer(sys.argv[1], keep=2)
        peak, stop = [0], threading.Event()
        def sample():
            while not stop.is_set():
                peak[0] = max(peak[0], shm_used())
                time.sleep(0.002)
        ckpt.save(1, state); ckpt.wait()
        baseline = shm_used()  # the reused snapshot buffers exist from here on
        sampler = threading.Thread(target=sample, daemon=True); sampler.start()
        blocking = []
        for step in (2, 3, 4, 5):
            for t in state["model"].values():
                t.add_(1.0)
            ckpt.save(step, {**state, "trainer": {"step": step}})
            blocking.append(ckpt.last_save.blocking_s)
            ckpt.wait()
        stop.set(); sampler.join()
        print(json.dumps({"writer": ckpt.writer_pids(), "blocking_s": blocking, "baseline": baseline,
                          "peak": peak[0], "state_bytes": 64 << 20}), flush=True)
        if len(sys.argv) > 2:  # stay, to be killed
            time.sleep(600)
        ckpt.close()
        dist.destroy_process_group()

    if __name__ == "__main__":  # the writer processes are spawned: they import this file
        main()
""")


def run_trainer(tmp_path: Path, *, linger: bool) -> tuple[subprocess.Popen, dict]:
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER % {"port": free_port()})
    args = [sys.executable, str(script), str(tmp_path / "run")] + (["linger"] if linger else [])
    proc = subprocess.Popen(
        args, cwd=REPO, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO / "src")}
    )
    line = proc.stdout.readline()
    assert line, f"the trainer printed nothing (exit {proc.wait()})"
    return proc, json.loads(line)


@pytest.mark.slow
def test_one_copy_per_save_and_the_writer_dies_with_its_trainer(tmp_path):
    """A save copies the state once, into reused shared buffers: /dev/shm does not grow by
    another copy per save (NVRx 0.7's stock path clones every tensor and ships the clones through
    shared memory). And the writer, spawned with a parent-death signal on every NVRx version, does
    not outlive a SIGKILLed trainer."""
    proc, seen = run_trainer(tmp_path, linger=True)
    try:
        growth = seen["peak"] - seen["baseline"]
        print(
            f"saves of 64 MiB: blocking {[round(b, 4) for b in seen['blocking_s']]} s; "
            f"/dev/shm above the reused buffers: {growth / 2**20:.1f} MiB"
        )
        assert growth < seen["state_bytes"] // 4, f"/dev/shm grew {growth / 2**20:.0f} MiB during saves"
        (writer,) = seen["writer"]
        assert psutil.pid_exists(writer)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and _alive(writer):
        time.sleep(0.1)
    assert not _alive(writer), "the checkpoint writer outlived its SIGKILLed trainer"


#: One rank under the run's in-process Wrapper (soft timeout 2 s): it pings as a training step
#: does, starts a save, and waits for it while its writer is frozen for 6 s (a write slower than the
#: soft timeout: FSx behind the checkpoint interval). Prints the Wrapper iterations it ran.
SLOW_WRITE = textwrap.dedent("""
    import json, os, signal, sys, threading
    import torch, torch.distributed as dist
    from nvidia_resiliency_ext.inprocess import CallWrapper
    from fsdp_resilience.training.checkpointing.checkpointer import AsyncCheckpointer
    from fsdp_resilience.training.contract import EventLog, RunConfig
    from fsdp_resilience.training.restart.wrapper import inprocess_wrapper


    def main():
        cfg = RunConfig(run_id="slow", run_dir=sys.argv[1], dataset_dir=sys.argv[1], device="cpu",
                        hang_timeout_s=2.0, collective_timeout_s=3.0, heartbeat_timeout_s=30.0,
                        initial_heartbeat_timeout_s=30.0, max_inprocess_restarts=1)
        pings = []
        ckpt = AsyncCheckpointer(cfg.run_dir, rank=0, world_size=1, writer_stall_s=120.0, fork_writer=True)
        store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]) + 1, 1, True, use_libuv=False)
        iterations = []

        def train(call_wrapper: CallWrapper = None):
            iterations.append(call_wrapper.iteration)
            if call_wrapper.iteration > 0:
                return  # restarted: what the test looks for
            dist.init_process_group("gloo", store=dist.PrefixStore("iter-0", store), rank=0, world_size=1)
            try:
                def progress():
                    pings.append(1)
                    call_wrapper.ping()

                ckpt.rebind(dist.group.WORLD, timeout_s=3.0, progress=progress)
                call_wrapper.ping()  # as every training step does
                (writer,) = ckpt.writer_pids()
                os.kill(writer, signal.SIGSTOP)  # before the save: the write cannot finish first
                threading.Timer(6.0, os.kill, (writer, signal.SIGCONT)).start()
                ckpt.save(1, {"model": {"w": torch.randn(256, 256)}})
                ckpt.wait()
            finally:
                if dist.is_initialized():
                    dist.destroy_process_group()

        inprocess_wrapper(cfg, lambda: EventLog(cfg.layout.events), device_type="cpu")(train)()
        ckpt.close(wait=False)
        print("SEEN " + json.dumps({"iterations": iterations, "pings": len(pings)}), flush=True)


    if __name__ == "__main__":  # the Wrapper spawns its monitor process, which imports this file
        main()
""")


def test_a_save_waiting_on_a_slow_write_is_not_taken_for_a_hang(tmp_path):
    """The Wrapper restarts a rank whose last ping is older than its soft timeout. A save that
    waits on a write slower than that (an 8b save to FSx slower than the interval) pings from each
    round of its wait (every 50 ms), so the rank is not restarted: one iteration, no soft timeout.
    (Without the pings the same wait is taken for a hang, but only when NVRx's monitor process
    happens to check between its watchdog's messages: not something a test can count on.)"""
    port = free_port()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1"}
    env.pop("LOCAL_RANK", None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")])
    # A file, not -c: the Wrapper's monitor process is spawned, and imports the main script.
    script = tmp_path / "slow_write.py"
    script.write_text(SLOW_WRITE)
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "run")],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    output = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, output
    seen = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("SEEN "))[5:])
    assert seen["iterations"] == [0] and "SOFT_TIMEOUT" not in proc.stderr, output
    assert seen["pings"] >= 20, seen  # a 6 s wait in 50 ms rounds (fewer on a loaded machine)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_the_calls_queue_never_runs_nvrx_finalize_when_collected():
    """NVRx 0.7's AsyncCallsQueue.__del__ calls close(), whose finalize runs a CUDA collective
    (and waits on a worker): ours forgets its calls instead, whenever it is collected."""
    queue = _WriterQueue(_PersistentWriter(rank=0))  # never started
    queue.async_calls.append(object())
    queue.close()
    assert not queue.async_calls and queue.persistent_caller is None
    queue.async_calls.append(object())
    del queue
    gc.collect()


# ------------------------------------------------------------------ restarts on NCCL vs gloo


def test_gpu_health_checks_run_on_cuda_only_and_can_be_turned_off(tmp_path, dataset, monkeypatch):
    cfg = write_config(tmp_path, dataset, "health")
    assert restart_health_checks_wanted(cfg, "cuda")
    assert not restart_health_checks_wanted(cfg.replace(gpu_health_checks=False), "cuda")
    assert not restart_health_checks_wanted(cfg, "cpu")

    # On CPU the Wrapper keeps no NVML checks (0.7 chains them in whenever LOCAL_RANK is set).
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    wrapper = inprocess_wrapper(cfg, lambda: None, device_type="cpu")
    assert getattr(wrapper, "restart_health_check", None) is None
    if NVRX_07:  # the defect is real there: the stock Wrapper adds them by itself
        stock = type(wrapper)(store_kwargs={"port": free_port()})
        assert stock.restart_health_check is not None


def test_cuda_process_groups_are_bound_to_their_device():
    assert process_group_options(torch.device("cuda", 3)) == {"device_id": torch.device("cuda", 3)}
    assert process_group_options(torch.device("cpu")) == {}


#: Two ranks over gloo with a 120 s collective timeout, through ``init_process_group`` and
#: ``app_store`` (``restart.process_group``) as the trainer uses them. Attempt 0: rank 0 blocks
#: in an all-reduce, rank 1 breaks its transport (what ``Trainer._on_fault`` does on a failing rank). Attempt 1: rank 0
#: blocks again, with no peer coming, and a thread breaks its own transport (what the Wrapper's
#: abort does on every rank). Attempt 2: a fresh group works, and so does the store. Each rank
#: prints what it saw as JSON.
BROKEN_TRANSPORT = textwrap.dedent("""
    import json, os, threading, time
    import torch, torch.distributed as dist
    from fsdp_resilience.training.restart.gloo_transport import group_transport
    from fsdp_resilience.training.restart.process_group import app_store, init_process_group

    rank = int(os.environ["RANK"])
    store = app_store()
    seen = {"rank": rank, "errors": []}

    def blocked_all_reduce():
        t0 = time.monotonic()
        try:
            dist.all_reduce(torch.ones(4))
            seen["errors"].append(None)
        except RuntimeError as e:
            seen["errors"].append(str(e)[:300])
        seen.setdefault("blocked_s", []).append(round(time.monotonic() - t0, 3))

    for attempt in range(3):
        init_process_group("gloo", attempt, timeout_s=120.0, join_timeout_s=120.0, app_store=store)
        if attempt == 0:
            if rank == 0:
                blocked_all_reduce()
            else:
                time.sleep(0.5)  # rank 0 is in its all-reduce by now
                seen["shut_down"] = group_transport.shut_down()
        elif attempt == 1:
            if rank == 0:
                threading.Timer(0.5, group_transport.shut_down).start()
                blocked_all_reduce()
                store.set("attempt1-done", "1")
            else:
                store.wait(["attempt1-done"])
        else:
            total = torch.full((4,), float(rank + 1))
            dist.all_reduce(total)
            seen["sum"] = total.tolist()
            store.set(f"store-works-{rank}", "yes")
            seen["store"] = store.get(f"store-works-{1 - rank}").decode()
        dist.destroy_process_group()
    print(json.dumps(seen), flush=True)
""")


def test_a_failed_rank_breaks_its_transport_so_peers_stop_waiting(tmp_path):
    """A gloo collective blocked on a peer ends only at its timeout or when its connection breaks:
    no torch abort reaches it. ``GroupTransport`` (``restart.gloo_transport``) breaks the attempt's connections: a
    peer's pending collective, then this rank's own, fail at once with a closed connection (a
    platform fault), long before the 120 s timeout; the next attempt's group and the store work."""
    script = tmp_path / "ranks.py"
    script.write_text(BROKEN_TRANSPORT)
    port = free_port()
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": "2",
        "PYTHONPATH": str(REPO / "src"),
    }
    logs = [tmp_path / f"rank{rank}.log" for rank in (0, 1)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(script)],
            cwd=REPO,
            env={**env, "RANK": str(rank)},
            stdout=open(logs[rank], "w"),
            stderr=subprocess.STDOUT,
        )
        for rank in (0, 1)
    ]
    try:
        deadline = time.monotonic() + 90  # the collective timeout is 120 s
        codes = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:
            p.kill()
    outputs = [log.read_text() for log in logs]
    assert codes == [0, 0], [out[-2000:] for out in outputs]
    rank0, rank1 = (json.loads(out.strip().splitlines()[-1]) for out in outputs)
    assert rank1["shut_down"] >= 1  # its connection to rank 0
    assert len(rank0["errors"]) == 2, rank0
    for error in rank0["errors"]:  # the peer's break, then its own: never the timeout
        assert error is not None and "closed" in error.lower() and "timed out" not in error.lower(), error
        assert is_platform_fault(RuntimeError(error))
    assert rank0["sum"] == rank1["sum"] == [3.0] * 4
    assert rank0["store"] == rank1["store"] == "yes"


def test_adamw_is_fused_on_cuda_and_foreach_on_cpu():
    model = torch.nn.Linear(4, 4)
    cpu = build_optimizer(model, torch.device("cpu"), lr=1e-3, weight_decay=0.1)
    assert cpu.defaults["foreach"] and not cpu.defaults.get("fused")
    if torch.cuda.is_available():
        gpu = build_optimizer(model.cuda(), torch.device("cuda"), lr=1e-3, weight_decay=0.1)
        assert gpu.defaults["fused"]


# ------------------------------------------------------------------ ft_launcher's config


def test_the_launcher_refuses_an_ft_config_nvrx_would_ignore(tmp_path, dataset, monkeypatch, capsys):
    """NVRx reads ft_launcher's YAML silently: an unknown key (or a file it cannot parse) leaves
    it on its defaults. fsdp_resilience.training.launch reads its own file back with NVRx's parser first."""
    cfg = write_config(tmp_path, dataset, "ftcfg")
    cfg_path = tmp_path / "ftcfg.json"
    assert launch_main(["--config", str(cfg_path), "--dry-run"]) == 0
    written = json.loads((cfg.layout.logs / "ft-launcher-node0.yaml").read_text())["fault_tolerance"]
    assert written["rank_heartbeat_timeout"] == cfg.heartbeat_timeout_s
    # the configured timeouts, until the workers derive theirs (RankMonitor.derive_when_warm)
    assert written["rank_section_timeouts"] == cfg.section_timeouts()
    assert written["safety_factor"] == cfg.timeout_safety_factor
    assert ("checkpoint_iteration_file" in written) == NVRX_07  # progress tracking where NVRx has it
    capsys.readouterr()

    original = launch_command.ft_launcher_config

    def with_a_typo(cfg, known):
        section = original(cfg, known)
        section["fault_tolerance"]["rank_heartbeat_timout"] = 5.0
        return section

    monkeypatch.setattr(launch_command, "ft_launcher_config", with_a_typo)
    assert launch_main(["--config", str(cfg_path), "--dry-run"]) == ExitCode.CONFIG_ERROR
    assert "rank_heartbeat_timout" in capsys.readouterr().err


@pytest.mark.slow
def test_a_launch_needs_no_ft_launcher_script_next_to_the_interpreter(tmp_path, dataset):
    """The NGC image runs /usr/bin/python, and pip puts ft_launcher's console script in
    /usr/local/bin. Here: the base interpreter (no venv, no console script next to it or on PATH),
    with the packages on PYTHONPATH; an injob launch with a SIGKILL trains to the end."""
    base = Path(getattr(sys, "_base_executable", sys.executable)).resolve()
    assert not (base.parent / "ft_launcher").exists(), base
    cfg = write_config(
        tmp_path, dataset, "noscript", steps=6, restart_mode="injob", faults=[{"kind": "sigkill", "step": 4, "rank": 1}]
    )
    paths = sysconfig.get_paths()
    env = {k: v for k, v in os.environ.items() if k not in ("PATH", "VIRTUAL_ENV", "PYTHONHOME", "PYTHONPATH")}
    env["PATH"] = "/usr/bin:/bin"
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([str(REPO / "src"), paths["purelib"], paths["platlib"]]))
    proc = subprocess.run(
        [str(base), "-m", "fsdp_resilience.training.launch", "--config", str(tmp_path / "noscript.json")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    events = read_events(cfg.layout.events)
    command = next(r["command"] for r in events if r["event"] == "launch_begin")
    assert command.startswith(f"{base} -c "), command
    assert any(r["event"] == "restart_end" and r["layer"] == "injob" for r in events)
    assert max(r["step"] for r in events if r["event"] == "step") == 6


@pytest.mark.slow
def test_restart_cycles_without_progress(tmp_path, dataset):
    """A rank that dies at the same step in every cycle, after a commit: NVRx 0.7 stops after
    three restart cycles that commit nothing new and exits 93, which the launcher reports as
    no_progress. 0.4.1 has no progress tracking: it would spend every restart, which
    test_restarts_exhausted_ends_with_its_exit_code_and_class shows."""
    if not NVRX_07:
        pytest.skip("NVRx 0.4.1 has no progress tracking (no exit 93)")
    # Step 2's save is committed by step 4's save; step 4's is still pending when rank 1 dies at the
    # start of step 5. So the first cycle moves the committed step to 2 and no later cycle moves it.
    cfg = write_config(
        tmp_path,
        dataset,
        "noprogress",
        steps=10,
        checkpoint_interval=2,
        restart_mode="injob",
        max_restarts=4,
        faults=[{"kind": "sigkill", "step": 5, "rank": 1, "attempt": None}],
    )
    proc = launch(cfg, tmp_path / "noprogress.json")
    rc = proc.wait(timeout=600)
    final = read_events(cfg.layout.events, Event.FINAL)[-1]
    restarts = [r for r in read_events(cfg.layout.events, Event.TRAIN_BEGIN) if r.get("rank") == 0]
    print(f"exit {rc}: {final['message']} after {len(restarts)} worker starts")
    assert (rc, final["failure_class"]) == (ExitCode.NO_PROGRESS, FailureClass.NO_PROGRESS.value)
    assert final["launcher_exit_code"] == 93
    assert len(restarts) < cfg.max_restarts + 1  # stopped before spending every restart
    assert final["step"] == 2  # the committed checkpoint is kept


def test_the_training_image_pins_the_nvrx_the_07_lane_tests():
    lane = (REPO / "tests" / "nvrx07" / "setup-root.sh").read_text()
    image = (REPO / "images" / "training" / "Dockerfile").read_text()
    tested = next(ln.split("=", 1)[1] for ln in lane.splitlines() if ln.startswith("NVRX_VERSION="))
    pinned = next(ln.split("=", 1)[1] for ln in image.splitlines() if ln.startswith("ARG NVRX_VERSION="))
    assert tested == pinned == "0.7.0"
