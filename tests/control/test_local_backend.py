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

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "plugins"))

from fsdp_resilience.backends import (  # noqa: E402
    BackendError,
    Capacity,
    Diagnosis,
    InsufficientCapacityError,
    JobHandle,
    JobStatus,
    LocalProcessBackend,
    NodeStatus,
    Replacement,
    TrainingBackend,
    get_backend,
    job_name_for,
)
from fsdp_resilience.backends import local as local_backend  # noqa: E402
from conftest import script_backend  # noqa: E402
from fsdp_resilience.backends.base import plan_replacement, replacement_limit  # noqa: E402
from training.contract import CheckpointCatalog, RunConfig, read_events  # noqa: E402

TRAINING_PYTHON = Path(os.environ.get("TRAINING_PYTHON") or REPO / ".venv" / "bin" / "python")
needs_training = pytest.mark.skipif(not TRAINING_PYTHON.exists(),
                                    reason=f"no training venv at {TRAINING_PYTHON}: run `make setup`")

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


def run_config(tmp_path: Path, dataset: Path, run_id: str, **overrides) -> RunConfig:
    fields = dict(FAST, run_id=run_id, run_dir=str(tmp_path / "runs" / run_id), dataset_dir=str(dataset),
                  rdzv_port=free_port())
    fields.update(overrides)
    return RunConfig(**fields)


def wait_for(backend: LocalProcessBackend, handle: JobHandle, states=("succeeded", "failed"),
             timeout: float = WAIT_S) -> JobStatus:
    deadline = time.monotonic() + timeout
    while True:
        status = backend.status(handle)
        if status.state in states:
            return status
        if time.monotonic() > deadline:
            pytest.fail(f"job {handle.job_name} still {status.state} after {timeout}s: {status.message}\n"
                        f"{backend.logs(handle, tail=40)}")
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
    return [pid for pid in local_backend._tagged_processes(job_name)
            if b"training.launch" in Path(f"/proc/{pid}/cmdline").read_bytes()]


