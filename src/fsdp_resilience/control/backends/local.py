"""The embedded default backend: training jobs as process groups on this machine.

A "node" is a local slot (``slot-0`` .. ``slot-N``), a job is one ``python -m fsdp_resilience.training.launch``
per node, and FSx is a local folder. Nothing is kept in memory: the state lives in files under
``state_dir``, so any process (an Airflow worker, the triggerer, a test) can ask about a job that
another process submitted and then left::

    <state_dir>/
      .lock                         flock(2) around every read-modify-write of the files below
      slots.json                    per slot: healthy | quarantined, reason, since (a slot returned to
                                    service: who returned it and the quarantine it ended)
      jobs/<job_name>.json          per node: slot, command, log path, pid, pgid, start time,
                                    exit code, standby (a spare) and why it was added; cancel and
                                    failure-policy marks; train_nodes (the launch's cfg.nodes)
      jobs/<job_name>.supervisor.log

Detaching. ``submit`` starts a small *supervisor* process that forks once and exits, and reaps
that exit at once, so the caller keeps no child (a long-lived triggerer collects no zombies). The
forked supervisor, adopted by init, starts the node launchers, each in its own session, and waits
for them, so no launcher is left a zombie either; it records their exit codes and acts like a
Kubernetes Job controller's failure policy: once the job has failed (the rule of ``judge_job``,
which ``status`` applies too), the other nodes get ``failure_grace_s`` to end by themselves and
are then stopped; so are spares still parked once no node trains any more. Every process of a job carries
``FSDP_RESILIENCE_LOCAL_JOB=<job>/<node>`` in its environment (read from /proc; psutil where there
is none), so ``cancel`` also finds what a launcher started in other sessions (ft_launcher,
workers, checkpoint writers), orphans included.

Job state comes from the run contract, not from the supervisor: a node is done when its launcher
wrote its ``final`` event for this launch (``launch_id``). A node whose launcher is gone without
one, and that nobody stopped, is *lost*: the job fails with ``restarts_exhausted`` (the restart
layers went down with the node) and ``diagnose`` blames that slot.

Hot spares (``spare_nodes``): a job runs ``launch_nodes`` launchers, those with index >= ``nodes``
as standbys (``fsdp_resilience.training.launch`` parks them in the rendezvous). One rule, ``job_can_train``, says
whether the job goes on: a lost node with a spare behind it leaves the job running (the spare takes
its place at the next in-job restart). A standby that ends without ever training (its launcher
left the rendezvous, or we stopped it because its slot was quarantined) is a *dropped* spare: it
fails nothing by itself. ``add_spare`` appends a node to a running job's record; the supervisor
starts it at its next poll. ``replace_nodes`` stops a parked spare on a slot it quarantines, so a
bad slot's spare is never promoted.

Each launch's config is written to ``<run_dir>/launches/<launch_id>.json`` and each node logs to
``<run_dir>/logs/<job_name>-node<i>.log``. To debug the supervisor, run
``supervisor_main(["--state-dir", DIR, "--job", NAME, "--foreground"])`` on a submitted job record.
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from fsdp_resilience.training.contract import (
    FailureClass,
    NODE_ID_ENV,
    REPLACEABLE_FAILURES,
    RunConfig,
    RunDir,
    atomic_write_text,
    failure_class_for_exit,
    most_telling_failure,
    what_to_do,
)

from fsdp_resilience.control.backends.base import (
    LOST,
    BackendError,
    Capacity,
    Diagnosis,
    InsufficientCapacityError,
    JobConflictError,
    JobHandle,
    JobNotFoundError,
    JobStatus,
    NodeStatus,
    Replacement,
    ServiceReturn,
    TrainingBackend,
    current_operator,
    job_can_train,
    job_name_for,
    plan_replacement,
    require_reason,
)
from fsdp_resilience.control.backends.evidence import blame_from_events, final_events, trained_nodes, verdict_at_cancel

#: src/fsdp_resilience/control/backends/local.py -> the repository root: where ``make setup`` puts
#: the training venv, and what relative run and dataset dirs are relative to.
REPO_ROOT = Path(__file__).resolve().parents[4]

#: In every process of a local job: ``<job_name>/<node index>``.
JOB_TAG_ENV = "FSDP_RESILIENCE_LOCAL_JOB"
LAUNCH_ID_ENV = "TRAINING_LAUNCH_ID"
TRAINING_PYTHON_ENV = "TRAINING_PYTHON"
SLOT_PREFIX = "slot-"
RECORD_VERSION = 1
#: The supervisor's failure-policy clock; a launcher's exit wakes it at once (where Linux has pidfds).
SUPERVISOR_POLL_S = 0.5
#: How long ``add_spare`` waits for a spare to take a lost node's place before it adds the new
#: spare anyway (measured: ~15 s on NVRx 0.4.1, ~5 s on 0.7, plus the restart; more on a busy host).
PROMOTION_WAIT_S = 120.0
#: Training processes per CPU past which a local run only thrashes (gloo on CPU; tests run 2 per core).
MAX_PROCS_PER_CPU = 4
_HAVE_PROC = Path("/proc/self/stat").exists()


def _spares_note(cfg: RunConfig) -> str:
    return f" ({cfg.nodes} to train + {cfg.spare_nodes} spare(s))" if cfg.spare_nodes else ""


class LocalProcessBackend(TrainingBackend):
    """Training jobs as local process groups, one per node, on ``slots`` local slots.

    Args:
        state_dir: where slots and jobs are recorded; every process using the backend must agree.
        slots: how many nodes this machine offers (``slot-0`` .. ``slot-{slots-1}``).
        training_python: the data plane's interpreter (torch, NVRx); default: env
            ``TRAINING_PYTHON``, else ``<repo>/.venv/bin/python``.
        max_unhealthy_share: ``replace_nodes`` refuses to quarantine more than this share of the
            slots at once (at least one is always allowed).
        repo_root: the launchers' working directory, and what relative ``run_dir``/``dataset_dir``
            in a config are relative to; default: this repository's root.
        cancel_grace_s: how long ``cancel`` waits after SIGTERM before SIGKILL.
        failure_grace_s: after a node fails, how long its peers may take to end by themselves
            before the supervisor stops them (a user error takes its launcher ~20 s).
        start_timeout_s: how long ``submit`` waits for the supervisor to start the launchers.
    """

    name = "local"

    def __init__(self, state_dir: str | os.PathLike, slots: int = 4, training_python: str | None = None,
                 max_unhealthy_share: float = 0.5, repo_root: str | os.PathLike | None = None,
                 cancel_grace_s: float = 20.0, failure_grace_s: float = 30.0, start_timeout_s: float = 60.0):
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots={slots!r} must be a positive integer (the local machine's node count)")
        if not 0 < max_unhealthy_share <= 1:
            raise ValueError(f"max_unhealthy_share={max_unhealthy_share} must be in (0, 1]")
        self.state_dir = Path(state_dir).resolve()
        self.slots = slots
        self.repo_root = Path(repo_root).resolve() if repo_root else REPO_ROOT
        self.training_python = str(training_python or os.environ.get(TRAINING_PYTHON_ENV)
                                   or self.repo_root / ".venv" / "bin" / "python")
        self.max_unhealthy_share = float(max_unhealthy_share)
        self.cancel_grace_s = float(cancel_grace_s)
        self.failure_grace_s = float(failure_grace_s)
        self.start_timeout_s = float(start_timeout_s)
        self._store = _StateStore(self.state_dir)

    def to_config(self) -> dict[str, Any]:
        return {"name": self.name, "state_dir": str(self.state_dir), "slots": self.slots,
                "training_python": self.training_python, "max_unhealthy_share": self.max_unhealthy_share,
                "repo_root": str(self.repo_root), "cancel_grace_s": self.cancel_grace_s,
                "failure_grace_s": self.failure_grace_s, "start_timeout_s": self.start_timeout_s}

    @property
    def slot_ids(self) -> list[str]:
        return [f"{SLOT_PREFIX}{i}" for i in range(self.slots)]

    # -- submit -------------------------------------------------------------------------------
    def submit(self, cfg: RunConfig, launch_id: str, *, airflow_run_id: str | None = None) -> JobHandle:
        if not isinstance(launch_id, str) or not launch_id.strip() or len(launch_id) > 200:
            raise ValueError(f"launch_id={launch_id!r} must be a non-empty string of at most 200 characters")
        cfg = self._absolute(cfg)
        job_name = job_name_for(cfg.run_id, launch_id)
        existing = self._store.read_job(job_name)
        if existing is not None:
            return self._existing(existing, cfg, launch_id)
        self.check_training_environment()
        if cfg.launch_nodes > self.slots:
            raise InsufficientCapacityError(
                f"run {cfg.run_id} needs {cfg.launch_nodes} nodes{_spares_note(cfg)} but this machine has only "
                f"{self.slots} slot(s); lower nodes (or spare_nodes) or start the local backend with slots >= "
                f"{cfg.launch_nodes}")
        self._supersede_failed_launches(cfg.run_id, launch_id)

        with self._store.locked():
            existing = self._store.read_job(job_name)
            if existing is not None:  # a concurrent submit of the same launch won the race
                return self._existing(existing, cfg, launch_id)
            active = [r for r in self._store.jobs() if _job_active(r)]
            for other in active:
                if other["run_id"] == cfg.run_id:
                    raise JobConflictError(
                        f"run {cfg.run_id} already has launch {other['launch_id']!r} active (job "
                        f"{other['job_name']}); two launches would share one run dir. Wait for it to end, "
                        f"or cancel it, before submitting launch {launch_id!r}")
            busy = {n["node_id"] for r in active for n in r["nodes"]}
            quarantined = set(self._store.quarantined())
            free = [s for s in self.slot_ids if s not in quarantined and s not in busy]
            if len(free) < cfg.launch_nodes:
                raise InsufficientCapacityError(
                    f"run {cfg.run_id} needs {cfg.launch_nodes} free healthy slot(s){_spares_note(cfg)}; "
                    f"capacity: {self.slots} slots, "
                    f"{len(quarantined)} quarantined {sorted(quarantined)}, {len(busy)} busy {sorted(busy)}, "
                    f"{len(free)} free. Wait for running jobs to end, or return repaired slots to service")
            record = self._new_record(cfg, launch_id, job_name, free[: cfg.launch_nodes])
            record["airflow_run_id"] = airflow_run_id
            self._store.write_job(record)

        try:
            config_path = Path(record["config_path"])
            config_path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(config_path, cfg.to_json() + "\n")
            cfg.layout.logs.mkdir(parents=True, exist_ok=True)
            self._spawn_supervisor(record)
        except OSError as e:
            error = f"could not start the job: {e}"
            self._store.update_job(job_name, lambda r: r.update(error=error))
            raise BackendError(f"could not start job {job_name}: {e}") from e
        self._wait_started(job_name)
        return self._handle(record)

    def _absolute(self, cfg: RunConfig) -> RunConfig:
        """Paths as the launcher (working directory: the repo root) will read them."""
        run_dir, dataset_dir = (os.path.normpath(self.repo_root / p) for p in (cfg.run_dir, cfg.dataset_dir))
        return cfg if (run_dir, dataset_dir) == (cfg.run_dir, cfg.dataset_dir) else \
            cfg.replace(run_dir=run_dir, dataset_dir=dataset_dir)

    def _existing(self, record: dict[str, Any], cfg: RunConfig, launch_id: str) -> JobHandle:
        if (record["run_id"], record["launch_id"]) != (cfg.run_id, launch_id):
            raise BackendError(f"job name {record['job_name']} is taken by run {record['run_id']!r} launch "
                               f"{record['launch_id']!r}; use another launch_id")
        return self._handle(record)

    def _handle(self, record: dict[str, Any]) -> JobHandle:
        return JobHandle(backend=self.name, run_id=record["run_id"], launch_id=record["launch_id"],
                         job_name=record["job_name"],
                         extra={"state_dir": str(self.state_dir), "run_dir": record["run_dir"],
                                "submitted_at": record["created_at"],
                                "config_path": record["config_path"],
                                "node_ids": [n["node_id"] for n in record["nodes"]]})

    def check_training_environment(self) -> None:
        if not os.access(self.training_python, os.X_OK):
            raise BackendError(f"the local backend needs a training environment, and training_python "
                               f"{self.training_python} is not an executable Python: set {TRAINING_PYTHON_ENV} or "
                               f"run `make setup` (it creates {self.repo_root / '.venv'}). An Airflow deployment "
                               "without one (the images/airflow image) trains on EKS: backend=eks, or "
                               "FSDP_DEFAULT_BACKEND=eks in its environment")

    def check_launch(self, cfg: RunConfig) -> None:
        self.check_training_environment()

    def check_capacity(self, cfg: RunConfig) -> Capacity:
        """Local slots are not replaced: a quarantined one is gone until someone returns it. And
        the processes share this machine's CPUs: past a few per core, a run only thrashes."""
        capacity = super().check_capacity(cfg)
        if cfg.launch_nodes > capacity.healthy:
            raise InsufficientCapacityError(
                f"run {cfg.run_id} needs {cfg.launch_nodes} node(s){_spares_note(cfg)}; "
                f"of {capacity.total} local slots, "
                f"{len(capacity.quarantined)} are quarantined {capacity.quarantined} and {capacity.healthy} healthy. "
                "Lower nodes, or return repaired slots to service (docs/backends.md: \"Quarantined nodes\")")
        max_procs = MAX_PROCS_PER_CPU * (os.cpu_count() or 1)
        if cfg.world_size > max_procs:
            raise InsufficientCapacityError(
                f"run {cfg.run_id} asks for {cfg.world_size} training processes (nodes {cfg.nodes} x procs_per_node "
                f"{cfg.procs_per_node}); this machine has {os.cpu_count()} CPU(s), which run at most {max_procs} "
                "usefully: lower nodes or procs_per_node")
        return capacity

    def _supersede_failed_launches(self, run_id: str, launch_id: str) -> None:
        """A failed launch whose other nodes are still stopping holds slots and the run's rendezvous
        port; a relaunch of the same run finishes stopping it (a Job controller would have)."""
        for record in self._store.jobs():
            if record["run_id"] == run_id and record["launch_id"] != launch_id and _job_active(record):
                handle = self._handle(record)
                if self.status(handle).state == "failed":
                    self.cancel(handle)

    def _new_record(self, cfg: RunConfig, launch_id: str, job_name: str, slots: list[str]) -> dict[str, Any]:
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", launch_id)
        if safe != launch_id:
            safe = f"{safe}-{job_name.rsplit('-', 1)[-1]}"  # keep it unique per launch id
        config_path = cfg.layout.launch_config(safe)
        nodes = [self._node_entry(job_name, launch_id, str(config_path), cfg.run_dir, index, slot,
                                  standby=index >= cfg.nodes)
                 for index, slot in enumerate(slots)]
        return {"version": RECORD_VERSION, "job_name": job_name, "run_id": cfg.run_id, "launch_id": launch_id,
                "run_dir": cfg.run_dir, "config_path": str(config_path), "cwd": str(self.repo_root),
                "train_nodes": cfg.nodes, "node_rank_limit": cfg.node_rank_limit,
                "created_at": time.time(), "stall_timeout_s": cfg.stall_timeout_s,
                "failure_grace_s": self.failure_grace_s,
                "cancel_grace_s": self.cancel_grace_s, "start_timeout_s": self.start_timeout_s,
                "supervisor": {"pid": None, "start_ticks": None,
                               "log_path": str(self._store.job_path(job_name).with_suffix(".supervisor.log"))},
                "cancel": None, "error": None, "nodes": nodes}

    def _node_entry(self, job_name: str, launch_id: str, config_path: str, run_dir: str, index: int, slot: str,
                    standby: bool, added_reason: str | None = None) -> dict[str, Any]:
        """One node of the job record: what the supervisor starts, and what it learns of it."""
        return {
            "index": index, "node_id": slot, "standby": standby, "added_reason": added_reason,
            "command": [self.training_python, "-m", "fsdp_resilience.training.launch", "--config", config_path,
                        "--node-rank", str(index), "--rdzv-host", "127.0.0.1"],
            "env": {LAUNCH_ID_ENV: launch_id, NODE_ID_ENV: slot, "PYTHONUNBUFFERED": "1",
                    JOB_TAG_ENV: f"{job_name}/{index}"},
            "log_path": str(RunDir(run_dir).logs / f"{job_name}-node{index}.log"),
            "pid": None, "pgid": None, "start_ticks": None, "started_at": None,
            "exit_code": None, "ended_at": None, "stopped_by": None, "start_error": None,
        }

    def _spawn_supervisor(self, record: dict[str, Any]) -> None:
        # -c rather than -m: the supervisor imports this module as itself, and the launchers it
        # starts inherit the caller's environment untouched (no PYTHONPATH of ours).
        bootstrap = ("import sys; from fsdp_resilience.control.backends.local import supervisor_main; "
                     "sys.exit(supervisor_main(sys.argv[1:]))")
        with open(record["supervisor"]["log_path"], "ab") as log:
            intermediate = subprocess.Popen(
                [sys.executable, "-c", bootstrap, "--state-dir", str(self.state_dir), "--job", record["job_name"]],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        # It forks the supervisor and exits at once; reaping it here leaves no zombie behind.
        if intermediate.wait(timeout=self.start_timeout_s) != 0:
            raise OSError(f"the supervisor failed to start (exit {intermediate.returncode}); "
                          f"see {record['supervisor']['log_path']}")

    def _wait_started(self, job_name: str) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            record = self._store.read_job(job_name)
            if record["error"]:
                raise BackendError(f"job {job_name} did not start: {record['error']} "
                                   f"(see {record['supervisor']['log_path']})")
            if all(n["pid"] is not None for n in record["nodes"]):
                return
            supervisor = record["supervisor"]
            if supervisor["pid"] is not None and not _alive(supervisor["pid"], supervisor["start_ticks"]):
                raise BackendError(f"job {job_name}: the supervisor died before starting its launchers; "
                                   f"see {supervisor['log_path']}")
            if time.monotonic() > deadline:
                raise BackendError(f"job {job_name}: the supervisor did not start its launchers within "
                                   f"{self.start_timeout_s:.0f}s; see {record['supervisor']['log_path']}. "
                                   "Submitting again with the same launch_id returns this job")
            time.sleep(0.02)

    # -- status -------------------------------------------------------------------------------
    def status(self, handle: JobHandle) -> JobStatus:
        return judge_job(self._store, self._record(handle))

    # -- spares -------------------------------------------------------------------------------
    def add_spare(self, handle: JobHandle, reason: str) -> NodeStatus:
        """Start one more spare for a running job on a free healthy slot (never a quarantined one,
        nor one any active job holds), with the next node index. The job's supervisor starts its
        launcher at its next poll; this waits (up to ``start_timeout_s``) until it has. The
        launcher finds the training nodes training and parks in the rendezvous.

        A spare added while a lost node's place is still being taken would join that very round:
        on NVRx 0.4.1 the nodes parked in the rendezvous join before the survivors, so the new
        spare could take a survivor's place. So this first waits (up to ``PROMOTION_WAIT_S``) until
        the training nodes have recorded their membership after the last loss
        (control/membership.json, written as each attempt starts)."""
        reason = reason.strip() if isinstance(reason, str) else ""
        if not reason:
            raise BackendError("add_spare needs a reason (e.g. 'node 1 (slot-1) lost; its spare was promoted')")
        job_name = handle.job_name
        deadline = time.monotonic() + PROMOTION_WAIT_S
        while True:
            record = self._record(handle)
            status = judge_job(self._store, record)
            if status.state != "running":
                raise BackendError(f"job {job_name} is {status.state}, not running: a spare is added only to a "
                                   f"running job ({status.message})")
            if not _promotion_pending(record, status) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        with self._store.locked():
            record = self._store.read_job(job_name)
            supervisor = record["supervisor"]
            if record["cancel"] or supervisor.get("ended_at") or \
                    not _alive(supervisor["pid"], supervisor["start_ticks"]):
                raise BackendError(f"job {job_name} is ending (cancelled, or its supervisor is gone): no spare added")
            index = len(record["nodes"])
            limit = record.get("node_rank_limit", index)
            if index >= limit:
                raise BackendError(f"job {job_name} has used all {limit} node indices its config allows "
                                   f"(launch_nodes + MAX_SPARE_REFILLS): no more spares can join this launch; "
                                   "let the ladder relaunch it")
            active = [r for r in self._store.jobs() if _job_active(r)]
            busy = {n["node_id"] for r in active for n in r["nodes"]} | {n["node_id"] for n in record["nodes"]}
            quarantined = set(self._store.quarantined())
            free = [s for s in self.slot_ids if s not in quarantined and s not in busy]
            if not free:
                raise InsufficientCapacityError(
                    f"no free healthy slot for a spare of job {job_name}: {self.slots} slots, {len(quarantined)} "
                    f"quarantined {sorted(quarantined)}, {len(busy)} busy {sorted(busy)}. Return repaired slots to "
                    "service, or go on without a spare")
            node = self._node_entry(job_name, record["launch_id"], record["config_path"], record["run_dir"],
                                    index, free[0], standby=True, added_reason=reason)
            record["nodes"].append(node)
            self._store.write_job(record)
        return self._wait_added(job_name, index)

    def _wait_added(self, job_name: str, index: int) -> NodeStatus:
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            record = self._store.read_job(job_name)
            node = record["nodes"][index]
            if node["pid"] is not None or node.get("start_error"):
                break
            supervisor = record["supervisor"]
            if supervisor.get("ended_at") or not _alive(supervisor["pid"], supervisor["start_ticks"]):
                break  # judged below: a node the supervisor never started is a failed one
            if time.monotonic() > deadline:
                raise BackendError(f"job {job_name}: the supervisor did not start spare node {index} within "
                                   f"{self.start_timeout_s:.0f}s; see {supervisor['log_path']}")
            time.sleep(0.05)
        status = judge_job(self._store, record).nodes[index]
        if node["pid"] is None:
            raise BackendError(f"job {job_name}: spare node {index} ({node['node_id']}) was not started: "
                               f"{status.message}")
        return status

    def change_paths(self, handle: JobHandle) -> list[str]:
        """The job record: its supervisor records each launcher's exit there as it reaps it."""
        self._check_handle(handle)
        return [str(self._store.job_path(handle.job_name))]

    def _record(self, handle: JobHandle) -> dict[str, Any]:
        self._check_handle(handle)
        record = self._store.read_job(handle.job_name)
        if record is None:
            raise JobNotFoundError(f"no local job {handle.job_name} under {self.state_dir}; was it submitted "
                                   f"with another state_dir ({handle.extra.get('state_dir')})?")
        return record

    # -- logs ---------------------------------------------------------------------------------
    def logs(self, handle: JobHandle, node: int | None = None, tail: int = 200) -> str:
        record = self._record(handle)
        nodes = record["nodes"]
        if node is not None:
            nodes = [n for n in nodes if n["index"] == node]
            if not nodes:
                raise BackendError(f"job {handle.job_name} has nodes 0..{len(record['nodes']) - 1}, not {node}")
        if len(nodes) == 1 and node is not None:
            return _tail(Path(nodes[0]["log_path"]), tail)
        return "\n".join(f"==> node {n['index']} ({n['node_id']}): {n['log_path']} <==\n"
                         + _tail(Path(n["log_path"]), tail) for n in nodes)

    # -- cancel -------------------------------------------------------------------------------
    def cancel(self, handle: JobHandle) -> None:
        """Stop the job: SIGTERM, SIGKILL after ``cancel_grace_s``; returns when nothing is left.

        A job that already failed keeps its verdict (cancel only stops its leftovers), so
        ``diagnose`` after ``cancel`` still says why it failed. A job stopped while running fails
        with ``no_progress`` if it had not committed a checkpoint for ``stall_timeout_s`` (the
        watch's reason to stop it), else ``unknown``.
        """
        record = self._record(handle)
        if not (_job_active(record) or _tagged_processes(record["job_name"])):
            return
        status = self.status(handle)
        verdict = None if status.done or record["cancel"] else verdict_at_cancel(record["run_dir"], record["created_at"], record["stall_timeout_s"], status.state)
        # Only nodes still going are stopped by us: one that reported, or died by itself, keeps
        # its own story (a lost node stays lost).
        going = {n.index for n in status.nodes if n.state in ("pending", "running")}

        def mark(r: dict[str, Any]) -> None:
            r["cancel"] = r["cancel"] or verdict
            for n in r["nodes"]:
                if n["index"] in going and not n["stopped_by"]:
                    n["stopped_by"] = "cancel"

        record = self._store.update_job(handle.job_name, mark)
        left = stop_job_processes(record, grace_s=self.cancel_grace_s)
        if left:
            raise BackendError(f"job {handle.job_name}: processes {left} survived SIGKILL (stuck in the kernel?); "
                               "check them with ps")

    # -- diagnose -----------------------------------------------------------------------------
    def diagnose(self, handle: JobHandle) -> Diagnosis:
        record = self._record(handle)
        status = self.status(handle)
        failure = status.failure_class
        slots = {n["index"]: n["node_id"] for n in record["nodes"]}
        if status.state != "failed":
            return Diagnosis(failure, [], False, [f"job {handle.job_name} is {status.state}: nothing to diagnose"])
        evidence = [f"status: {status.message}"]
        if failure not in REPLACEABLE_FAILURES:  # a user, storage or data fault; unknown: don't guess
            return Diagnosis(failure, [], False, evidence + [f"{failure}: {what_to_do(failure)}"])
        lost = [n for n in status.nodes if n.state == LOST]
        if lost:
            return Diagnosis(failure, [n.node_id for n in lost], True,
                             evidence + [f"node {n.index} ({n.node_id}): {n.message}" for n in lost])
        bad, why = blame_from_events(record["run_dir"], record["launch_id"], status, list(slots.values()))
        return Diagnosis(failure, bad, bool(bad), evidence + why)

    # -- nodes --------------------------------------------------------------------------------
    def replace_nodes(self, node_ids: list[str], reason: str) -> Replacement:
        """Quarantine slots: no job is placed on them again (the local machine cannot add new
        slots, so capacity drops). A job still training on a quarantined slot is left alone; a
        spare parked on one (a standby that has not trained) is stopped, so that a bad slot's
        spare is never promoted."""
        with self._store.locked():
            slots = self._store.read_slots()
            out = [s for s, info in slots.items() if info.get("state") == "quarantined"]
            replace, refused, note = plan_replacement(list(node_ids), self.slot_ids, out, self.max_unhealthy_share)
            now = time.time()
            for slot in replace:
                slots[slot] = {"state": "quarantined", "reason": reason, "since": now}
            if replace:
                self._store.write_slots(slots)
        healthy = self.slots - len(set(out) | set(replace))
        parts = [f"quarantined {replace}: {reason}; capacity now {healthy} of {self.slots} slot(s) "
                 "(local slots are not replaced by new ones)"] if replace else []
        stopped = self._stop_parked_spares(replace)
        if stopped:
            parts.append(f"stopped the spare(s) parked there, never to be promoted: {', '.join(stopped)}")
        if note:
            parts.append(note)
        return Replacement(replace, refused, "; ".join(parts) or "nothing to replace")

    def _stop_parked_spares(self, slots: list[str]) -> list[str]:
        """Stop every standby on ``slots`` that has not trained, in every active job. One still
        being started is marked, and its supervisor stops it (or never starts it)."""
        stopped = []
        for record in self._store.jobs():
            hosted = [n for n in record["nodes"] if n["node_id"] in slots and n.get("standby")]
            if not hosted or not _job_active(record):
                continue
            trained = trained_nodes(record["run_dir"], record["launch_id"])
            finals = final_events(Path(record["run_dir"]), record["launch_id"])
            parked = [n["index"] for n in hosted if n["index"] not in trained and n["index"] not in finals
                      and n["exit_code"] is None and not n.get("start_error")
                      and (n["pid"] is None or _alive(n["pid"], n["start_ticks"]))]
            if not parked:
                continue
            stop_nodes(self._store, record["job_name"], parked, "quarantine (its slot was taken out of service)")
            stopped += [f"node {i} of job {record['job_name']}" for i in parked]
        return stopped

    def quarantined_nodes(self) -> list[dict[str, Any]]:
        slots = self._store.read_slots()
        out = [{"node_id": s, "reason": slots[s].get("reason", ""), "since": slots[s].get("since")}
               for s in self.slot_ids if slots.get(s, {}).get("state") == "quarantined"]
        return sorted(out, key=lambda q: q["since"] or 0)

    def return_nodes(self, node_ids: list[str], reason: str, *, by: str | None = None,
                     quarantined_before: float | None = None) -> ServiceReturn:
        """Mark quarantined slots healthy again. slots.json keeps why and by whom, and the
        quarantine it ended. A name that is not a slot of this backend is refused before anything
        changes (a typo must not pass for a return)."""
        reason = require_reason(reason)
        wanted = list(dict.fromkeys(node_ids))
        unknown = [n for n in wanted if n not in self.slot_ids]
        if unknown:
            raise BackendError(f"unknown local node(s) {unknown}: this backend's slots are {self.slot_ids} "
                               f"(state dir {self.state_dir}); list the quarantined ones with "
                               "`python -m fsdp_resilience.control.quarantine list`")
        by = by or current_operator()
        with self._store.locked():
            slots = self._store.read_slots()
            now = time.time()
            returned = [s for s in wanted if slots.get(s, {}).get("state") == "quarantined"
                        and (quarantined_before is None or (slots[s].get("since") or 0) <= quarantined_before)]
            for slot in returned:
                old = slots[slot]
                slots[slot] = {"state": "healthy", "reason": f"returned to service: {reason}", "since": now,
                               "returned_by": by, "quarantine_reason": old.get("reason", ""),
                               "quarantined_since": old.get("since")}
            if returned:
                self._store.write_slots(slots)
        not_quarantined = [s for s in wanted if s not in returned]
        return ServiceReturn(returned, not_quarantined, [])

    # -- evaluation ---------------------------------------------------------------------------
    def run_evaluation(self, cfg: RunConfig, checkpoint_id: str | None = None,
                       timeout_s: float = 3600.0) -> dict[str, Any]:
        """``python -m fsdp_resilience.training.evaluate`` in the training venv (this process never imports torch)."""
        cfg = self._absolute(cfg)
        self.check_training_environment()
        command = [self.training_python, "-m", "fsdp_resilience.training.evaluate", "--config", str(cfg.layout.config)]
        if checkpoint_id is not None:
            command += ["--checkpoint", checkpoint_id]
        try:
            out = subprocess.run(command, cwd=self.repo_root, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise BackendError(f"evaluation of run {cfg.run_id} did not finish within {timeout_s:.0f}s") from None
        print(out.stdout + out.stderr, end="")
        if out.returncode != 0:
            raise BackendError(f"evaluation of run {cfg.run_id} failed (exit {out.returncode}): "
                               f"{out.stderr.strip()[-2000:]}")
        return json.loads((Path(cfg.run_dir) / "eval.json").read_text())

    def capacity(self) -> Capacity:
        quarantined = set(self._store.quarantined())
        pool = self.slot_ids
        healthy = [s for s in pool if s not in quarantined]
        return Capacity(total=len(pool), healthy=len(healthy), quarantined=[s for s in pool if s in quarantined],
                        healthy_node_ids=healthy)


# --------------------------------------------------------------------------------------------
# Judging a job from its record and its run dir (status and the supervisor's failure policy)
# --------------------------------------------------------------------------------------------

#: Lines of a dropped spare's log searched for why its launcher left the rendezvous.
_DROP_REASON = re.compile(r"health ?check|unhealthy|exception|error", re.IGNORECASE)


def judge_job(store: "_StateStore", record: dict[str, Any]) -> JobStatus:
    """The job's state from its record, its nodes' liveness and the run's events. One function for
    ``status`` and for the supervisor's failure policy, so that both apply the same rule.

    The job fails when a node that is not a dropped spare failed (a failing ``final`` of a node
    that trained, a training node that could not start), or when it can no longer train
    (``job_can_train``: fewer nodes neither lost nor failed than ``train_nodes``). Without spares
    that is any failed or lost node, as it always was."""
    # Liveness first, then the events: a node seen gone has written any final event it ever will.
    alive = {n["index"]: _alive(n["pid"], n["start_ticks"]) for n in record["nodes"]}
    finals = final_events(Path(record["run_dir"]), record["launch_id"])
    has_standby = any(n.get("standby") for n in record["nodes"])
    trained = trained_nodes(record["run_dir"], record["launch_id"]) if has_standby else set()
    nodes = [_node_status(store, record, n, alive[n["index"]], finals.get(n["index"])) for n in record["nodes"]]
    # A standby that ended without ever training: its launcher left the rendezvous (NVRx's health
    # check at join turned it away, the launch ended), or we stopped it (its slot was quarantined).
    dropped = {n["index"] for n, s in zip(record["nodes"], nodes)
               if n.get("standby") and n["index"] not in trained and s.state == "failed"}
    nodes = [_dropped_spare(s, n) if s.index in dropped else s for n, s in zip(record["nodes"], nodes)]
    return _verdict(record, nodes, dropped)


def _promotion_pending(record: dict[str, Any], status: JobStatus) -> bool:
    """Whether a node that trained was lost after the training nodes last recorded who trains
    (control/membership.json, written by global rank 0 as each attempt starts): a spare is still
    taking its place."""
    lost = [record["nodes"][n.index] for n in status.nodes if n.state == LOST]
    if not lost:
        return False
    trained = trained_nodes(record["run_dir"], record["launch_id"])
    lost_at = [n["ended_at"] or time.time() for n in lost if n["index"] in trained]
    if not lost_at:
        return False  # only spares that never trained were lost: nobody's place is being taken
    try:
        membership = _read_json(RunDir(record["run_dir"]).membership) or {}
    except BackendError:  # torn by a full disk: no record to go by
        membership = {}
    recorded_at = membership.get("ts") if membership.get("launch_id") == record["launch_id"] else None
    return not isinstance(recorded_at, (int, float)) or recorded_at < max(lost_at)


#: How a dropped spare's status message begins (fsdp_resilience.training.launch writes the same in its final).
DROPPED_SPARE = "spare dropped before it trained: "


def _dropped_spare(status: NodeStatus, node: dict[str, Any]) -> NodeStatus:
    reason = status.message
    if reason.startswith(DROPPED_SPARE):
        reason = reason[len(DROPPED_SPARE):]  # its launcher already said why (NVRx's reason)
    elif not node.get("stopped_by"):
        # Not stopped by us: the launcher's log says why it left (NVRx names the failed check).
        lines = [line.strip() for line in _tail(Path(node["log_path"]), 60).splitlines() if _DROP_REASON.search(line)]
        if lines:
            reason += f"; its log: {lines[-1][:300]}"
    return dataclasses.replace(status, message=DROPPED_SPARE + reason)


def _verdict(record: dict[str, Any], nodes: list[NodeStatus], dropped: set[int]) -> JobStatus:
    exit_codes = {n.index: n.exit_code for n in nodes if n.state in ("succeeded", "failed", LOST)}
    failed = [n for n in nodes if n.state in ("failed", LOST)]
    train_nodes = record.get("train_nodes", len(record["nodes"]))
    cancel = record["cancel"]
    if cancel and not all(n.state == "succeeded" or n.index in dropped for n in nodes):
        # Stopped while running: the verdict taken at cancel time, unless a node ended with a
        # more telling one by itself (the launcher beat the SIGTERM).
        failure = most_telling_failure([n.failure_class for n in failed] + [cancel["failure_class"]])
        if failure == cancel["failure_class"]:
            return JobStatus("failed", failure, exit_codes, cancel["message"], nodes)
    fatal = [n for n in failed if n.state == "failed" and n.index not in dropped]
    if fatal or not job_can_train(train_nodes, nodes):
        # A dropped spare explains a failure only when nothing else does.
        blamed = [n for n in failed if n.index not in dropped] or failed
        failure = most_telling_failure([n.failure_class for n in blamed])
        # Name the node that explains the failure: lost before merely failed, then by index.
        first = min(blamed, key=lambda n: (n.failure_class != failure, n.state != LOST, n.index))
        others = [f"node {n.index} ({n.node_id}) {n.state}: {n.failure_class}" for n in failed if n is not first]
        message = f"node {first.index} ({first.node_id}) {first.state}: {first.failure_class}"
        exit_note = f" (exit {first.exit_code})" if first.exit_code is not None else ""
        message += f"{exit_note}: {first.message}"
        if others:
            message += "; also " + "; ".join(others)
        if dropped or len(nodes) > train_nodes:
            left = sum(1 for n in nodes if n.state not in ("failed", LOST))
            message += f" ({left} node(s) left to train, the launch needs {train_nodes})"
        return JobStatus("failed", failure, exit_codes, message, nodes)
    # The job can train: a lost node has a spare behind it, a dropped spare is one fewer.
    notes = [f"node {n.index} ({n.node_id}) lost ({n.message}): a spare covers it (in-job restart, no relaunch)"
             for n in nodes if n.state == LOST]
    notes += [f"node {n.index} ({n.node_id}): {n.message}" for n in nodes if n.index in dropped]
    suffix = "; " + "; ".join(notes) if notes else ""
    counted = [n for n in nodes if n.state != LOST and n.index not in dropped]
    if all(n.state == "succeeded" for n in counted):
        count = f"all {len(nodes)}" if len(counted) == len(nodes) else f"{len(counted)} of {len(nodes)}"
        return JobStatus("succeeded", FailureClass.SUCCESS.value, exit_codes,
                         f"{count} node(s) succeeded: {counted[0].message}{suffix}", nodes)
    running = [n for n in nodes if n.state == "running"]
    if running:
        return JobStatus("running", None, exit_codes,
                         f"{len(running)} of {len(nodes)} node(s) running on {[n.node_id for n in running]}{suffix}",
                         nodes)
    return JobStatus("pending", None, exit_codes, f"waiting for {len(nodes)} node(s) to start{suffix}", nodes)


def _node_status(store: "_StateStore", record: dict[str, Any], node: dict[str, Any], alive: bool,
                 final: dict[str, Any] | None) -> NodeStatus:
    index, slot = node["index"], node["node_id"]
    if final is not None:
        failure = final.get("failure_class")
        state = "succeeded" if failure == FailureClass.SUCCESS.value else "failed"
        message = final.get("message", "")
        if node.get("stopped_by") and state == "failed":
            message = f"stopped by {node['stopped_by']}: {message}"
        return NodeStatus(index, slot, state, failure, final.get("exit_code"), message)
    if node["pid"] is None:
        if record["error"]:
            return NodeStatus(index, slot, "failed", FailureClass.UNKNOWN.value, None, record["error"])
        if node.get("start_error"):
            return NodeStatus(index, slot, "failed", FailureClass.UNKNOWN.value, None, node["start_error"])
        supervisor = record["supervisor"]
        started = supervisor["pid"] is not None
        if (started and not _alive(supervisor["pid"], supervisor["start_ticks"])) or \
                (not started and time.time() - record["created_at"] > 2 * record["start_timeout_s"]):
            return NodeStatus(index, slot, "failed", FailureClass.UNKNOWN.value, None,
                              f"the supervisor ended before starting this node; see {supervisor['log_path']}")
        return NodeStatus(index, slot, "pending", None, None, "starting")
    if alive:
        return NodeStatus(index, slot, "running", None, None, f"launcher pid {node['pid']}")
    rc = node["exit_code"]
    if node["stopped_by"]:  # we stopped it (SIGKILL after the grace period): not a lost node
        return NodeStatus(index, slot, "failed", FailureClass.UNKNOWN.value,
                          rc if rc is not None and rc >= 0 else None,
                          f"stopped by {node['stopped_by']} before it reported (exit {rc})")
    if rc is None:
        # Gone, and no exit code in the record read above. Its supervisor reaps it within a poll
        # and records the code before it ends itself: look again after checking on it. Judging
        # it meanwhile would call a launcher that exited by itself (73: another launcher holds
        # the run; 2: a bad config) a lost node, and replace a healthy machine.
        supervisor = record["supervisor"]
        supervising = _alive(supervisor["pid"], supervisor["start_ticks"])
        rc = ((store.read_job(record["job_name"]) or record)["nodes"][index]).get("exit_code")
        if rc is None and supervising:
            return NodeStatus(index, slot, "running", None, None,
                              f"launcher pid {node['pid']} ended; its exit code is being recorded")
    if rc is not None and rc >= 0:
        # Exited without a final event: rejected before training started (exit 2), or crashed.
        failure = failure_class_for_exit(rc).value
        return NodeStatus(index, slot, "failed", failure, rc,
                          f"the launcher exited {rc} without a final event; see {node['log_path']}")
    how = f"killed by signal {-rc}" if rc is not None else "gone"
    # The restart layers went with the node: to the control plane this is restarts exhausted.
    return NodeStatus(index, slot, LOST, FailureClass.RESTARTS_EXHAUSTED.value, None,
                      f"node lost: launcher pid {node['pid']} {how} without reporting")


# --------------------------------------------------------------------------------------------
# State files
# --------------------------------------------------------------------------------------------


class _StateStore:
    """The backend's files. Writers hold the lock; readers need none (every write is atomic)."""

    def __init__(self, root: Path):
        self.root = root
        self.jobs_dir = root / "jobs"
        self.slots_path = root / "slots.json"

    @contextmanager
    def locked(self) -> Iterator[None]:
        self.jobs_dir.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def job_path(self, job_name: str) -> Path:
        return self.jobs_dir / f"{job_name}.json"

    def read_job(self, job_name: str) -> dict[str, Any] | None:
        return _read_json(self.job_path(job_name))

    def write_job(self, record: dict[str, Any]) -> None:
        self.jobs_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.job_path(record["job_name"]), json.dumps(record, indent=1, sort_keys=True) + "\n")

    def update_job(self, job_name: str, change: Callable[[dict[str, Any]], Any]) -> dict[str, Any]:
        with self.locked():
            record = self.read_job(job_name)
            if record is None:
                raise JobNotFoundError(f"no local job {job_name} under {self.root}")
            change(record)
            self.write_job(record)
            return record

    def jobs(self) -> list[dict[str, Any]]:
        if not self.jobs_dir.is_dir():
            return []
        records = (_read_json(p) for p in sorted(self.jobs_dir.glob("*.json")))
        return [r for r in records if r is not None]

    def read_slots(self) -> dict[str, dict[str, Any]]:
        data = _read_json(self.slots_path) or {}
        return dict(data.get("slots", {}))

    def write_slots(self, slots: dict[str, dict[str, Any]]) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.slots_path, json.dumps({"slots": slots}, indent=1, sort_keys=True) + "\n")

    def quarantined(self) -> list[str]:
        return [s for s, info in self.read_slots().items() if info.get("state") == "quarantined"]


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise BackendError(f"local backend state file {path} is unreadable ({e}); remove it if its job is gone") from e
    return data if isinstance(data, dict) else None


