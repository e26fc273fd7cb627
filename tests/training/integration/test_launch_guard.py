"""fsdp_resilience.training.launch guards its run: one launch per run per node, no process outlives it, bad paths
and storage that cannot take writes end with their own exit code and one line.

Real launcher processes (`python -m fsdp_resilience.training.launch`) on the local CPU path; no mocks. Storage
faults use real mounts (a read-only bind mount, a small tmpfs) in a private mount namespace, and
are skipped with the reason where this machine does not allow mounting.
"""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fsdp_resilience.training.contract import (
    CheckpointCatalog,
    Event,
    ExitCode,
    FailureClass,
    declare_stop,
    final_status,
    read_events,
    verify_checkpoint,
)
from fsdp_resilience.training.faults import descendants

from training.support import REPO, launch, launch_processes, wait_until_no_process_of, write_config

# -------------------------------------------------------------------------------- helpers


def wait_for_event(cfg, predicate, proc: subprocess.Popen, timeout: float = 300) -> dict:
    """The first event that satisfies ``predicate``, waiting while the launcher runs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for r in read_events(cfg.layout.events):
            if predicate(r):
                return r
        if proc.poll() is not None:
            raise AssertionError(f"the launcher exited {proc.returncode} before the awaited event")
        time.sleep(0.5)
    raise AssertionError("the awaited event never came")


def end_leftovers(launch_pid: int) -> None:
    """After a failed test: kill what its launch left running, so it does not train on."""
    for pid, _ in launch_processes(launch_pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_launch(cfg_path: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fsdp_resilience.training.launch", "--config", str(cfg_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def private_mount_namespace(tmp_path: Path) -> list[str]:
    """The command prefix that runs a command in a private mount namespace where it may mount (the
    mounts vanish with it, and none reaches this namespace), or skips the test saying why not.

    ``--propagation private`` needs "/" to be a mount point, which it is not in a chroot (the 0.7
    lane); there ``unchanged`` is as private when no mount here is shared with another namespace."""
    probe = tmp_path / "mount-probe"
    probe.mkdir()
    reasons = []
    try:
        for propagation in ("private", "unchanged"):
            if propagation == "unchanged" and "shared:" in Path("/proc/self/mountinfo").read_text():
                break  # a mount made here could reach the host's namespace
            prefix = ["unshare", "--mount", "--propagation", propagation]
            try:
                out = subprocess.run(
                    [*prefix, "mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(probe)],
                    capture_output=True,
                    text=True,
                    timeout=30,
                )
            except (OSError, subprocess.TimeoutExpired) as e:
                pytest.skip(f"unshare is not usable here ({e})")
            if out.returncode == 0:
                return prefix
            reasons.append(out.stderr.strip() or f"exit {out.returncode}")
    finally:
        probe.rmdir()
    pytest.skip(f"mounting in a private mount namespace is not allowed here: {'; '.join(reasons)}")


def one_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


# -------------------------------------------------------------------------------- one launch, in phases


@pytest.fixture(scope="module")
def guarded(tmp_path_factory, dataset) -> dict:
    """One launch, in phases (starting a launch is what costs time; each test checks a phase):

    1. the run dir holds a storage stop from an earlier launch, and takes writes again: the
       launcher clears the stop and trains;
    2. while it trains, a second launcher of the run is refused, and the first trains on;
    3. the first launcher is SIGKILLed: every process of the launch goes with it."""
    tmp = tmp_path_factory.mktemp("guarded")
    cfg = write_config(tmp, dataset, "guarded", steps=400)
    cfg_path = tmp / "guarded.json"
    cfg.layout.create()
    assert declare_stop(cfg.layout, FailureClass.STORAGE_ERROR, rank=1, step=9, error="[Errno 28] No space left")
    proc = launch(cfg, cfg_path)
    seen = {"cfg": cfg, "pid": proc.pid}
    try:
        wait_for_event(cfg, lambda r: r["event"] == "step" and r["step"] >= 2, proc)
        seen["second"] = run_launch(cfg_path)
        refused_at = time.time()
        wait_for_event(cfg, lambda r: r["event"] == "step" and r["ts"] > refused_at, proc)

        seen["tree"] = [(pid, start_time(pid)) for pid in descendants(proc.pid)]
        seen["marked"] = launch_processes(proc.pid)
        proc.send_signal(signal.SIGKILL)
        seen["rc"] = proc.wait(timeout=60)
        seen["left"] = wait_until_no_process_of(proc.pid)
    finally:
        proc.kill()
        end_leftovers(proc.pid)
    return seen


@pytest.mark.slow
def test_a_storage_stop_is_cleared_once_the_run_dir_takes_writes_again(guarded):
    layout = guarded["cfg"].layout
    assert not layout.stop_marker.exists()
    assert [json.loads(p.read_text())["failure_class"] for p in layout.control.glob("STOP.cleared.*.json")] == [
        "storage_error"
    ]
    assert {r["rank"] for r in read_events(layout.events, Event.TRAIN_BEGIN)} == {0, 1}


@pytest.mark.slow
def test_a_second_launcher_of_the_run_is_refused_at_once_and_changes_nothing(guarded):
    cfg, first = guarded["cfg"], guarded["pid"]
    second = guarded["second"]
    assert second.returncode == ExitCode.ALREADY_RUNNING, second.stderr
    line = one_line(second.stderr)
    assert str(cfg.layout.launch_lock(0)) in line and f"pid {first}" in line, line
    assert second.stdout == ""
    # The refused launcher wrote nothing (one launch_begin, from the first; no final: the first
    # was SIGKILLed), and the first trained on (the fixture waited for a step after the refusal).
    events = read_events(cfg.layout.events)
    assert [r["pid"] for r in events if r["event"] in ("launch_begin", "final")] == [first]


def test_dry_run_takes_no_lock(tmp_path, dataset):
    cfg = write_config(tmp_path, dataset, "dry")
    cfg.layout.control.mkdir(parents=True)
    with open(cfg.layout.launch_lock(0), "w") as held:  # as a running launcher would hold it
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "fsdp_resilience.training.launch",
                "--config",
                str(tmp_path / "dry.json"),
                "--dry-run",
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert out.returncode == 0, out.stderr
    assert "worker_client.py --config" in out.stdout  # the default restart mode: ranks from the zygote


@pytest.mark.slow
def test_a_launcher_whose_workers_never_started_is_not_restarts_exhausted(tmp_path, dataset):
    """ft_launcher cannot host the rendezvous (its port is taken, as by another launch) and exits
    before any rank ran: nothing was restarted, no node is suspect."""
    cfg = write_config(tmp_path, dataset, "clash", steps=6)
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind(("0.0.0.0", cfg.rdzv_port))
        taken.listen()
        proc = launch(cfg, tmp_path / "clash.json")
        try:
            rc = proc.wait(timeout=300)
        finally:
            proc.kill()
            end_leftovers(proc.pid)
    log_path = tmp_path / "clash.node0.log"
    assert rc == ExitCode.UNKNOWN, log_path.read_text()[-3000:]
    final = final_status(cfg.run_dir)
    assert final["failure_class"] == FailureClass.UNKNOWN.value and final["exit_code"] == ExitCode.UNKNOWN
    assert "the workers never started" in final["message"] and str(log_path) in final["message"], final
    assert not read_events(cfg.layout.events, Event.TRAIN_BEGIN)
    assert launch_processes(proc.pid) == []


# -------------------------------------------------------------------------------- stops a rank declares


@pytest.mark.slow
def test_a_declared_stop_ends_the_launch_with_its_class_and_no_relaunch_trains(tmp_path, dataset):
    """A rank that finds a fault no restart fixes declares it (control/STOP.json); the launcher
    stops ft_launcher after a grace and ends with that class. Declared here as a rank would."""
    cfg = write_config(tmp_path, dataset, "stopped", steps=400)
    cfg_path = tmp_path / "stopped.json"
    proc = launch(cfg, cfg_path)
    try:
        wait_for_event(cfg, lambda r: r["event"] == "step" and r["step"] >= 2, proc)
        assert declare_stop(cfg.layout, FailureClass.NON_FINITE, rank=0, step=2, error="the loss is nan")
        rc = proc.wait(timeout=300)
    finally:
        proc.kill()
        end_leftovers(proc.pid)
    assert rc == ExitCode.NON_FINITE, (tmp_path / "stopped.node0.log").read_text()[-3000:]
    final = final_status(cfg.run_dir)
    assert (final["failure_class"], final["exit_code"]) == ("non_finite", 65)
    assert "the loss is nan" in final["message"]
    assert wait_until_no_process_of(proc.pid) == []

    # Launched again, it trains nothing: the stop stands until a new run.
    before = len(read_events(cfg.layout.events))
    again = run_launch(cfg_path)
    assert again.returncode == ExitCode.NON_FINITE, again.stdout + again.stderr
    assert [r["event"] for r in read_events(cfg.layout.events)[before:]] == ["final"]
    assert "not launching again" in final_status(cfg.run_dir)["message"]


# -------------------------------------------------------------------------------- no orphans


@pytest.mark.slow
def test_sigkill_of_the_launcher_takes_every_process_of_the_launch_with_it(guarded):
    cfg, marked, tree = guarded["cfg"], guarded["marked"], guarded["tree"]
    # A rank is forked from the node's zygote; the client ft_launcher started stands for it.
    ranks = [pid for pid, cmd in marked if "worker_client.py" in cmd]
    assert any("worker_zygote" in cmd for _, cmd in marked), marked
    assert len(ranks) >= 2, marked  # ranks, their writers and NVRx's helpers among them
    assert set(ranks) <= {pid for pid, _ in tree}
    assert guarded["rc"] == -signal.SIGKILL
    left = guarded["left"]
    assert left == [], "left running after fsdp_resilience.training.launch was SIGKILLed:\n" + "\n".join(
        f"{p} {c}" for p, c in left
    )
    assert not [pid for pid, started in tree if start_time(pid) == started], "a process of the tree lives on"
    # ... and the launch lock went with them: the run can be launched again.
    with open(cfg.layout.launch_lock(0)) as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    assert final_status(cfg.run_dir) is None  # a SIGKILLed launcher reports nothing


def start_time(pid: int) -> int | None:
    """When a live process started (clock ticks since boot), None once it has exited: with the pid
    it tells a process from a later one that reuses its pid."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else int(fields[19])


