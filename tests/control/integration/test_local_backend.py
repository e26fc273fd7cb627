"""The local training backend with real processes and real training (the tiny model, 2 CPU ranks).

Runs in the control-plane venv (no torch); training runs in the training venv's python, started
by the backend exactly as the DAGs start it. Every wait polls ``status`` with a generous timeout
and no test asserts a duration: a loaded 2-core machine is slow, not wrong.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shared import FAST_RUN, make_dataset

REPO = Path(__file__).resolve().parents[3]

from fsdp_resilience.control.backends import (  # noqa: E402
    BackendError,
    Capacity,
    Diagnosis,
    InsufficientCapacityError,
    JobHandle,
    JobStatus,
    LocalProcessBackend,
    get_backend,
    job_name_for,
)
from fsdp_resilience.control.backends.local.processes import proc_stat, process_alive, tagged_processes  # noqa: E402
from fsdp_resilience.training.contract import CheckpointCatalog, RunConfig, read_events  # noqa: E402

from control.fakes.stand_in_launcher import script_backend  # noqa: E402

TRAINING_PYTHON = Path(os.environ.get("TRAINING_PYTHON") or REPO / ".venv" / "bin" / "python")
needs_training = pytest.mark.skipif(
    not TRAINING_PYTHON.exists(), reason=f"no training venv at {TRAINING_PYTHON}: run `make setup`"
)

#: Short timeouts so drills resolve in seconds on a loaded 2-core machine (as tests/conftest.py).
FAST = dict(FAST_RUN, model="tiny", checkpoint_interval=2)
WAIT_S = 300  # per launch; a run here takes 15-60 s


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """Real text as byte-token shards (tests/shared.py), made by the training venv's prepare_data."""
    return make_dataset(tmp_path_factory.mktemp("data") / "dataset", python=str(TRAINING_PYTHON))


@pytest.fixture()
def backend(tmp_path):
    """A fresh local backend (4 healthy slots); whatever a test leaves running is stopped."""
    b = LocalProcessBackend(tmp_path / "state", slots=4, training_python=str(TRAINING_PYTHON), cancel_grace_s=10)
    yield b
    for record in b._store.jobs():
        b.cancel(JobHandle("local", record["run_id"], record["launch_id"], record["job_name"]))


#: Appended to every run id here: a local job's processes are found by a tag that names its job (run
#: id + launch id) anywhere on the machine, so two pytest sessions on one host must not share job names.
SESSION = f"s{os.getpid()}"


def run_config(tmp_path: Path, dataset: Path, run_id: str, **overrides) -> RunConfig:
    run_id = f"{run_id}-{SESSION}"
    fields = dict(
        FAST, run_id=run_id, run_dir=str(tmp_path / "runs" / run_id), dataset_dir=str(dataset), rdzv_port=free_port()
    )
    fields.update(overrides)
    return RunConfig(**fields)


def wait_for(
    backend: LocalProcessBackend, handle: JobHandle, states=("succeeded", "failed"), timeout: float = WAIT_S
) -> JobStatus:
    deadline = time.monotonic() + timeout
    while True:
        status = backend.status(handle)
        if status.state in states:
            return status
        if time.monotonic() > deadline:
            pytest.fail(
                f"job {handle.job_name} still {status.state} after {timeout}s: {status.message}\n"
                f"{backend.logs(handle, tail=40)}"
            )
        time.sleep(0.5)


def wait_for_event(run_dir: str, predicate, timeout: float = WAIT_S) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        hits = [r for r in read_events(Path(run_dir) / "events.jsonl") if predicate(r)]
        if hits:
            return hits[0]
        time.sleep(0.3)
    pytest.fail(f"no matching event in {run_dir}/events.jsonl after {timeout}s")


def launcher_processes(job_name: str) -> list[int]:
    return [
        pid
        for pid in tagged_processes(job_name)
        if b"fsdp_resilience.training.launch" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]