def children_of(pid: int) -> list[int]:
    """Processes whose parent is ``pid``, zombies included."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_bytes() if entry.name.isdigit() else b""
        except OSError:
            continue
        if stat and int(stat[stat.rindex(b")") + 2:].split()[1]) == pid:
            found.append(int(entry.name))
    return found


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes in process group ``pgid``."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = local_backend._proc_stat(int(entry.name))
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
# The interface: names, serialisation, registry, the share rule (no processes)
# --------------------------------------------------------------------------------------------


def test_job_names_are_deterministic_dns_labels():
    name = job_name_for("my-run", "manual__2026-11-30T05:15:00+00:00")
    assert name == job_name_for("my-run", "manual__2026-11-30T05:15:00+00:00")
    assert name.startswith("my-run-manual-2026-11-30t05-15-00-00-00-")
    long = job_name_for("r" * 63, "launch-" + "x" * 100)
    for n in (name, long, job_name_for("a", "1"), job_name_for("a-b", "c"), job_name_for("a", "b-c")):
        assert len(n) <= 63 and n[0].isalnum() and n[-1].isalnum()
        assert all(c.islower() or c.isdigit() or c == "-" for c in n)
    # readable parts that coincide still give distinct names
    assert job_name_for("a-b", "c") != job_name_for("a", "b-c")
    assert job_name_for("run", "1") != job_name_for("run", "2")


def test_results_survive_json_for_xcom_and_triggers():
    handle = JobHandle("local", "r", "1", job_name_for("r", "1"), {"state_dir": "/s", "node_ids": ["slot-0"]})
    status = JobStatus("failed", "restarts_exhausted", {0: 75, 1: None}, "node 1 lost",
                       [NodeStatus(0, "slot-0", "failed", "restarts_exhausted", 75, "gave up"),
                        NodeStatus(1, "slot-1", "lost", "restarts_exhausted", None, "node lost")])
    values = [handle, status, Diagnosis("restarts_exhausted", ["slot-1"], True, ["node lost"]),
              Replacement(["slot-1"], [], "quarantined"), Capacity(4, 3, ["slot-1"], ["slot-0", "slot-2", "slot-3"])]
    for value in values:
        again = type(value).from_dict(json.loads(json.dumps(value.to_dict())))
        assert again == value
    assert json.loads(json.dumps(status.to_dict()))["exit_codes"] == {"0": 75, "1": None}
    assert status.done and not JobStatus("running").done


def test_backends_are_built_by_name_and_from_their_config(tmp_path):
    b = get_backend("local", state_dir=str(tmp_path / "state"), slots=3, training_python=str(TRAINING_PYTHON))
    assert isinstance(b, LocalProcessBackend) and b.slots == 3
    config = json.loads(json.dumps(b.to_config()))  # what travels to the triggerer
    for again in (get_backend(**config), TrainingBackend.from_config(config), LocalProcessBackend.from_config(config)):
        assert isinstance(again, LocalProcessBackend) and again.to_config() == b.to_config()
    with pytest.raises(BackendError, match="unknown training backend 'slurm'"):
        get_backend("slurm")
    eks = get_backend("eks", image="registry/fsdp:1", namespace="team-a")  # imported on first use
    assert get_backend(**json.loads(json.dumps(eks.to_config()))).to_config() == eks.to_config()
    with pytest.raises(BackendError, match="belongs to the 'eks' backend"):
        b.status(JobHandle("eks", "r", "1", "r-1"))


def test_the_share_rule():
    assert [replacement_limit(n, 0.2) for n in (1, 4, 5, 10, 64)] == [1, 1, 1, 2, 12]  # at least one
    pool = [f"n{i}" for i in range(10)]
    assert plan_replacement(["n1", "n2"], pool, [], 0.2)[:2] == (["n1", "n2"], [])
    replaced, refused, reason = plan_replacement(["n1", "n2", "n3"], pool, [], 0.2)
    assert replaced == [] and refused == ["n1", "n2", "n3"] and "max_unhealthy_share=0.2 allows 2" in reason
    replaced, refused, reason = plan_replacement(["n1", "zz", "n1", "n0"], pool, ["n0"], 0.2)
    assert replaced == ["n1"] and refused == ["zz"] and "already out of service: ['n0']" in reason


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
    code = ("import sys; sys.path.insert(0, 'plugins'); import fsdp_resilience.backends.local, "
            "fsdp_resilience.backends.base; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


# --------------------------------------------------------------------------------------------
# Real jobs
# --------------------------------------------------------------------------------------------


@needs_training
@pytest.mark.slow
def test_a_run_succeeds_and_submitting_it_again_starts_nothing(backend, tmp_path, dataset):
    cfg = run_config(tmp_path, dataset, "ok", steps=4)
    t0 = time.monotonic()
    handle = backend.submit(cfg, launch_id="1")
    submit_s = time.monotonic() - t0
    assert handle.job_name == job_name_for("ok", "1") and handle.extra["node_ids"] == ["slot-0"]

    # Idempotent: from this backend, or another process's (built from its config), same job.
    again = get_backend(**backend.to_config()).submit(cfg, launch_id="1")
    assert again == handle == backend.submit(cfg, launch_id="1")
    assert len(list((tmp_path / "state" / "jobs").glob("*.json"))) == 1
    assert len(launcher_processes(handle.job_name)) == 1
    assert children_of(os.getpid()) == []  # detached: the caller is nobody's parent, leaves no zombie

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
    assert not until_empty(lambda: local_backend._tagged_processes(handle.job_name))
    print(f"\n[measured] submit latency: {submit_s:.3f}s")


#: Stands in for the training venv's python in the cancel tests: a "launcher" that ignores SIGTERM
#: (so cancel must escalate to SIGKILL) and, like training.launch starting ft_launcher, leaves a
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
        procs = local_backend._tagged_processes(handle.job_name)
        return procs if len(procs) >= 6 else []

    procs = wait_until(all_started)
    assert len(procs) == 6, local_backend._tagged_processes(handle.job_name)
    assert backend.status(handle).state == "running"

    backend.cancel(handle)
    assert local_backend._tagged_processes(handle.job_name) == []
    for node in record["nodes"]:
        assert not until_empty(lambda: group_members(node["pgid"]))
    assert not until_empty(lambda: [p for p in procs if local_backend._alive(p)])
    supervisor = backend._store.read_job(handle.job_name)["supervisor"]
    assert not until_empty(lambda: local_backend._alive(supervisor["pid"], supervisor["start_ticks"]))

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
    for pid in local_backend._tagged_processes(handle.job_name, node=1):
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
    assert local_backend._tagged_processes(handle.job_name) == []
    assert not until_empty(lambda: group_members(record["nodes"][0]["pgid"]))
    assert backend.status(handle).failure_class == "restarts_exhausted"
    assert backend.diagnose(handle).bad_node_ids == ["slot-1"]


@needs_training
@pytest.mark.slow
def test_a_bad_slot_is_diagnosed_replaced_and_the_run_resumes_on_another(backend, tmp_path, dataset):
    # A bad machine: rank 1 is killed at step 5 on every in-job restart while it runs on slot-0
    # (attempt null), so with max_restarts=1 the job runs out of restarts. The drill is bound to the
    # slot, as a hardware fault would be: after the relaunch elsewhere it does not fire.
    cfg = run_config(tmp_path, dataset, "badslot", steps=6, restart_mode="injob", max_restarts=1,
                     faults=[{"kind": "sigkill", "step": 5, "rank": 1, "attempt": None, "node_id": "slot-0"}])
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
    print(f"\n[measured] replace -> relaunch submitted: {relaunch_s:.3f}s; "
          f"replace -> first step of the relaunch: {first_step - t_replace:.1f}s")


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