# --------------------------------------------------------------------------------------------
# Processes
# --------------------------------------------------------------------------------------------


def _proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, process group, start time in clock ticks) from /proc, or None if gone."""
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    fields = data[data.rindex(b")") + 2:].split()  # the command name may hold spaces and ')'
    return fields[0].decode(), int(fields[2]), int(fields[19])


def _start_ticks(pid: int) -> int | None:
    stat = _proc_stat(pid) if _HAVE_PROC else None
    return stat[2] if stat else None


def _alive(pid: int | None, start_ticks: int | None = None) -> bool:
    """Whether ``pid`` runs (not a zombie) and is still the process we started (pids are reused)."""
    if pid is None:
        return False
    if _HAVE_PROC:
        stat = _proc_stat(pid)
        if stat is None or stat[0] in ("Z", "X"):
            return False
        return start_ticks is None or stat[2] == start_ticks
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _tagged_processes(job_name: str, node: int | None = None) -> list[int]:
    """Live processes of the job (of one node), found by the tag in their environment."""
    prefix = f"{JOB_TAG_ENV}={job_name}/".encode()
    found = []
    if _HAVE_PROC:
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/environ", "rb") as f:
                    env = f.read()
            except OSError:
                continue
            for var in env.split(b"\0"):
                if var.startswith(prefix) and (node is None or var[len(prefix):] == str(node).encode()):
                    if _alive(int(entry.name)):
                        found.append(int(entry.name))
                    break
        return found
    try:  # macOS and friends: psutil comes with Airflow
        import psutil
    except ImportError:
        return found
    want = f"{job_name}/"
    for proc in psutil.process_iter():
        try:
            tag = proc.environ().get(JOB_TAG_ENV, "")
            if tag.startswith(want) and (node is None or tag == f"{want}{node}") and proc.status() != "zombie":
                found.append(proc.pid)
        except (psutil.Error, OSError):
            continue
    return found


def _signal(pids: list[int], sig: int, groups: list[int] = ()) -> None:
    for pgid in groups:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def stop_job_processes(record: dict[str, Any], grace_s: float, nodes: list[int] | None = None,
                       reap: Callable[[], Any] = lambda: None) -> list[int]:
    """Stop the job's processes (of ``nodes``, default all): SIGTERM to each live launcher's group
    (the launcher passes it on to ft_launcher's session and writes its ``final`` event), and to any
    process whose launcher is already gone; SIGKILL whatever is left after ``grace_s``. Returns the
    pids that survived SIGKILL (none, normally). ``reap`` lets the launchers' parent collect them
    while it waits."""
    job = record["job_name"]
    selected = [n for n in record["nodes"] if nodes is None or n["index"] in nodes]

    def remaining() -> list[int]:
        reap()
        pids: list[int] = []
        for n in selected:
            pids += _tagged_processes(job, n["index"])
        return pids

    def live_launchers() -> list[int]:
        return [n["pid"] for n in selected if _alive(n["pid"], n["start_ticks"])]

    launchers = live_launchers()
    orphans = [p for n in selected if not _alive(n["pid"], n["start_ticks"])
               for p in _tagged_processes(job, n["index"])]
    _signal(orphans, signal.SIGTERM, groups=launchers)
    deadline = time.monotonic() + grace_s
    pause = 0.02  # a launcher that already reported is gone within a few of these; a busy one backs off
    while remaining() and time.monotonic() < deadline:
        time.sleep(pause)
        pause = min(2 * pause, 0.2)
    left = remaining()
    if left:
        _signal(left, signal.SIGKILL, groups=live_launchers())
        deadline = time.monotonic() + 10
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left = remaining()
    return left


def _job_active(record: dict[str, Any]) -> bool:
    """Whether the job may still hold its slots: a launcher runs, or it has not started yet."""
    if record["error"]:
        return False
    for n in record["nodes"]:
        if n["exit_code"] is not None:
            continue
        if n["pid"] is None:
            supervisor = record["supervisor"]
            if supervisor["pid"] is not None:
                if _alive(supervisor["pid"], supervisor["start_ticks"]):
                    return True
            elif time.time() - record["created_at"] < 2 * record["start_timeout_s"]:
                return True
        elif _alive(n["pid"], n["start_ticks"]):
            return True
    return False


def _tail(path: Path, lines: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            block, data = 8192, b""
            while size > 0 and data.count(b"\n") <= lines:
                step = min(block, size)
                size -= step
                f.seek(size)
                data = f.read(step) + data
                block *= 2
    except FileNotFoundError:
        return ""
    return "\n".join(data.decode(errors="replace").splitlines()[-lines:]) if lines > 0 else ""


# --------------------------------------------------------------------------------------------
# The supervisor: parent of one job's launchers
# --------------------------------------------------------------------------------------------


def supervisor_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="local-backend-supervisor",
                                     description="Start and watch the node launchers of one local job "
                                                 "(started by LocalProcessBackend.submit).")
    parser.add_argument("--state-dir", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--foreground", action="store_true", help="do not fork (debugging)")
    args = parser.parse_args(argv)
    if not args.foreground and os.fork() > 0:
        os._exit(0)  # the submitter reaps this parent; the child is adopted by init
    return supervise(Path(args.state_dir), args.job)


def supervise(state_dir: Path, job_name: str) -> int:
    store = _StateStore(state_dir)
    record = store.read_job(job_name)
    if record is None:
        print(f"no job {job_name} under {state_dir}", file=sys.stderr)
        return 1
    me, my_ticks = os.getpid(), _start_ticks(os.getpid())
    record = store.update_job(job_name, lambda r: r["supervisor"].update(pid=me, start_ticks=my_ticks,
                                                                         started_at=time.time()))
    if record["cancel"]:
        store.update_job(job_name, lambda r: r.update(error="cancelled before it started"))
        return 0

    procs: dict[int, subprocess.Popen] = {}
    launched: set[int] = set()  # every node index this supervisor started, or tried to
    exits = _ExitWaiter()

    def launch(node: dict[str, Any]) -> dict[str, Any]:
        launched.add(node["index"])
        with open(node["log_path"], "ab") as log:
            # Own session per launcher: cancel can signal the node as a group, and the
            # launcher's own SIGTERM handling (pod deletion) applies unchanged.
            proc = subprocess.Popen(node["command"], cwd=record["cwd"], env={**os.environ, **node["env"]},
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        procs[node["index"]] = proc
        exits.add(node["index"], proc)
        return {"pid": proc.pid, "pgid": proc.pid, "start_ticks": _start_ticks(proc.pid), "started_at": time.time()}

    def record_started(started: dict[int, dict[str, Any]]) -> Callable[[dict[str, Any]], None]:
        def change(r: dict[str, Any]) -> None:
            for index, fields in started.items():
                r["nodes"][index].update(fields)
        return change

    started: dict[int, dict[str, Any]] = {}
    try:
        for node in record["nodes"]:
            started[node["index"]] = launch(node)
    except OSError as e:
        for proc in procs.values():
            proc.kill()
            proc.wait()
        error = f"could not start a launcher: {e}"
        store.update_job(job_name, lambda r: r.update(error=error))
        print(error, file=sys.stderr)
        return 1

    record = store.update_job(job_name, record_started(started))
    if record["cancel"]:  # cancelled while we were starting: cancel saw no launcher to stop
        stop_job_processes(record, grace_s=record["cancel_grace_s"])
    print(f"supervisor {me}: started {len(procs)} launcher(s): "
          f"{ {i: p.pid for i, p in procs.items()} }", flush=True)

    def reap() -> bool:
        """Record the exit of every launcher that ended; whether any did."""
        any_ended = False
        for index, proc in list(procs.items()):
            rc = proc.poll()
            if rc is None:
                continue
            any_ended = True
            del procs[index]
            exits.forget(index)
            # Whatever the launcher left behind (it reaps its session itself unless it was killed).
            _signal(_tagged_processes(job_name, index), signal.SIGKILL)
            now = time.time()

            def ended(r: dict[str, Any], index: int = index, rc: int = rc) -> None:
                r["nodes"][index].update(exit_code=rc, ended_at=now)

            store.update_job(job_name, ended)
            print(f"supervisor {me}: node {index} exited {rc}", flush=True)
        return any_ended

    def pending(r: dict[str, Any]) -> list[dict[str, Any]]:
        """Nodes add_spare appended that this supervisor has not started yet."""
        return [n for n in r["nodes"] if n["pid"] is None and n["index"] not in launched and not n.get("start_error")]

    def start_added() -> bool:
        """Start the spares ``add_spare`` appended to the record since the last poll; whether any."""
        new = pending(store.read_job(job_name))
        if not new:
            return False
        started: dict[int, dict[str, Any]] = {}
        refused: dict[int, str] = {}
        for node in new:
            if node["stopped_by"]:  # its slot was quarantined, or the job cancelled, before it started
                launched.add(node["index"])
                refused[node["index"]] = f"not started: stopped by {node['stopped_by']} before it started"
                continue
            try:
                started[node["index"]] = launch(node)
            except OSError as e:
                refused[node["index"]] = f"could not start its launcher: {e}"

        def change(r: dict[str, Any]) -> None:
            record_started(started)(r)
            for index, why in refused.items():
                r["nodes"][index]["start_error"] = why

        r = store.update_job(job_name, change)
        print(f"supervisor {me}: added node(s) started { {i: f['pid'] for i, f in started.items()} }"
              + (f", not started {refused}" if refused else ""), flush=True)
        # Marked to stop (quarantine, cancel) between our read and our record: stop them now.
        stop_now = [i for i in started if r["nodes"][i]["stopped_by"] or r["cancel"]]
        if stop_now:
            stop_job_processes(r, grace_s=r["cancel_grace_s"], nodes=stop_now, reap=reap)
        return True

    def finished(r: dict[str, Any]) -> None:
        # Under the lock that add_spare appends under: once this is set, it adds nothing more.
        if not pending(r):
            r["supervisor"]["ended_at"] = time.time()

    failed_at: float | None = None  # when the job could no longer train (the rule of judge_job)
    parked_at: float | None = None  # since when only spares that never trained are left running
    verdict: JobStatus | None = None
    while True:
        exits.wait(SUPERVISOR_POLL_S)
        if reap() | start_added():
            record = store.read_job(job_name)
            verdict = judge_job(store, record)
            now = time.time()
            if verdict.state == "failed":
                failed_at = failed_at or now
            standby = {n["index"] for n in record["nodes"] if n.get("standby")}
            trained = trained_nodes(record["run_dir"], record["launch_id"]) if standby else set()
            going = [n.index for n in verdict.nodes if n.state in ("pending", "running")]
            parked = bool(going) and all(i in standby and i not in trained for i in going)
            parked_at = (parked_at or now) if parked else None
        if not procs:
            record = store.update_job(job_name, finished)
            if record["supervisor"].get("ended_at"):
                break
            continue
        if failed_at is not None and time.time() - failed_at > record["failure_grace_s"]:
            # The Job failure policy: the launch cannot succeed any more (a node that is no mere
            # spare failed, or too few nodes are left to train); stop the others.
            why = f"the failure policy ({verdict.message.split(': ')[0]})"
            stop_nodes(store, job_name, sorted(procs), why, reap)
        elif parked_at is not None and time.time() - parked_at > record["failure_grace_s"]:
            # No node trains any more, and a spare cannot train on its own: the launch is over.
            why = "the supervisor (no node left training; a spare on its own cannot train)"
            stop_nodes(store, job_name, sorted(procs), why, reap)
    print(f"supervisor {me}: all launchers ended", flush=True)
    return 0


def stop_nodes(store: "_StateStore", job_name: str, indices: list[int], why: str,
               reap: Callable[[], Any] = lambda: None) -> None:
    """Mark nodes ``indices`` stopped by ``why`` (a mark set earlier stays), then stop them."""
    print(f"stopping nodes {indices} of {job_name}: {why}", flush=True)

    def mark(r: dict[str, Any]) -> None:
        for i in indices:
            r["nodes"][i]["stopped_by"] = r["nodes"][i]["stopped_by"] or why

    record = store.update_job(job_name, mark)
    stop_job_processes(record, grace_s=record["cancel_grace_s"], nodes=indices, reap=reap)


class _ExitWaiter:
    """Sleeps until a launcher exits or a timeout passes. A launcher's exit is how the job record
    learns of a lost node (no ``final`` event), and the watch reacts to the record: recorded at
    once, not at the next poll. Linux pidfds; elsewhere (or an old kernel) a plain sleep."""

    def __init__(self) -> None:
        self.fds: dict[int, int] = {}
        self.poller = select.poll() if hasattr(os, "pidfd_open") and hasattr(select, "poll") else None

    def add(self, index: int, proc: subprocess.Popen) -> None:
        if self.poller is None:
            return
        try:
            fd = os.pidfd_open(proc.pid)
        except OSError:  # ENOSYS on a kernel without pidfds: plain sleeps from now on
            for known in list(self.fds):
                self.forget(known)
            self.poller = None
            return
        self.fds[index] = fd
        self.poller.register(fd, select.POLLIN)

    def wait(self, timeout_s: float) -> None:
        if self.poller is None or not self.fds:
            time.sleep(timeout_s)
        else:
            self.poller.poll(timeout_s * 1000)

    def forget(self, index: int) -> None:
        fd = self.fds.pop(index, None)
        if fd is not None:
            if self.poller is not None:
                self.poller.unregister(fd)
            os.close(fd)


if __name__ == "__main__":
    sys.exit(supervisor_main())