# -------------------------------------------------------------------------------- bad paths


@pytest.mark.parametrize(
    "where", ["run dir under a file", "run dir is a file", "dataset under a file", "run dir is a dangling link"]
)
def test_a_path_that_cannot_be_a_folder_is_a_config_error_in_one_line(tmp_path, dataset, where):
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder\n")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere" / "at-all")
    run_dir, dataset_dir = {
        "run dir under a file": (a_file / "run", dataset),
        "run dir is a file": (a_file, dataset),
        "dataset under a file": (tmp_path / "run", a_file / "dataset"),
        "run dir is a dangling link": (tmp_path / "dangling", dataset),
    }[where]
    cfg_path = tmp_path / "bad.json"
    cfg_path.write_text(
        json.dumps({"run_id": "bad", "run_dir": str(run_dir), "dataset_dir": str(dataset_dir), "device": "cpu"})
    )
    out = run_launch(cfg_path, timeout=60)
    assert out.returncode == ExitCode.CONFIG_ERROR, out.stderr
    line = one_line(out.stderr)
    assert line.startswith("error: ") and ("run_dir=" in line or "dataset_dir=" in line), line
    assert not (tmp_path / "run").exists() and not (tmp_path / "nowhere").exists()


# -------------------------------------------------------------------------------- storage