def children_of(pid: int) -> list[int]:
    """Processes whose parent is ``pid``, zombies included."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_bytes() if entry.name.isdigit() else b""
        except OSError:
            continue
        if stat and int(stat[stat.rindex(b")") + 2 :].split()[1]) == pid:
            found.append(int(entry.name))
    return found


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes in process group ``pgid``."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = proc_stat(int(entry.name))
            if stat and stat[1] == pgid and stat[0] not in ("Z", "X"):
                members.append(int(entry.name))
    return members


def wait_until(predicate, timeout: float = 30.0):
    """Poll ``predicate`` until it returns something true (or time runs out); returns that."""
    deadline = time.monotonic() + timeout
    while not (result := predicate()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return result


def until_empty(check, timeout: float = 30.0):
    """Poll ``check`` until it returns nothing (or time runs out); returns its last result. Exited
    processes take a moment to be reaped by their parent."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if not result or time.monotonic() > deadline:
            return result
        time.sleep(0.2)


# --------------------------------------------------------------------------------------------
# Slots and capacity (no processes); the interface itself: tests/control/unit/test_backend_base.py
# --------------------------------------------------------------------------------------------


def test_replace_nodes_quarantines_slots_and_refuses_above_the_share(tmp_path):
    b = LocalProcessBackend(tmp_path / "state", slots=4, training_python=str(TRAINING_PYTHON))  # share 0.5: 2
    assert b.capacity() == Capacity(4, 4, [], ["slot-0", "slot-1", "slot-2", "slot-3"])
    too_many = b.replace_nodes(["slot-0", "slot-1", "slot-2"], reason="test")
    assert too_many.replaced == [] and too_many.refused == ["slot-0", "slot-1", "slot-2"]
    assert "refused to replace 3 of 4 nodes at once" in too_many.reason and "allows 2" in too_many.reason
    assert b.capacity().healthy == 4  # nothing changed

    done = b.replace_nodes(["slot-2", "slot-9"], reason="restarts exhausted twice")
    assert done.replaced == ["slot-2"] and done.refused == ["slot-9"] and "not in the pool" in done.reason
    assert b.capacity() == Capacity(4, 3, ["slot-2"], ["slot-0", "slot-1", "slot-3"])
    slots = json.loads((tmp_path / "state" / "slots.json").read_text())["slots"]
    assert slots["slot-2"]["state"] == "quarantined" and slots["slot-2"]["reason"] == "restarts exhausted twice"
    # another process sees the same pool
    assert LocalProcessBackend(tmp_path / "state", slots=4).capacity().quarantined == ["slot-2"]
    assert b.return_nodes(["slot-2"], reason="test: slot checked").returned == ["slot-2"] and b.capacity().healthy == 4

    strict = LocalProcessBackend(tmp_path / "strict", slots=4, max_unhealthy_share=0.2)  # EKS's default
    assert strict.replace_nodes(["slot-0", "slot-1"], reason="x").refused == ["slot-0", "slot-1"]
    assert strict.replace_nodes(["slot-0"], reason="x").replaced == ["slot-0"]  # at least one


def test_submit_without_enough_healthy_slots_names_the_capacity(tmp_path):
    b = LocalProcessBackend(tmp_path / "state", slots=2, training_python=sys.executable, max_unhealthy_share=1)
    b.replace_nodes(["slot-0"], reason="bad")
    no_data = tmp_path / "no-data"  # nothing gets to read it
    with pytest.raises(InsufficientCapacityError, match=r"needs 2 free healthy slot\(s\).*1 quarantined \['slot-0'\]"):
        b.submit(run_config(tmp_path, no_data, "toobig", nodes=2, procs_per_node=1), launch_id="1")
    with pytest.raises(InsufficientCapacityError, match="only 2 slot"):
        b.submit(run_config(tmp_path, no_data, "huge", nodes=3, procs_per_node=1), launch_id="1")
    assert not list((tmp_path / "state" / "jobs").glob("*.json"))  # nothing was started


