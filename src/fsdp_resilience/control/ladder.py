"""The control plane's half of a training run: build the run config from the DAG's params, launch,
and climb the escalation ladder. The DAG's tasks are thin wrappers over these functions, which
need no Airflow and are tested on their own.

The ladder: in-process and in-job restarts happen inside the job. When a launch ends with a
retryable failure (restarts exhausted, a lost node, no progress), the control plane diagnoses
which node(s) failed, has the backend replace them, waits for capacity, and relaunches from the
newest committed checkpoint — at most ``max_node_replacements`` times. A user error, a full or
read-only run dir, training state that keeps turning NaN/inf, or an unknown failure climbs only
when the backend's diagnosis blames a node by that node's own health signals (a monitoring-agent
condition False, Ready not True, the node gone, a failed NVRx health check in this launch: what a
failing GPU, NIC or disk looks like from the code above it; ``decide_escalation``); the rung's
reason names the node and the signal, and the stop marker the failure left
(``control/STOP.json``) is moved aside, kept, so the relaunch may start. On nodes healthy by every
signal they never replace a node and are never relaunched: the failure message says what to do.
A run another launcher is already training, or a launcher that started after its launch ended,
never climbs.

With hot spares (``spare_nodes``), a lost node does not end the launch: a spare takes its place
at the next in-job restart, and the control plane keeps the pool whole behind it while training
goes on (``spare_refill.keep_spare_pool``): it takes the lost node out of service and adds a new
spare. Each such refill spends one of ``max_node_replacements``, like a rung; the rungs are needed
only once no spare is left.

After a successful run the control plane evaluates, exports and publishes only a checkpoint that
verifies (``trusted_checkpoint``): the newest committed one whose files match their checksums.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from pathlib import Path
from typing import Any

from fsdp_resilience.control import settings
from fsdp_resilience.control.backends import BackendError, Diagnosis, InsufficientCapacityError, JobHandle, get_backend
from fsdp_resilience.control.backends.evidence import HEALTH_EXPLAINED_FAILURES
from fsdp_resilience.control.task_data import Launch, Outcome, Run
from fsdp_resilience.control.trusted_checkpoint import CheckpointChoice, choose_checkpoint
from fsdp_resilience.training.contract import (
    REPLACEABLE_FAILURES,
    STOP_CLASSES,
    ConfigError,
    Event,
    EventLog,
    FailureClass,
    RunConfig,
    clear_stop,
    read_stop,
    what_to_do,
)

#: The graph holds this many escalation rungs; the max_node_replacements param picks how many run.
MAX_RUNGS = 3

#: Run config fields the DAG's form sets directly; the rest can come through ``run_config``.
FORM_FIELDS = (
    "model",
    "nodes",
    "spare_nodes",
    "procs_per_node",
    "steps",
    "checkpoint_interval",
    "restart_mode",
    "max_restarts",
    "stall_timeout_s",
)

#: Run config fields only the control plane sets: where the run reads and writes (under the
#: configured roots), what it is called, and its rendezvous port. ``run_config`` may not set them:
#: whoever can trigger the DAG must not pick a path on the workers' or the pods' disks.
PLACEMENT_FIELDS = ("run_id", "run_dir", "dataset_dir", "rdzv_port")

#: A dataset or run name: one folder under its root, never a path.
NAME_PATTERN = r"^[a-z0-9][-a-z0-9_.]{0,62}$"


class EscalationError(RuntimeError):
    """The ladder cannot go on: the message says why and what the user can do."""


def run_id_for(dag_run_id: str, run_name: str | None) -> str:
    """A stable, DNS-1123-safe run id: the user's name, else one derived from the DAG run, so a
    retried task (or a re-run of the DAG run) maps to the same run dir and the same job."""
    if run_name:
        return run_name
    slug = re.sub(r"[^a-z0-9]+", "-", dag_run_id.lower()).strip("-")[:40].strip("-")
    digest = hashlib.sha1(dag_run_id.encode()).hexdigest()[:8]
    return f"{slug}-{digest}" if slug else f"run-{digest}"


def rdzv_port_for(run_id: str) -> int:
    """A rendezvous port per run, so concurrent local runs do not collide."""
    return 20000 + int(hashlib.sha1(run_id.encode()).hexdigest(), 16) % 20000


def build_run_config(params: dict[str, Any], dag_run_id: str) -> Run:
    """The validated run config and where it runs, or ``ConfigError`` naming the bad field: paths
    resolve under the configured roots, the backend accepts the launch (image, training
    environment) and its pool can hold it. Nothing is started."""
    run_id = run_id_for(dag_run_id, params.get("run_name"))
    overrides = params.get("run_config") or {}
    if not isinstance(overrides, dict):
        raise ConfigError(f"run_config must be a JSON object of run config fields, got {overrides!r}")
    placed = sorted(set(overrides) & set(PLACEMENT_FIELDS))
    if placed:
        raise ConfigError(
            f"run_config may not set {', '.join(placed)}: the control plane places every run under "
            f"FSDP_RUNS_ROOT and FSDP_DATA_ROOT. Name the run with run_name and the dataset with dataset"
        )
    dataset = params.get("dataset")
    if not isinstance(dataset, str) or not re.match(NAME_PATTERN, dataset):
        raise ConfigError(
            f"dataset={dataset!r} must be the name of a staged dataset (a folder under the data "
            f"root: lowercase letters, digits, '-', '_', '.'), not a path"
        )
    fields = {name: params[name] for name in FORM_FIELDS if params.get(name) is not None}
    fields.update(overrides)
    if params.get("fault_drill"):  # the form's one drill, after any run_config lists
        fields["faults"] = [*(fields.get("faults") or []), params["fault_drill"]]
    cfg = RunConfig.from_dict(
        {
            "run_id": run_id,
            "run_dir": str(settings.runs_root() / run_id),
            "dataset_dir": str(settings.data_root() / dataset),
            "rdzv_port": rdzv_port_for(run_id),
            **fields,
        }
    )
    try:  # the folders as the launchers will open them: a symlink placed under a root is followed
        cfg = cfg.replace(
            run_dir=str(settings.under_root(settings.runs_root(), run_id, what="run")),
            dataset_dir=str(settings.under_root(settings.data_root(), dataset, what="dataset")),
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None
    max_replacements = int(params.get("max_node_replacements", 1))
    if not 0 <= max_replacements <= MAX_RUNGS:
        raise EscalationError(f"max_node_replacements={max_replacements} must be between 0 and {MAX_RUNGS}")
    try:
        name = settings.backend_name(params.get("backend"))
        namespace = params.get("namespace")
        if namespace and name == "eks" and namespace not in settings.allowed_namespaces():
            raise ValueError(
                f"namespace {namespace!r} is not one this deployment trains in "
                f"({', '.join(settings.allowed_namespaces())}): leave it empty, or have an administrator "
                "apply the kit there and add it to FSDP_EKS_NAMESPACES"
            )
        backend = settings.backend_config(
            name, **{k: params[k] for k in ("image", "namespace") if params.get(k) and name == "eks"}
        )
    except ValueError as e:  # FSDP_* settings that do not parse
        raise ConfigError(f"backend settings: {e}") from None
    check_backend(backend, cfg)
    return Run(config=cfg.to_dict(), backend=backend, max_node_replacements=max_replacements, airflow_run_id=dag_run_id)


def check_backend(backend: dict[str, Any], cfg: RunConfig) -> None:
    """What submit would refuse, refused now (``ConfigError``), before anything starts: the
    backend's own checks (the local training environment; on EKS the image allowlist, pod settings,
    paths outside the FSx mount, more processes than GPUs per pod), then whether its pool can ever
    hold the run. A pool that cannot be asked (an API error) raises BackendError, and the task's
    retry asks again."""
    instance = get_backend(**backend)
    try:
        instance.check_launch(cfg)
    except BackendError as e:
        raise ConfigError(str(e)) from None
    try:
        capacity = instance.check_capacity(cfg)
    except InsufficientCapacityError as e:
        raise ConfigError(f"capacity: {e}") from None
    # A launch starts a launcher on a node of its own for every training node and every spare:
    # the pool must hold them all, whatever node count a backend's own check looks at.
    if capacity is not None and not capacity.provisions_on_demand and cfg.launch_nodes > capacity.total:
        raise ConfigError(
            f"capacity: run {cfg.run_id} starts {cfg.launch_nodes} node launchers (nodes {cfg.nodes} + "
            f"spare_nodes {cfg.spare_nodes}), one node each, but the {instance.name} backend's pool has "
            f"{capacity.total}: lower spare_nodes or nodes, or grow the pool"
        )


def launch(run: Run, launch_no: int) -> Launch:
    """Submit launch ``launch_no`` of the run (idempotent: the same launch is never started twice)
    and return what the sensor needs to watch it."""
    cfg = RunConfig.from_dict(run.config)
    backend = get_backend(**run.backend)
    handle = backend.submit(cfg, launch_id=str(launch_no), airflow_run_id=run.airflow_run_id)
    return Launch(
        backend=run.backend,
        handle=handle.to_dict(),
        run_dir=cfg.run_dir,
        final_step=cfg.steps,
        stall_timeout_s=cfg.stall_timeout_s,
        launched_at=float(handle.extra.get("submitted_at", time.time())),
        checkpoints_s3=settings.checkpoints_s3_uri(cfg.run_dir),
        aws_conn_id=settings.aws_conn_id(),
    )


def next_launch_no(outcome: Outcome) -> int:
    """Launches are numbered 0, 1, 2...: the launch after the one ``outcome`` watched."""
    return int(outcome.launch_id) + 1


def latest_outcome(outcomes: list[Outcome | None]) -> Outcome:
    """The outcome of the newest launch that was watched."""
    seen = [o for o in outcomes if o]
    if not seen:
        raise EscalationError("no launch was watched: see the launch and watch tasks' logs")
    return seen[-1]


#: Failure classes outside ``REPLACEABLE_FAILURES`` that climb when a node is unhealthy by its own
#: signals: those a failing machine can cause (``HEALTH_EXPLAINED_FAILURES``). Never
#: ``already_running`` or ``launch_ended``: the launcher did nothing.
HEALTH_CLIMBING_FAILURES = (
    HEALTH_EXPLAINED_FAILURES
    - REPLACEABLE_FAILURES
    - {
        FailureClass.ALREADY_RUNNING.value,
        FailureClass.LAUNCH_ENDED.value,
    }
)


def health_blame(failure: str | None, diagnosis: Diagnosis | None) -> str:
    """The nodes ``diagnosis`` blames for ``failure`` (a class outside ``REPLACEABLE_FAILURES``)
    by their own health signals, with those signals, for the rung's reason; "" when it blames none
    that way. For such a class a backend blames only nodes unhealthy by their own signals
    (``evidence.health_aware_diagnosis``), never by exit codes; a node without a signal on record
    is not taken."""
    if (
        failure not in HEALTH_CLIMBING_FAILURES
        or diagnosis is None
        or diagnosis.failure_class != failure
        or not diagnosis.replaceable
        or not diagnosis.bad_node_ids
        or not all(diagnosis.signals.get(n) for n in diagnosis.bad_node_ids)
    ):
        return ""
    return "; ".join(f"{n}: {'; '.join(diagnosis.signals[n])}" for n in diagnosis.bad_node_ids)


def should_escalate(
    outcome: Outcome, rung: int, max_replacements: int, diagnosis: Diagnosis | None = None
) -> tuple[bool, str]:
    """Whether rung ``rung`` (1-based) climbs, and why (not). A class outside
    ``REPLACEABLE_FAILURES`` climbs only when ``diagnosis`` (the backend's, of this launch) blames
    a node by its own health signals (``health_blame``)."""
    failure = outcome.failure_class
    if outcome.outcome == "success":
        return False, "the launch succeeded"
    blame = "" if failure in REPLACEABLE_FAILURES else health_blame(failure, diagnosis)
    if failure not in REPLACEABLE_FAILURES and not blame:
        return False, f"failure class {failure} is never retried and replaces no node: {what_to_do(failure)}"
    if rung > max_replacements:
        return False, f"max_node_replacements={max_replacements} spent"
    if blame:
        return True, (
            f"{failure} on node(s) unhealthy by their own health signals, which are blamed instead of the "
            f"code or the data: {blame}"
        )
    return True, f"{failure}: {outcome.message}"


def decide_escalation(run: Run, outcome: Outcome, rung: int) -> tuple[bool, str]:
    """``should_escalate``, with the backend's diagnosis of the launch when only a node's own
    health could make it climb (a class in ``HEALTH_CLIMBING_FAILURES``). Asked even with no rung
    left, so that the reason says the budget is spent rather than blame the code."""
    diagnosis = None
    if outcome.outcome != "success" and outcome.failure_class in HEALTH_CLIMBING_FAILURES:
        diagnosis = get_backend(**run.backend).diagnose(JobHandle.from_dict(outcome.handle))
    return should_escalate(outcome, rung, run.max_node_replacements, diagnosis)


def failure_message(run: Run, outcome: Outcome) -> str:
    """Why the run failed, for the DAG's error: the class and message of the last launch, and
    what to do about a class the ladder never retries."""
    failure = outcome.failure_class
    text = (
        f"training failed: {failure}: {outcome.message} (after {next_launch_no(outcome)} launch(es), "
        f"max_node_replacements={run.max_node_replacements})"
    )
    if failure not in REPLACEABLE_FAILURES:
        text += f". What to do: {what_to_do(failure)}"
    return text


def stop_launch(run: Run, outcome: Outcome) -> None:
    """Stop whatever is left of the launch ``outcome`` watched (a no-op for a finished one). Only
    that launch's own processes or pods: never another launcher of the run (``already_running``)."""
    get_backend(**run.backend).cancel(JobHandle.from_dict(outcome.handle))


def diagnose_and_replace(run: Run, outcome: Outcome, rung: int) -> dict[str, Any]:
    """Stop what is left of the failed launch, find the bad node(s), have the backend replace
    them, and record the escalation in the run's events."""
    stop_launch(run, outcome)  # a stalled launch is still running; a failed one may have leftovers
    backend = get_backend(**run.backend)
    handle = JobHandle.from_dict(outcome.handle)
    diagnosis = backend.diagnose(handle)
    if not diagnosis.replaceable:
        raise EscalationError(
            f"launch {handle.launch_id} failed with {diagnosis.failure_class}, which no node "
            f"replacement can fix: {'; '.join(diagnosis.evidence)}"
        )
    replacement = backend.replace_nodes(diagnosis.bad_node_ids, reason=f"rung {rung}: {diagnosis.failure_class}")
    if replacement.refused:
        raise EscalationError(f"the backend refused to replace {replacement.refused}: {replacement.reason}")
    cfg = RunConfig.from_dict(run.config)
    cleared = clear_blamed_stop(cfg, handle, diagnosis, replacement.replaced)
    EventLog(cfg.layout.events, run_id=cfg.run_id, role="control-plane").emit(
        Event.ESCALATION,
        rung=rung,
        from_launch=handle.launch_id,
        to_launch=str(next_launch_no(outcome)),
        failure_class=diagnosis.failure_class,
        nodes=replacement.replaced,
        reason="; ".join(diagnosis.evidence),
        signals={n: diagnosis.signals.get(n, []) for n in replacement.replaced},
        **({"stop_cleared": cleared} if cleared else {}),
    )
    return {
        "rung": rung,
        "failure_class": diagnosis.failure_class,
        "bad_nodes": diagnosis.bad_node_ids,
        "replaced": replacement.replaced,
        "evidence": diagnosis.evidence,
        "signals": diagnosis.signals,
        **({"stop_cleared": cleared} if cleared else {}),
    }


def clear_blamed_stop(cfg: RunConfig, handle: JobHandle, diagnosis: Diagnosis, replaced: list[str]) -> str:
    """Move ``control/STOP.json`` aside (``clear_stop``) when the stop it records is the failure
    the diagnosis blamed on the nodes just replaced (their own health signals), so the relaunch may
    start; say where it went and why, or "" when it stays: no marker, another class, or one written
    before this launch was submitted."""
    failure = diagnosis.failure_class
    if not replaced or failure in REPLACEABLE_FAILURES or failure not in {c.value for c in STOP_CLASSES}:
        return ""
    stop = read_stop(cfg.layout)
    submitted_at = handle.extra.get("submitted_at")
    if stop is None or stop.get("failure_class") != failure:
        return ""
    if isinstance(submitted_at, (int, float)) and isinstance(stop.get("ts"), (int, float)):
        if stop["ts"] < submitted_at:
            return ""  # an earlier launch's stop: not the one blamed here
    path = clear_stop(cfg.layout, FailureClass(failure))
    if path is None:
        return ""
    where = f" (rank {stop['rank']}, step {stop.get('step')})" if stop.get("rank") is not None else ""
    return (
        f"{path.name}: the {failure} stop{where} was blamed on {', '.join(replaced)}, unhealthy by "
        "their own health signals, which were replaced"
    )


def trusted_checkpoint(run: Run, task: str) -> CheckpointChoice:
    """The newest committed checkpoint of the run that verifies (raises
    ``trusted_checkpoint.NoTrustedCheckpoint``), checked where its bytes are: the run dir when it
    is readable here (full checksums), else its S3 export (marker and sizes). Checkpoints that fail
    are quarantined only on the local backend, whose run dir is the trainers' own disk."""
    cfg = RunConfig.from_dict(run.config)
    readable = Path(cfg.run_dir).is_dir()
    try:
        s3_uri = None if readable else settings.checkpoints_s3_uri(cfg.run_dir)
    except ValueError as e:
        raise EscalationError(str(e)) from None
    return choose_checkpoint(
        cfg.run_dir,
        run_id=cfg.run_id,
        task=task,
        quarantine=readable and run.backend["name"] == "local",
        s3_uri=s3_uri,
        aws_conn_id=settings.aws_conn_id(),
    )


def evaluate(run: Run) -> dict[str, Any]:
    """Evaluate the newest committed checkpoint that verifies, where the run trained (a local
    process, a pod). The result says which checkpoint, and which newer ones were skipped and why
    (``checkpoint_check``)."""
    choice = trusted_checkpoint(run, task="evaluate")
    print(f"evaluating {choice.summary()}")
    result = get_backend(**run.backend).run_evaluation(
        RunConfig.from_dict(run.config), checkpoint_id=choice.checkpoint_id
    )
    return {**result, "checkpoint_check": choice.to_dict()}


def export_plan(run: Run, evaluation: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """What to export to S3 after a run, and why (not): on EKS with FSDP_FSX_FILE_SYSTEM_ID set,
    an FSx export task of the run's records (config, events, evaluation, report, logs) and of the
    one checkpoint evaluate verified and evaluated — never the others, which may be damaged (a
    copy in S3 with its commit marker would look committed there). Nothing on other backends."""
    if run.backend["name"] != "eks":
        return None, f"the {run.backend['name']} backend's run dir is a local folder: nothing to export"
    file_system = os.environ.get("FSDP_FSX_FILE_SYSTEM_ID", "").strip()
    if not file_system:
        return None, "FSDP_FSX_FILE_SYSTEM_ID is not set: the run dir stays on FSx only (set it to export to S3)"
    checkpoint_id = evaluation.get("checkpoint_id")
    if not checkpoint_id:
        raise EscalationError(f"the evaluation names no checkpoint ({evaluation}): nothing verified to export")
    run_dir = Path(run.config["run_dir"])
    try:
        fs_path = "/" + run_dir.relative_to(settings.fsx_mount_path()).as_posix()
    except ValueError:
        raise EscalationError(
            f"run dir {run_dir} is not under the FSx mount {settings.fsx_mount_path()} "
            "(FSDP_FSX_MOUNT_PATH): cannot export it"
        ) from None
    # The records there now (a path that does not exist would fail the task); without the mount
    # they cannot be listed, and only the checkpoint goes.
    records = (
        sorted(p.name for p in run_dir.iterdir() if p.name != "checkpoints" and not p.name.startswith("."))
        if run_dir.is_dir()
        else []
    )
    paths = [f"{fs_path}/{name}" for name in records] + [f"{fs_path}/checkpoints/{checkpoint_id}"]
    what = ", ".join(records) or "no records (the run dir is not mounted here)"
    return {"file_system_id": file_system, "paths": paths, "aws_conn_id": settings.aws_conn_id()}, (
        f"export {fs_path} of {file_system} to its S3 data repository: {what} and checkpoints/{checkpoint_id} "
        "(verified and evaluated; no other checkpoint)"
    )


def publish(run: Run, evaluation: dict[str, Any]) -> dict[str, Any]:
    """What to publish: the newest committed checkpoint that verifies now (raises
    ``NoTrustedCheckpoint`` when none does), which ones were skipped and why, and whether it is
    the one that was evaluated."""
    choice = trusted_checkpoint(run, task="publish")
    evaluated = evaluation.get("checkpoint_id")
    published = {
        "run_id": run.config["run_id"],
        "checkpoint": choice.location,
        **choice.to_dict(),
        "evaluated_checkpoint_id": evaluated,
    }
    if evaluated != choice.checkpoint_id:
        # The evaluated one failed its checks since, or a newer one verifies now that did not then.
        published["note"] = (
            f"the evaluation is of {evaluated}, not of the published {choice.checkpoint_id}; "
            "re-run evaluate and publish to evaluate it"
        )
    return published