def test_a_read_only_run_dir_is_a_storage_error_in_one_line(tmp_path, dataset):
    in_namespace = private_mount_namespace(tmp_path)
    cfg = write_config(tmp_path, dataset, "readonly")
    cfg.layout.create()  # a run dir from before, mounted read-only now
    run_dir = shlex.quote(cfg.run_dir)
    script = (
        f"mount --bind {run_dir} {run_dir} && mount -o remount,bind,ro {run_dir} && "
        f"exec {shlex.quote(sys.executable)} -m fsdp_resilience.training.launch --config "
        f"{shlex.quote(str(tmp_path / 'readonly.json'))}"
    )
    out = subprocess.run([*in_namespace, "sh", "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == ExitCode.STORAGE_ERROR, out.stderr
    line = one_line(out.stderr)
    assert "Read-only file system" in line and "cannot take writes" in line, line
    assert read_events(cfg.layout.events) == []  # nothing could be (or was) written


@pytest.mark.slow
def test_a_run_dir_that_fills_up_ends_as_a_storage_error_and_keeps_its_verified_checkpoints(tmp_path, dataset):
    """The run dir is a 24 MiB tmpfs: room for two checkpoints of the tiny model (about 11 MiB
    each, both ranks together), not three; retention keeps them all, so the third save fills it.
    Few restarts: however the ranks react, the launch ends in minutes."""
    in_namespace = private_mount_namespace(tmp_path)
    mnt = tmp_path / "small-disk"
    mnt.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    write_config(
        tmp_path,
        dataset,
        "full",
        run_dir=str(mnt / "full"),
        steps=30,
        keep_checkpoints=10,
        max_restarts=1,
        max_inprocess_restarts=2,
    )
    q = shlex.quote
    # Inside a private mount namespace: mount, launch, remember the launcher's pid and exit code,
    # and copy the run dir out before the namespace (and its tmpfs) goes away.
    script = f"""
        mount -t tmpfs -o size=24m tmpfs {q(str(mnt))} || exit 99
        {q(sys.executable)} -m fsdp_resilience.training.launch --config {q(str(tmp_path / "full.json"))} > {q(str(out / "launch.log"))} 2>&1 &
        echo $! > {q(str(out / "pid"))}
        wait $!
        echo $? > {q(str(out / "rc"))}
        cp -a {q(str(mnt / "full"))} {q(str(out / "run"))}
    """
    done = subprocess.run([*in_namespace, "sh", "-c", script], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    log = (out / "launch.log").read_text()
    rc, launch_pid = int((out / "rc").read_text()), int((out / "pid").read_text())

    assert rc == ExitCode.STORAGE_ERROR, log[-4000:]
    run = out / "run"
    finals = read_events(run / "events.jsonl", Event.FINAL)
    if finals:  # the final event may not have fit on the full disk (it then went to stderr)
        assert finals[-1]["failure_class"] == FailureClass.STORAGE_ERROR.value, finals[-1]
    else:
        assert f"{FailureClass.STORAGE_ERROR.value} (exit 74)" in log, log[-4000:]
    # No committed checkpoint was lost, and every one that is there verifies.
    committed = CheckpointCatalog(run).committed()
    assert committed, "not even the first checkpoint was committed: make the tmpfs bigger"
    for c in committed:
        assert verify_checkpoint(c.path) is None, (c.checkpoint_id, verify_checkpoint(c.path))
    announced = {r["checkpoint_id"] for r in read_events(run / "events.jsonl", Event.CHECKPOINT_COMMIT)}
    assert announced <= {c.checkpoint_id for c in committed}
    left = wait_until_no_process_of(launch_pid)
    end_leftovers(launch_pid)
    assert left == [], left
