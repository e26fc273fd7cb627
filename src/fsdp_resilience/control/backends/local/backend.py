"""``LocalProcessBackend``: the ``TrainingBackend`` of training jobs as process groups on this machine
(the package docstring says how; state.py, verdict.py, processes.py, launching.py, supervisor.py,
slots.py and evaluation.py do it)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

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
    job_name_for,
)
from fsdp_resilience.control.backends.evidence import (
    blamed,
    events_blame,
    health_aware_diagnosis,
    health_check_signals,
    merge_signals,
    verdict_at_cancel,
)
from fsdp_resilience.control.backends.local.evaluation import evaluate_checkpoint
from fsdp_resilience.control.backends.local.launching import spawn_supervisor, wait_added, wait_started
from fsdp_resilience.control.backends.local.processes import (
    job_active,
    process_alive,
    stop_job_processes,
    tagged_processes,
)
from fsdp_resilience.control.backends.local.slots import (
    quarantine_slots,
    quarantined_slots,
    return_slots,
    slot_capacity,
    slot_names,
)
from fsdp_resilience.control.backends.local.state import StateStore, new_job_record, node_entry, tail_lines
from fsdp_resilience.control.backends.local.verdict import judge_job, promotion_pending
from fsdp_resilience.training.contract import RunConfig, atomic_write_text

#: src/fsdp_resilience/control/backends/local/backend.py -> the repository root: where ``make setup`` puts
#: the training venv, and what relative run and dataset dirs are relative to.
REPO_ROOT = Path(__file__).resolve().parents[5]

TRAINING_PYTHON_ENV = "TRAINING_PYTHON"
#: How long ``add_spare`` waits for a spare to take a lost node's place before it adds the new
#: spare anyway (measured: ~15 s on NVRx 0.4.1, ~5 s on 0.7, plus the restart; more on a busy host).
PROMOTION_WAIT_S = 120.0
#: Training processes per CPU past which a local run only thrashes (gloo on CPU; tests run 2 per core).
MAX_PROCS_PER_CPU = 4


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

    def __init__(
        self,
        state_dir: str | os.PathLike,
        slots: int = 4,
        training_python: str | None = None,
        max_unhealthy_share: float = 0.5,
        repo_root: str | os.PathLike | None = None,
        cancel_grace_s: float = 20.0,
        failure_grace_s: float = 30.0,
        start_timeout_s: float = 60.0,
    ):
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots={slots!r} must be a positive integer (the local machine's node count)")
        if not 0 < max_unhealthy_share <= 1:
            raise ValueError(f"max_unhealthy_share={max_unhealthy_share} must be in (0, 1]")
        self.state_dir = Path(state_dir).resolve()
        self.slots = slots
        self.repo_root = Path(repo_root).resolve() if repo_root else REPO_ROOT
        self.training_python = str(
            training_python or os.environ.get(TRAINING_PYTHON_ENV) or self.repo_root / ".venv" / "bin" / "python"
        )
        self.max_unhealthy_share = float(max_unhealthy_share)
        self.cancel_grace_s = float(cancel_grace_s)
        self.failure_grace_s = float(failure_grace_s)
        self.start_timeout_s = float(start_timeout_s)
        self._store = StateStore(self.state_dir)

    def to_config(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "state_dir": str(self.state_dir),
            "slots": self.slots,
            "training_python": self.training_python,
            "max_unhealthy_share": self.max_unhealthy_share,
            "repo_root": str(self.repo_root),
            "cancel_grace_s": self.cancel_grace_s,
            "failure_grace_s": self.failure_grace_s,
            "start_timeout_s": self.start_timeout_s,
        }

    @property
    def slot_ids(self) -> list[str]:
        return slot_names(self.slots)

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
                f"{cfg.launch_nodes}"
            )
        self._supersede_failed_launches(cfg.run_id, launch_id)

        with self._store.locked():
            existing = self._store.read_job(job_name)
            if existing is not None:  # a concurrent submit of the same launch won the race
                return self._existing(existing, cfg, launch_id)
            active = [r for r in self._store.jobs() if job_active(r)]
            for other in active:
                if other["run_id"] == cfg.run_id:
                    raise JobConflictError(
                        f"run {cfg.run_id} already has launch {other['launch_id']!r} active (job "
                        f"{other['job_name']}); two launches would share one run dir. Wait for it to end, "
                        f"or cancel it, before submitting launch {launch_id!r}"
                    )
            busy = {n["node_id"] for r in active for n in r["nodes"]}
            quarantined = set(self._store.quarantined())
            free = [s for s in self.slot_ids if s not in quarantined and s not in busy]
            if len(free) < cfg.launch_nodes:
                raise InsufficientCapacityError(
                    f"run {cfg.run_id} needs {cfg.launch_nodes} free healthy slot(s){_spares_note(cfg)}; "
                    f"capacity: {self.slots} slots, "
                    f"{len(quarantined)} quarantined {sorted(quarantined)}, {len(busy)} busy {sorted(busy)}, "
                    f"{len(free)} free. Wait for running jobs to end, or return repaired slots to service"
                )
            record = new_job_record(
                self._store,
                cfg,
                launch_id,
                job_name,
                free[: cfg.launch_nodes],
                self.training_python,
                cwd=self.repo_root,
                failure_grace_s=self.failure_grace_s,
                cancel_grace_s=self.cancel_grace_s,
                start_timeout_s=self.start_timeout_s,
            )
            record["airflow_run_id"] = airflow_run_id
            self._store.write_job(record)

        try:
            config_path = Path(record["config_path"])
            config_path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(config_path, cfg.to_json() + "\n")
            cfg.layout.logs.mkdir(parents=True, exist_ok=True)
            spawn_supervisor(record, self.state_dir, self.start_timeout_s)
        except OSError as e:
            error = f"could not start the job: {e}"
            self._store.update_job(job_name, lambda r: r.update(error=error))
            raise BackendError(f"could not start job {job_name}: {e}") from e
        wait_started(self._store, job_name, self.start_timeout_s)
        return self._handle(record)

    def _absolute(self, cfg: RunConfig) -> RunConfig:
        """Paths as the launcher (working directory: the repo root) will read them."""
        run_dir, dataset_dir = (os.path.normpath(self.repo_root / p) for p in (cfg.run_dir, cfg.dataset_dir))
        return (
            cfg
            if (run_dir, dataset_dir) == (cfg.run_dir, cfg.dataset_dir)
            else cfg.replace(run_dir=run_dir, dataset_dir=dataset_dir)
        )

    def _existing(self, record: dict[str, Any], cfg: RunConfig, launch_id: str) -> JobHandle:
        if (record["run_id"], record["launch_id"]) != (cfg.run_id, launch_id):
            raise BackendError(
                f"job name {record['job_name']} is taken by run {record['run_id']!r} launch "
                f"{record['launch_id']!r}; use another launch_id"
            )
        return self._handle(record)

    def _handle(self, record: dict[str, Any]) -> JobHandle:
        return JobHandle(
            backend=self.name,
            run_id=record["run_id"],
            launch_id=record["launch_id"],
            job_name=record["job_name"],
            extra={
                "state_dir": str(self.state_dir),
                "run_dir": record["run_dir"],
                "submitted_at": record["created_at"],
                "config_path": record["config_path"],
                "node_ids": [n["node_id"] for n in record["nodes"]],
            },
        )

    def check_training_environment(self) -> None:
        if not os.access(self.training_python, os.X_OK):
            raise BackendError(
                f"the local backend needs a training environment, and training_python "
                f"{self.training_python} is not an executable Python: set {TRAINING_PYTHON_ENV} or "
                f"run `make setup` (it creates {self.repo_root / '.venv'}). An Airflow deployment "
                "without one (the images/airflow image) trains on EKS: backend=eks, or "
                "FSDP_DEFAULT_BACKEND=eks in its environment"
            )

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
                'Lower nodes, or return repaired slots to service (docs/backends.md: "Quarantined nodes")'
            )
        max_procs = MAX_PROCS_PER_CPU * (os.cpu_count() or 1)
        if cfg.world_size > max_procs:
            raise InsufficientCapacityError(
                f"run {cfg.run_id} asks for {cfg.world_size} training processes (nodes {cfg.nodes} x procs_per_node "
                f"{cfg.procs_per_node}); this machine has {os.cpu_count()} CPU(s), which run at most {max_procs} "
                "usefully: lower nodes or procs_per_node"
            )
        return capacity

    def _supersede_failed_launches(self, run_id: str, launch_id: str) -> None:
        """A failed launch whose other nodes are still stopping holds slots and the run's rendezvous
        port; a relaunch of the same run finishes stopping it (a Job controller would have)."""
        for record in self._store.jobs():
            if record["run_id"] == run_id and record["launch_id"] != launch_id and job_active(record):
                handle = self._handle(record)
                if self.status(handle).state == "failed":
                    self.cancel(handle)

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
                raise BackendError(
                    f"job {job_name} is {status.state}, not running: a spare is added only to a "
                    f"running job ({status.message})"
                )
            if not promotion_pending(record, status) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        with self._store.locked():
            record = self._store.read_job(job_name)
            supervisor = record["supervisor"]
            if (
                record["cancel"]
                or supervisor.get("ended_at")
                or not process_alive(supervisor["pid"], supervisor["start_ticks"])
            ):
                raise BackendError(f"job {job_name} is ending (cancelled, or its supervisor is gone): no spare added")
            index = len(record["nodes"])
            limit = record.get("node_rank_limit", index)
            if index >= limit:
                raise BackendError(
                    f"job {job_name} has used all {limit} node indices its config allows "
                    f"(launch_nodes + MAX_SPARE_REFILLS): no more spares can join this launch; "
                    "let the ladder relaunch it"
                )
            active = [r for r in self._store.jobs() if job_active(r)]
            busy = {n["node_id"] for r in active for n in r["nodes"]} | {n["node_id"] for n in record["nodes"]}
            quarantined = set(self._store.quarantined())
            free = [s for s in self.slot_ids if s not in quarantined and s not in busy]
            if not free:
                raise InsufficientCapacityError(
                    f"no free healthy slot for a spare of job {job_name}: {self.slots} slots, {len(quarantined)} "
                    f"quarantined {sorted(quarantined)}, {len(busy)} busy {sorted(busy)}. Return repaired slots to "
                    "service, or go on without a spare"
                )
            node = node_entry(
                self.training_python,
                job_name,
                record["launch_id"],
                record["config_path"],
                record["run_dir"],
                index,
                free[0],
                standby=True,
                added_reason=reason,
            )
            record["nodes"].append(node)
            self._store.write_job(record)
        return wait_added(self._store, job_name, index, self.start_timeout_s)

    def change_paths(self, handle: JobHandle) -> list[str]:
        """The job record: its supervisor records each launcher's exit there as it reaps it."""
        self._check_handle(handle)
        return [str(self._store.job_path(handle.job_name))]

    def _record(self, handle: JobHandle) -> dict[str, Any]:
        self._check_handle(handle)
        record = self._store.read_job(handle.job_name)
        if record is None:
            raise JobNotFoundError(
                f"no local job {handle.job_name} under {self.state_dir}; was it submitted "
                f"with another state_dir ({handle.extra.get('state_dir')})?"
            )
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
            return tail_lines(Path(nodes[0]["log_path"]), tail)
        return "\n".join(
            f"==> node {n['index']} ({n['node_id']}): {n['log_path']} <==\n" + tail_lines(Path(n["log_path"]), tail)
            for n in nodes
        )

    # -- cancel -------------------------------------------------------------------------------
    def cancel(self, handle: JobHandle) -> None:
        """Stop the job: SIGTERM, SIGKILL after ``cancel_grace_s``; returns when nothing is left.

        A job that already failed keeps its verdict (cancel only stops its leftovers), so
        ``diagnose`` after ``cancel`` still says why it failed. A job stopped while running fails
        with ``no_progress`` if it had not committed a checkpoint for ``stall_timeout_s`` (the
        watch's reason to stop it), else ``unknown``.
        """
        record = self._record(handle)
        if not (job_active(record) or tagged_processes(record["job_name"])):
            return
        status = self.status(handle)
        verdict = (
            None
            if status.done or record["cancel"]
            else verdict_at_cancel(record["run_dir"], record["created_at"], record["stall_timeout_s"], status.state)
        )
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
            raise BackendError(
                f"job {handle.job_name}: processes {left} survived SIGKILL (stuck in the kernel?); check them with ps"
            )

    # -- diagnose -----------------------------------------------------------------------------
    def diagnose(self, handle: JobHandle) -> Diagnosis:
        """The shared rule (``evidence.health_aware_diagnosis``). A slot's own health signals are
        NVRx's failed health checks on it in this launch's events (a slot has no node conditions);
        a lost launcher blames its slot for a failure a relaunch can help."""
        record = self._record(handle)
        status = self.status(handle)
        failure = status.failure_class
        slots = sorted({n["node_id"] for n in record["nodes"]})
        if status.state != "failed":
            return Diagnosis(failure, [], False, [f"job {handle.job_name} is {status.state}: nothing to diagnose"])
        evidence = [f"status: {status.message}"]
        health = health_check_signals(record["run_dir"], record["launch_id"], slots)

        def blame_replaceable() -> Diagnosis:
            lost = {
                n.node_id: [f"node {n.index}'s launcher lost: {n.message}"] for n in status.nodes if n.state == LOST
            }
            if lost or health:
                return blamed(failure, merge_signals(health, lost), evidence)
            bad, why, signals = events_blame(record["run_dir"], record["launch_id"], status, slots)
            return Diagnosis(failure, bad, bool(bad), evidence + why, signals)

        return health_aware_diagnosis(failure, health, evidence, blame_replaceable)

    # -- nodes --------------------------------------------------------------------------------
    def replace_nodes(self, node_ids: list[str], reason: str) -> Replacement:
        """Quarantine slots: no job is placed on them again (the local machine cannot add new
        slots, so capacity drops). A job still training on a quarantined slot is left alone; a
        spare parked on one (a standby that has not trained) is stopped, so that a bad slot's
        spare is never promoted."""
        return quarantine_slots(self._store, self.slot_ids, node_ids, reason, self.max_unhealthy_share)

    def quarantined_nodes(self) -> list[dict[str, Any]]:
        return quarantined_slots(self._store, self.slot_ids)

    def return_nodes(
        self, node_ids: list[str], reason: str, *, by: str | None = None, quarantined_before: float | None = None
    ) -> ServiceReturn:
        """Mark quarantined slots healthy again. slots.json keeps why and by whom, and the
        quarantine it ended. A name that is not a slot of this backend is refused before anything
        changes (a typo must not pass for a return)."""
        return return_slots(
            self._store,
            self.slot_ids,
            self.state_dir,
            node_ids,
            reason,
            by=by,
            quarantined_before=quarantined_before,
        )

    # -- evaluation ---------------------------------------------------------------------------
    def run_evaluation(
        self, cfg: RunConfig, checkpoint_id: str | None = None, timeout_s: float = 3600.0
    ) -> dict[str, Any]:
        """``python -m fsdp_resilience.training.evaluate`` in the training venv (this process never imports torch)."""
        cfg = self._absolute(cfg)
        self.check_training_environment()
        return evaluate_checkpoint(self.training_python, self.repo_root, cfg, checkpoint_id, timeout_s)

    def capacity(self) -> Capacity:
        return slot_capacity(self._store, self.slot_ids)