def test_the_control_plane_never_imports_torch():
    code = (
        "import sys; sys.path.insert(0, 'plugins'); import fsdp_resilience.control.backends.local, "
        "fsdp_resilience.control.backends.base; assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


# --------------------------------------------------------------------------------------------
# Real jobs
# --------------------------------------------------------------------------------------------


@needs_training
@pytest.mark.slow
def test_a_run_succeeds_and_submitting_it_again_starts_nothing(backend, tmp_path, dataset):
    cfg = run_config(tmp_path, dataset, "ok", steps=4)
    # This session's own children (the Kubernetes control plane, when an EKS test started it).
    before = set(children_of(os.getpid()))
    t0 = time.monotonic()
    handle = backend.submit(cfg, launch_id="1")
    submit_s = time.monotonic() - t0
    assert handle.job_name == job_name_for(cfg.run_id, "1") and handle.extra["node_ids"] == ["slot-0"]

    # Idempotent: from this backend, or another process's (built from its config), same job.
    again = get_backend(**backend.to_config()).submit(cfg, launch_id="1")
    assert again == handle == backend.submit(cfg, launch_id="1")
    assert len(list((tmp_path / "state" / "jobs").glob("*.json"))) == 1
    assert len(launcher_processes(handle.job_name)) == 1
    assert set(children_of(os.getpid())) <= before  # detached: the caller is nobody's parent, leaves no zombie

    config_file = Path(cfg.run_dir) / "launches" / "1.json"
    assert RunConfig.load(config_file) == cfg
    status = wait_for(backend, handle)
    assert status.state == "succeeded", f"{status.message}\n{backend.logs(handle, tail=60)}"
    assert status.failure_class == "success" and status.exit_codes == {0: 0}
    assert [(n.index, n.node_id, n.state) for n in status.nodes] == [(0, "slot-0", "succeeded")]
    assert CheckpointCatalog(cfg.run_dir).latest().step == 4
    assert "[launch] node 0: success" in backend.logs(handle, node=0)
    # any process can ask, from the JSON handle alone
    other = get_backend(**backend.to_config())
    assert other.status(JobHandle.from_dict(json.loads(json.dumps(handle.to_dict())))).state == "succeeded"
    assert not backend.diagnose(handle).replaceable
    assert not until_empty(lambda: tagged_processes(handle.job_name))
    print(f"\n[measured] submit latency: {submit_s:.3f}s")


#: Stands in for the training venv's python in the cancel tests: a "launcher" that ignores SIGTERM
#: (so cancel must escalate to SIGKILL) and, like fsdp_resilience.training.launch starting ft_launcher, leaves a
#: child in a session of its own (so only the job tag finds it).
FAKE_LAUNCHER = """#!/bin/sh
trap '' TERM
setsid sleep 300 &
sleep 300
"""


@pytest.fixture()
def fake_backend(tmp_path):
    b = script_backend(tmp_path / "fake", FAKE_LAUNCHER, slots=2, cancel_grace_s=2)
    yield b
    for record in b._store.jobs():
        b.cancel(JobHandle("local", record["run_id"], record["launch_id"], record["job_name"]))


def test_cancel_stops_every_process_of_the_job(fake_backend, tmp_path):
    backend = fake_backend
    no_data = tmp_path / "no-data"  # the fake launcher reads nothing
    handle = backend.submit(run_config(tmp_path, no_data, "cancelme", nodes=2, procs_per_node=1), launch_id="1")
    record = backend._store.read_job(handle.job_name)

    # per node: the shell, its sleep, and the sleep in a session of its own
    def all_started() -> list[int]:
        procs = tagged_processes(handle.job_name)
        return procs if len(procs) >= 6 else []

    procs = wait_until(all_started)
    assert len(procs) == 6, tagged_processes(handle.job_name)
    assert backend.status(handle).state == "running"

    backend.cancel(handle)
    assert tagged_processes(handle.job_name) == []
    for node in record["nodes"]:
        assert not until_empty(lambda node=node: group_members(node["pgid"]))
    assert not until_empty(lambda: [p for p in procs if process_alive(p)])
    supervisor = backend._store.read_job(handle.job_name)["supervisor"]
    assert not until_empty(lambda: process_alive(supervisor["pid"], supervisor["start_ticks"]))

    status = backend.status(handle)
    assert status.state == "failed" and status.failure_class == "unknown" and "cancelled" in status.message
    assert [n.state for n in status.nodes] == ["failed", "failed"]  # stopped, not lost
    diagnosis = backend.diagnose(handle)
    assert not diagnosis.replaceable and diagnosis.bad_node_ids == []
    backend.cancel(handle)  # again: nothing to do
    # both slots are free again
    next_job = backend.submit(run_config(tmp_path, no_data, "next", nodes=2, procs_per_node=1), "1")
    assert next_job.extra["node_ids"] == ["slot-0", "slot-1"]


def test_cancelling_a_stalled_job_reports_no_progress(fake_backend, tmp_path):
    cfg = run_config(tmp_path, tmp_path / "no-data", "stalled", stall_timeout_s=1.0)
    handle = fake_backend.submit(cfg, launch_id="1")
    time.sleep(1.5)  # no checkpoint committed for longer than stall_timeout_s: the watch stops it
    fake_backend.cancel(handle)
    status = fake_backend.status(handle)
    assert status.state == "failed" and status.failure_class == "no_progress", status.message
    diagnosis = fake_backend.diagnose(handle)
    assert diagnosis.replaceable and diagnosis.bad_node_ids == ["slot-0"], diagnosis


@needs_training
@pytest.mark.slow
def test_a_lost_node_fails_the_job_and_blames_its_slot(backend, tmp_path, dataset):
    cfg = run_config(tmp_path, dataset, "lost", nodes=2, procs_per_node=1, steps=400)
    handle = backend.submit(cfg, launch_id="1")
    assert handle.extra["node_ids"] == ["slot-0", "slot-1"]
    wait_for_event(cfg.run_dir, lambda r: r["event"] == "train_begin" and r["rank"] == 1)
    # Node 1's machine dies: every process of it at once, nothing gets to report.
    for pid in tagged_processes(handle.job_name, node=1):
        os.kill(pid, signal.SIGKILL)

    status = wait_for(backend, handle)
    assert status.state == "failed" and status.failure_class == "restarts_exhausted", status.message
    assert [n.state for n in status.nodes] == ["running", "lost"] and status.exit_codes == {1: None}
    assert status.message.startswith("node 1 (slot-1) lost") and "node lost" in status.message
    diagnosis = backend.diagnose(handle)
    assert diagnosis.replaceable and diagnosis.bad_node_ids == ["slot-1"], diagnosis

    # What the DAG does next: stop what is left of the launch. The verdict stays.
    record = backend._store.read_job(handle.job_name)
    backend.cancel(handle)
    assert tagged_processes(handle.job_name) == []
    assert not until_empty(lambda: group_members(record["nodes"][0]["pgid"]))
    assert backend.status(handle).failure_class == "restarts_exhausted"
    assert backend.diagnose(handle).bad_node_ids == ["slot-1"]


@needs_training
@pytest.mark.slow
def test_a_bad_slot_is_diagnosed_replaced_and_the_run_resumes_on_another(backend, tmp_path, dataset):
    # A bad machine: rank 1 is killed at step 5 on every in-job restart while it runs on slot-0
    # (attempt null), so with max_restarts=1 the job runs out of restarts. The drill is bound to the
    # slot, as a hardware fault would be: after the relaunch elsewhere it does not fire.
    cfg = run_config(
        tmp_path,
        dataset,
        "badslot",
        steps=6,
        restart_mode="injob",
        max_restarts=1,
        faults=[{"kind": "sigkill", "step": 5, "rank": 1, "attempt": None, "node_id": "slot-0"}],
    )
    first = backend.submit(cfg, launch_id="1")
    status = wait_for(backend, first)
    assert status.state == "failed", f"{status.message}\n{backend.logs(first, tail=60)}"
    assert status.failure_class == "restarts_exhausted" and status.exit_codes == {0: 75}

    diagnosis = backend.diagnose(first)
    assert diagnosis.replaceable and diagnosis.bad_node_ids == ["slot-0"], diagnosis
    assert any("fault" in line and "slot-0" in line for line in diagnosis.evidence), diagnosis.evidence
    backend.cancel(first)  # what the DAG does before diagnosing: the verdict stays
    assert backend.diagnose(first) == diagnosis

    t_replace = time.time()
    replacement = backend.replace_nodes(diagnosis.bad_node_ids, reason="restarts exhausted on slot-0")
    assert replacement.replaced == ["slot-0"] and not replacement.refused
    assert backend.capacity().healthy == 3 and backend.capacity().quarantined == ["slot-0"]
    newest = CheckpointCatalog(cfg.run_dir).latest()
    assert newest is not None  # save(4) finished save(2) before the fault at step 5

    second = backend.submit(cfg, launch_id="2")
    relaunch_s = time.time() - t_replace
    assert second.extra["node_ids"] == ["slot-1"]
    status = wait_for(backend, second)
    assert status.state == "succeeded", f"{status.message}\n{backend.logs(second, tail=60)}"
    assert CheckpointCatalog(cfg.run_dir).latest().step == 6

    events = read_events(Path(cfg.run_dir) / "events.jsonl")
    resumed = [r for r in events if r["event"] == "train_begin" and r.get("node_id") == "slot-1" and r["rank"] == 0]
    assert resumed[0]["resumed_from"] == newest.checkpoint_id
    first_step = min(r["ts"] for r in events if r["event"] == "step" and r["ts"] > resumed[0]["ts"])
    print(
        f"\n[measured] replace -> relaunch submitted: {relaunch_s:.3f}s; "
        f"replace -> first step of the relaunch: {first_step - t_replace:.1f}s"
    )


@needs_training
@pytest.mark.slow
def test_a_user_bug_is_never_blamed_on_a_node(backend, tmp_path, dataset):
    cfg = run_config(tmp_path, dataset, "userbug", steps=6, faults=[{"kind": "user_bug", "step": 3, "rank": 1}])
    handle = backend.submit(cfg, launch_id="1")
    status = wait_for(backend, handle)
    assert status.state == "failed" and status.failure_class == "user_error", status.message
    assert status.exit_codes == {0: 78}
    diagnosis = backend.diagnose(handle)
    assert diagnosis == Diagnosis("user_error", [], False, diagnosis.evidence)
    assert any("InjectedUserBug" in line for line in diagnosis.evidence), diagnosis.evidence
    assert backend.replace_nodes(diagnosis.bad_node_ids, reason="none").replaced == []
    assert backend.capacity().healthy == 4


# --------------------------------------------------------------------------------------------
# Hot spares: a lost node is covered in-job, the pool is refilled, a bad slot's spare never trains
# --------------------------------------------------------------------------------------------


def node_has_ft_launcher(job_name: str, node: int) -> bool:
    """Whether node ``node``'s launcher has started ft_launcher (a spare parks inside it)."""
    for pid in tagged_processes(job_name, node):
        try:
            if b"ft_launcher" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return True
        except OSError:
            continue
    return False


@needs_training
@pytest.mark.slow
def test_a_spare_covers_a_lost_node_and_the_pool_is_refilled_on_healthy_slots(tmp_path, dataset):
    """Two training nodes and one spare; node 1 is lost at step 5. The job stays running with node
    1 lost while the spare takes its place in-job (no relaunch), then succeeds. Meanwhile the pool is
    refilled: never on a quarantined slot, refused when no healthy slot is free, and a parked spare
    on a slot quarantined later is stopped before it can be promoted."""
    backend = LocalProcessBackend(
        tmp_path / "state", slots=6, training_python=str(TRAINING_PYTHON), cancel_grace_s=10, max_unhealthy_share=1
    )
    try:
        backend.replace_nodes(["slot-1"], reason="test: bad before the submit")
        cfg = run_config(
            tmp_path,
            dataset,
            "spare",
            nodes=2,
            spare_nodes=1,
            procs_per_node=1,
            steps=120,
            faults=[{"kind": "node_loss", "step": 5, "node": 1}],
        )
        handle = backend.submit(cfg, launch_id="1")
        assert handle.extra["node_ids"] == ["slot-0", "slot-2", "slot-3"]  # slot-1 is quarantined
        record = backend._store.read_job(handle.job_name)
        assert record["train_nodes"] == 2 and [n["standby"] for n in record["nodes"]] == [False, False, True]

        # The loss: node 1 is gone without a word, and the job goes on.
        lost = wait_until(lambda: (s := backend.status(handle)).nodes[1].state == "lost" and s, timeout=WAIT_S)
        assert lost, backend.logs(handle, tail=40)
        assert lost.state == "running", lost.message
        assert "node 1 (slot-2) lost" in lost.message and "a spare covers it" in lost.message

        # The refill, asked for at once: it waits until the spare has taken node 1's place (a
        # refill parked in the rendezvous sooner could take a survivor's). Quarantined slots are
        # skipped; then no healthy slot is left.
        backend.replace_nodes(["slot-4"], reason="test: bad during the run")
        refill = backend.add_spare(handle, reason="node 1 (slot-2) lost; its spare was promoted")
        assert (refill.index, refill.node_id, refill.state) == (3, "slot-5", "running"), refill
        promoted = wait_for_event(cfg.run_dir, lambda r: r["event"] == "spare_promoted", timeout=1)
        assert (promoted["node_rank"], promoted["node_id"], promoted["replaced_node_ranks"]) == (2, "slot-3", [1])
        with pytest.raises(InsufficientCapacityError, match="no free healthy slot"):
            backend.add_spare(handle, reason="one more")
        record = backend._store.read_job(handle.job_name)
        assert record["nodes"][3]["standby"] and record["nodes"][3]["added_reason"].startswith("node 1")

        # A spare parked on a slot that is then quarantined is stopped: it never trains.
        assert backend.return_nodes(["slot-4"], reason="test: checked").returned == ["slot-4"]
        doomed = backend.add_spare(handle, reason="a second refill")
        assert (doomed.index, doomed.node_id) == (4, "slot-4")
        assert wait_until(lambda: node_has_ft_launcher(handle.job_name, 4), timeout=60), backend.logs(handle, 4)
        replaced = backend.replace_nodes(["slot-4"], reason="test: bad after all")
        assert replaced.replaced == ["slot-4"] and "node 4 of job" in replaced.reason, replaced
        dropped = backend.status(handle)
        assert dropped.state == "running" and dropped.nodes[4].state == "failed", dropped
        assert dropped.nodes[4].message.startswith("spare dropped before it trained: stopped by quarantine")
        assert not tagged_processes(handle.job_name, 4)

        status = wait_for(backend, handle)
        assert status.state == "succeeded" and status.failure_class == "success", (
            f"{status.message}\n{backend.logs(handle, tail=60)}"
        )
        states = [n.state for n in status.nodes]
        assert states[:3] == ["succeeded", "lost", "succeeded"] and states[4] == "failed", status
        assert "node 1 (slot-2) lost" in status.message
    finally:
        for record in backend._store.jobs():
            backend.cancel(JobHandle("local", record["run_id"], record["launch_id"], record["job_name"]))

    events = read_events(Path(cfg.run_dir) / "events.jsonl")
    # One launch, no relaunch; the refills parked (standby) and never trained.
    assert {r["launch_id"] for r in events if r["event"] == "launch_begin"} == {"1"}
    assert len(backend._store.jobs()) == 1
    standby = {r["node_rank"]: r["standby"] for r in events if r["event"] == "launch_begin"}
    assert standby == {0: False, 1: False, 2: True, 3: True, 4: True}, standby
    trained = {r["node_rank"] for r in events if r["event"] == "train_begin"}
    assert trained == {0, 1, 2}, trained
    assert len([r for r in events if r["event"] == "spare_promoted"]) == 1
    finals = {r["node_rank"]: r["failure_class"] for r in events if r["event"] == "final"}
    assert finals[0] == finals[2] == "success" and 1 not in finals, finals
    print(f"\n[observed] refill node 3 ended {status.nodes[3].state}: {status.nodes[3].message}")
    assert CheckpointCatalog(cfg.run_dir).latest().step == 120
    with pytest.raises(BackendError, match="not running"):
        backend.add_spare(handle, reason="too late")
    assert not backend.diagnose(handle).replaceable


@needs_training
@pytest.mark.slow
def test_two_lost_nodes_with_one_spare_fail_the_job_and_blame_both_slots(backend, tmp_path, dataset):
    """Three training nodes and one spare; nodes 1 and 2 are lost at the same moment. One spare
    cannot cover two: the job fails as a lost node always did, and both slots are blamed.

    The machines die from outside (every process of both nodes at once): two node_loss drills at
    one step cannot do it, since a drill fires once per (kind, step, attempt) in the whole run."""
    cfg = run_config(tmp_path, dataset, "twolost", nodes=3, spare_nodes=1, procs_per_node=1, steps=400)
    handle = backend.submit(cfg, launch_id="1")
    assert handle.extra["node_ids"] == ["slot-0", "slot-1", "slot-2", "slot-3"]
    for rank in range(3):
        wait_for_event(cfg.run_dir, lambda r, rank=rank: r["event"] == "train_begin" and r["rank"] == rank)
    for node in (1, 2):
        for pid in tagged_processes(handle.job_name, node):
            os.kill(pid, signal.SIGKILL)
    status = wait_for(backend, handle, states=("failed", "succeeded"))
    assert status.state == "failed" and status.failure_class == "restarts_exhausted", (
        f"{status.message}\n{backend.logs(handle, tail=40)}"
    )
    assert [n.state for n in status.nodes][1:3] == ["lost", "lost"], status
    assert status.message.startswith("node 1 (slot-1) lost") and "node 2 (slot-2) lost" in status.message
    assert "2 node(s) left to train, the launch needs 3" in status.message
    diagnosis = backend.diagnose(handle)
    assert diagnosis.replaceable and diagnosis.bad_node_ids == ["slot-1", "slot-2"], diagnosis
    backend.cancel(handle)  # what the DAG does next; the verdict stays
    assert backend.diagnose(handle).bad_node_ids == ["slot-1", "slot-2"]
    assert tagged_processes(handle.job_name) == []


def test_a_loss_after_the_spare_was_used_ends_the_launch_in_seconds_and_blames_the_node(backend, tmp_path, dataset):
    """Two training nodes and one spare; node 1 is lost and the spare takes its place; then the
    spare's node is lost too, with nothing left and nothing announced. The survivor ends the launch
    within seconds (waiting_for_nodes, restarts_exhausted), not at the rendezvous' join_timeout,
    and the lost slot is blamed, so the ladder can replace it and relaunch."""
    cfg = run_config(tmp_path, dataset, "usedup", nodes=2, spare_nodes=1, procs_per_node=1, steps=400)
    handle = backend.submit(cfg, launch_id="1")
    for rank in range(2):
        wait_for_event(cfg.run_dir, lambda r, rank=rank: r["event"] == "train_begin" and r["rank"] == rank)
    for pid in tagged_processes(handle.job_name, 1):
        os.kill(pid, signal.SIGKILL)
    promoted = wait_for_event(cfg.run_dir, lambda r: r["event"] == "spare_promoted")
    assert promoted["node_rank"] == 2
    wait_for_event(cfg.run_dir, lambda r: r["event"] == "step" and r["ts"] > promoted["ts"])
    lost_at = time.time()
    for pid in tagged_processes(handle.job_name, 2):
        os.kill(pid, signal.SIGKILL)
    status = wait_for(backend, handle, states=("failed", "succeeded"))
    assert status.state == "failed" and status.failure_class == "restarts_exhausted", (
        f"{status.message}\n{backend.logs(handle, tail=40)}"
    )
    waiting = wait_for_event(cfg.run_dir, lambda r: r["event"] == "waiting_for_nodes")
    assert waiting["missing_node_ranks"] == [2] and waiting["until"] is None
    final = wait_for_event(cfg.run_dir, lambda r: r["event"] == "final" and r.get("node_rank") == 0)
    assert final["failure_class"] == "restarts_exhausted" and final["ts"] - lost_at < 30, (final, lost_at)
    assert "slot-2" in backend.diagnose(handle).bad_node_ids


#: Stands in for fsdp_resilience.training.launch in the spare bookkeeping test (no training): nodes 0 and 1 begin
#: training at once, spares only idle; node N reports success and exits once ``<run_dir>/done-N``
#: exists; with ``<run_dir>/unhealthy-N`` it leaves at once, as a launcher whose ft_launcher a
#: health check turned away (``-said``: and whose final says so, as fsdp_resilience.training.launch's does when
#: it can tell). Arguments as the backend passes them: -m fsdp_resilience.training.launch --config CFG
#: --node-rank N ...
SPARE_STAND_IN = """#!/bin/sh
run_dir=$(dirname "$(dirname "$4")")
rank=$6
if [ -e "$run_dir/unhealthy-$rank" ]; then
  echo "[INFO] [ft_launcher] Storage path health check failed: missing:/mnt/ok/slot$rank"
  printf '{"event": "final", "failure_class": "restarts_exhausted", "exit_code": 75, "launch_id": "%s", "message": "ft_launcher gave up", "node_rank": %s, "ts": %s}\n' "$TRAINING_LAUNCH_ID" "$rank" "$(date +%s)" >> "$run_dir/events.jsonl"
  exit 75
fi
if [ -e "$run_dir/unhealthy-said-$rank" ]; then
  printf '{"event": "final", "failure_class": "unknown", "exit_code": 1, "launch_id": "%s", "message": "spare dropped before it trained: NVRx turned the node away: Storage path health check failed", "node_rank": %s, "ts": %s}\n' "$TRAINING_LAUNCH_ID" "$rank" "$(date +%s)" >> "$run_dir/events.jsonl"
  exit 1
fi
if [ "$rank" -lt 2 ]; then
  printf '{"event": "train_begin", "launch_id": "%s", "node_rank": %s, "rank": %s, "ts": %s}\\n' "$TRAINING_LAUNCH_ID" "$rank" "$rank" "$(date +%s)" >> "$run_dir/events.jsonl"
fi
while [ ! -e "$run_dir/done-$rank" ]; do sleep 0.05; done
printf '{"event": "final", "failure_class": "success", "exit_code": 0, "launch_id": "%s", "message": "stand-in done", "node_rank": %s, "ts": %s}\\n' "$TRAINING_LAUNCH_ID" "$rank" "$(date +%s)" >> "$run_dir/events.jsonl"
"""


def test_dropped_spares_and_a_covered_loss_fail_nothing_and_parked_spares_are_stopped_at_the_end(tmp_path):
    """Bookkeeping only (stand-in launchers): a spare turned away by a health check is dropped,
    with the reason, and fails nothing; a lost node with spares behind it is no failure, so the
    failure policy stops nobody; a spare that trained in its place counts as a training node; and
    once no node trains any more, the spare still parked is stopped, and the job succeeds."""
    backend = script_backend(tmp_path / "spares", SPARE_STAND_IN, slots=6, cancel_grace_s=2, failure_grace_s=1)
    cfg = run_config(
        tmp_path, tmp_path / "no-data", "standin", nodes=2, spare_nodes=4, procs_per_node=1, restart_mode="injob"
    )
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True)
    (run_dir / "unhealthy-4").touch()
    (run_dir / "unhealthy-said-5").touch()
    handle = backend.submit(cfg, launch_id="1")
    try:
        turned_away = wait_until(
            lambda: (s := backend.status(handle)).nodes[4].state == "failed" and s.nodes[5].state == "failed" and s
        )
        assert turned_away and turned_away.state == "running", turned_away
        # Its final blames restarts: the reason comes from its log. Or its final says why.
        assert turned_away.nodes[4].message.startswith("spare dropped before it trained: ft_launcher gave up")
        assert "Storage path health check failed" in turned_away.nodes[4].message
        assert turned_away.nodes[5].message == (
            "spare dropped before it trained: NVRx turned the node away: Storage path health check failed"
        )
        pids = {n["index"]: n["pid"] for n in backend._store.read_job(handle.job_name)["nodes"]}
        os.kill(pids[1], signal.SIGKILL)  # node 1's machine goes
        lost = wait_until(lambda: (s := backend.status(handle)).nodes[1].state == "lost" and s)
        assert lost and lost.state == "running" and "a spare covers it" in lost.message, lost
        time.sleep(3)  # three failure_grace_s: the failure policy would have stopped the others by now
        record = backend._store.read_job(handle.job_name)
        assert [n["stopped_by"] for n in record["nodes"]] == [None] * 6
        assert all(process_alive(pids[i]) for i in (0, 2, 3))

        # Spare 2 takes node 1's place (its worker's train_begin), then both training nodes finish.
        with open(run_dir / "events.jsonl", "a") as f:
            f.write(
                json.dumps({"event": "train_begin", "launch_id": "1", "node_rank": 2, "rank": 1, "ts": time.time()})
                + "\n"
            )
        for i in (0, 2):
            (run_dir / f"done-{i}").touch()
        status = wait_for(backend, handle, timeout=60)
        assert status.state == "succeeded" and status.failure_class == "success", status
        assert [n.state for n in status.nodes] == ["succeeded", "lost", "succeeded", "failed", "failed", "failed"]
        assert status.nodes[3].message.startswith("spare dropped before it trained: stopped by the supervisor")
        assert status.message.startswith("2 of 6 node(s) succeeded") and "node 1 (slot-1) lost" in status.message
        assert backend.diagnose(handle).bad_node_ids == []
    finally:
        backend.cancel(handle)
