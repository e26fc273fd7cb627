"""FSDP training that keeps going: launch, watch, escalate to node replacement, evaluate, publish.

validate_config -> stage_data -> launch_training -> [watch_checkpoints, keep_spare_pool]
    -> escalation_1 (decide -> diagnose_and_replace -> wait_for_capacity -> relaunch
                     -> [watch, keep_spare_pool]) -> ... x3
    -> resolve_outcome -> evaluate -> build_report -> plan_export -> export_to_s3 -> publish

Hot spares (spare_nodes > 0): each launch starts nodes + spare_nodes node launchers; the spares
wait in the rendezvous, and a lost node's place is taken by one at the next in-job restart (no
relaunch). Next to each watch, keep_spare_pool (deferred, no worker slot) refills the pool while
training goes on: it takes the lost node out of service and adds a new spare, each refill spending
one of max_node_replacements, as a rung does. A refill it cannot do (budget spent, no free node) is
logged and the launch trains on with fewer spares; it never fails the run, and it ends when its
launch ends. The rungs read only the watches: they are needed once no spare is left. With
spare_nodes=0 the keep_spare_pool tasks show as skipped.

evaluate, export_to_s3 and publish trust only a checkpoint that verifies: the newest committed one
whose files match the sizes and checksums of its commit marker. Newer ones that fail are skipped
(quarantined on the local backend), and the tasks' results say which and why.

On EKS, export_to_s3 copies the run's records (config, events, evaluation, report, logs) and the
verified checkpoint from FSx for Lustre to its S3 data repository with an export task (deferrable);
elsewhere plan_export says why it is skipped.

Each escalation rung runs only when the launch before it failed with a retryable class and the
run's max_node_replacements allows it; otherwise its tasks show as skipped, with the reason in the
log. user_error, storage_error, non_finite and unknown climb only when decide finds a node
unhealthy by its own signals (a node condition False, Ready not True, the node gone, a failed NVRx
health check): its log names the node and the signal, diagnose_and_replace replaces it and moves
the failure's stop marker aside (control/STOP.cleared.<ms>.json, recorded in the escalation event).
On nodes healthy by every signal they never climb, nor does already_running: resolve_outcome fails
the run with what to do.

Parameters a run cannot be started with (a dataset or run name that is not a folder under its root,
path fields in run_config, a drill on a rank that does not exist, more nodes than the backend has)
fail validate_config with the reason before anything is created; every task after it shows
upstream_failed (not skipped: Airflow would call a run whose last tasks skipped a success).
Every task pulls the run config from validate_config itself, so the graph is one line.

The heavy lifting lives in plugins/fsdp_resilience (no torch is imported here).
"""

from __future__ import annotations

import os

from airflow.sdk import Param, TaskGroup, dag, get_current_context, task
from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

from fsdp_resilience.control import ladder, settings
from fsdp_resilience.control.assets import DATASET, MODEL_CHECKPOINT, MODEL_EVALUATION
from fsdp_resilience.control.backends import BackendError
from fsdp_resilience.control.operators.fsx import FsxDataRepositoryTaskOperator
from fsdp_resilience.control.operators.spare_pool import SparePoolKeeper
from fsdp_resilience.control.sensors.checkpoint_progress import CheckpointProgressSensor
from fsdp_resilience.control.sensors.node_capacity import NodeCapacitySensor
from fsdp_resilience.control.task_data import Outcome, Run
from fsdp_resilience.control.trusted_checkpoint import NoTrustedCheckpoint
from fsdp_resilience.training.contract import (
    MAX_SPARE_NODES,
    MODEL_PRESETS,
    RESTART_MODES,
    ConfigError,
    read_dataset_index,
)


def schedule_from_env():
    """No schedule by default. FSDP_TRAINING_SCHEDULE=asset trains when stage_dataset updates the
    dataset Asset; any other value is a cron expression or preset (e.g. "@daily")."""
    value = os.environ.get("FSDP_TRAINING_SCHEDULE", "").strip()
    if not value:
        return None
    return [DATASET] if value == "asset" else value


#: The trigger form's sections, in the order the form shows them.
TRAIN, RESTARTS, PLACEMENT, DRILLS = (
    "What to train",
    "Restarts and escalation",
    "Where it runs",
    "Drills and other settings",
)

PARAMS = {
    "run_name": Param(
        None,
        type=["null", "string"],
        pattern=r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$",
        title="Run name",
        section=TRAIN,
        description="Run id (DNS-1123: lowercase letters, digits, '-'). Empty: derived from the DAG "
        "run, stable across retries. The run dir is <FSDP_RUNS_ROOT>/<run name>.",
    ),
    "dataset": Param(
        "python-stdlib",
        type="string",
        pattern=ladder.NAME_PATTERN,
        title="Dataset",
        section=TRAIN,
        description="Name of a dataset staged by the stage_dataset DAG (a folder under the data root; "
        "a name, not a path).",
    ),
    "model": Param(
        "tiny", enum=list(MODEL_PRESETS), title="Model preset", section=TRAIN, description="tiny (CPU) ... 8b (p5)."
    ),
    "steps": Param(
        60, type="integer", minimum=1, maximum=10_000_000, title="Steps", section=TRAIN, description="Training steps."
    ),
    "checkpoint_interval": Param(
        10,
        type="integer",
        minimum=1,
        maximum=100_000,
        title="Checkpoint interval",
        section=TRAIN,
        description="Steps between asynchronous checkpoints.",
    ),
    "restart_mode": Param(
        "layered",
        enum=list(RESTART_MODES),
        title="Restart mode",
        section=RESTARTS,
        description="layered: in-process + in-job restarts (recommended).",
    ),
    "max_restarts": Param(
        2,
        type="integer",
        minimum=0,
        maximum=20,
        title="In-job restarts",
        section=RESTARTS,
        description="In-job restarts before the launch fails with restarts_exhausted.",
    ),
    "max_node_replacements": Param(
        1,
        type="integer",
        minimum=0,
        maximum=ladder.MAX_RUNGS,
        title="Node replacements",
        section=RESTARTS,
        description="Node replacements + relaunches the DAG may do (escalation rungs).",
    ),
    "stall_timeout_s": Param(
        1800,
        type="integer",
        minimum=10,
        maximum=86_400,
        title="Stall timeout (s)",
        section=RESTARTS,
        description="No new committed checkpoint this long: no_progress.",
    ),
    "backend": Param(
        None,
        type=["null", "string"],
        enum=[None, *settings.BACKENDS],
        title="Backend",
        section=PLACEMENT,
        description="local (processes on the Airflow worker) or eks. Empty: the deployment's "
        "FSDP_DEFAULT_BACKEND (default local).",
    ),
    "nodes": Param(
        1,
        type="integer",
        minimum=1,
        maximum=64,
        title="Nodes",
        section=PLACEMENT,
        description="Nodes (pods / local slots).",
    ),
    "spare_nodes": Param(
        0,
        type="integer",
        minimum=0,
        maximum=MAX_SPARE_NODES,
        title="Spare nodes",
        section=PLACEMENT,
        description="Hot spares: nodes started with each launch that wait without training (they "
        "cost their machines while idle) and take a lost node's place at the next in-job "
        "restart, in seconds instead of a relaunch. The lost node is then taken out of "
        "service and a new spare added while training goes on (each refill spends one of "
        "Node replacements). Needs restart mode layered or injob. 0: none.",
    ),
    "procs_per_node": Param(
        2,
        type="integer",
        minimum=1,
        maximum=8,
        title="Processes per node",
        section=PLACEMENT,
        description="Training processes per node (8 GPUs per p5.48xlarge).",
    ),
    "image": Param(
        None,
        type=["null", "string"],
        maxLength=512,
        title="Training image",
        section=PLACEMENT,
        description="EKS only. Empty: the deployment's FSDP_EKS_IMAGE; anything else must be under "
        "FSDP_EKS_IMAGE_ALLOWLIST.",
    ),
    "namespace": Param(
        None,
        type=["null", "string"],
        pattern=r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$",
        title="Namespace",
        section=PLACEMENT,
        description="EKS only. Empty: the deployment's FSDP_EKS_NAMESPACE; anything else must be in "
        "FSDP_EKS_NAMESPACES.",
    ),
    "fault_drill": Param(
        None,
        type=["null", "object"],
        title="Fault drill",
        section=DRILLS,
        description='Optional fault drill, e.g. {"kind": "exception", "step": 15, "rank": 1}.',
    ),
    "run_config": Param(
        {},
        type="object",
        title="Other run config fields",
        section=DRILLS,
        # Where a run reads and writes is the control plane's to say: refused by the
        # schema (400 through the REST API) and again by name in validate_config.
        propertyNames={"not": {"enum": list(ladder.PLACEMENT_FIELDS)}},
        description="Other fields of src/fsdp_resilience/training/contract/config.py RunConfig, "
        "e.g. timeouts or lr. Not "
        f"{', '.join(ladder.PLACEMENT_FIELDS)}: the control plane sets those.",
    ),
}


def run_of_this_dag() -> Run:
    """validate_config's result: the run config and backend. Tasks pull it themselves rather than
    take it as an argument, so the graph keeps one line instead of an edge from validate_config to
    every task."""
    return Run.from_dict(get_current_context()["ti"].xcom_pull(task_ids="validate_config"))


def outcomes_of(task_ids: list[str]) -> list[Outcome | None]:
    """The watches' results (None for a watch that did not run), oldest launch first."""
    outcomes = get_current_context()["ti"].xcom_pull(task_ids=task_ids)
    return [Outcome.from_dict(o) if o else None for o in (outcomes if isinstance(outcomes, list) else [outcomes])]


@dag(
    dag_id="fsdp_training",
    schedule=schedule_from_env(),
    catchup=False,
    params=PARAMS,
    max_active_runs=4,
    tags=["training", "fsdp"],
    doc_md=__doc__,
)
def fsdp_training():
    @task
    def validate_config() -> dict:
        context = get_current_context()
        try:
            return ladder.build_run_config(dict(context["params"]), context["dag_run"].run_id).to_dict()
        except (ConfigError, ladder.EscalationError) as e:
            raise AirflowFailException(f"invalid run parameters: {e}; nothing was launched") from None

    # When validate_config fails, every task after it ends upstream_failed, with no message of its
    # own. Not skipped: a run whose last tasks are skipped ends as a success in Airflow.
    @task
    def stage_data() -> dict:
        run = run_of_this_dag()
        try:
            index = read_dataset_index(run.config["dataset_dir"])
        except ConfigError as e:
            raise AirflowFailException(f"{e} (or trigger the stage_dataset DAG for it)") from None
        return {"dataset_dir": run.config["dataset_dir"], "train_tokens": sum(s["tokens"] for s in index["train"])}

    @task
    def launch_training(staged: dict) -> dict:
        return ladder.launch(run_of_this_dag(), launch_no=0).to_dict()

    staged = stage_data()
    validate_config() >> staged
    first = launch_training(staged)
    watches = [CheckpointProgressSensor(task_id="watch_checkpoints", launch=first)]
    # A leaf beside the watch: nothing waits for it, so a launch the ladder must stop (a stall)
    # is never held up by it; it ends when its launch ends.
    SparePoolKeeper(task_id="keep_spare_pool", launch=first)
    previous = watches[0]

    for rung in range(1, ladder.MAX_RUNGS + 1):
        with TaskGroup(group_id=f"escalation_{rung}"):

            @task(trigger_rule="none_failed")
            def decide(rung: int = rung, watched: tuple = tuple(w.task_id for w in watches)) -> dict:
                run = run_of_this_dag()
                outcome = ladder.latest_outcome(outcomes_of(list(watched)))
                climb, why = ladder.decide_escalation(run, outcome, rung)
                if not climb:
                    raise AirflowSkipException(f"rung {rung} not needed: {why}")
                print(f"rung {rung}: escalating: {why}")
                return outcome.to_dict()

            @task
            def diagnose_and_replace(outcome: dict, rung: int = rung) -> dict:
                try:
                    return {
                        **ladder.diagnose_and_replace(run_of_this_dag(), Outcome.from_dict(outcome), rung),
                        "outcome": outcome,
                    }
                except ladder.EscalationError as e:
                    raise AirflowFailException(str(e)) from None

            @task
            def relaunch(capacity: dict, rung: int = rung) -> dict:
                replaced = get_current_context()["ti"].xcom_pull(task_ids=f"escalation_{rung}.diagnose_and_replace")
                launch_no = ladder.next_launch_no(Outcome.from_dict(replaced["outcome"]))
                return ladder.launch(run_of_this_dag(), launch_no=launch_no).to_dict()

            capacity = NodeCapacitySensor(task_id="wait_for_capacity", run_from="validate_config")
            decided = decide()
            diagnose_and_replace(decided) >> capacity
            relaunched = relaunch(capacity.output)
            watch = CheckpointProgressSensor(task_id="watch", launch=relaunched)
            SparePoolKeeper(task_id="keep_spare_pool", launch=relaunched)
        # From the watch, not the whole group: the rung after reads only the watches, and must
        # not wait for a keep_spare_pool whose launch only the ladder stops.
        previous >> decided
        watches.append(watch)
        previous = watch

    # none_failed: after a task that failed (bad params, a launch or escalation that could not go
    # on), the run has already failed there with the reason; nothing here would add to it.
    @task(trigger_rule="none_failed")
    def resolve_outcome(watched: tuple = tuple(w.task_id for w in watches)) -> dict:
        run = run_of_this_dag()
        outcome = ladder.latest_outcome(outcomes_of(list(watched)))
        if outcome.outcome != "success":
            ladder.stop_launch(run, outcome)  # a stalled launch is still running: free its nodes
            raise AirflowFailException(ladder.failure_message(run, outcome))
        return outcome.to_dict()

    @task
    def evaluate(outcome: dict) -> dict:
        # The newest checkpoint that verifies, evaluated in the training environment (torch), where
        # the run trained: this process never imports it.
        try:
            return ladder.evaluate(run_of_this_dag())
        except (BackendError, NoTrustedCheckpoint, ladder.EscalationError) as e:
            raise AirflowFailException(str(e)) from None

    @task
    def build_report(evaluation: dict) -> dict:
        from fsdp_resilience.control.report.build import build_report as build

        paths = build(run_of_this_dag().config["run_dir"])
        print(f"run report: {paths.to_dict()}")
        return paths.to_dict()

    @task.branch
    def plan_export(report: dict) -> str:
        evaluation = get_current_context()["ti"].xcom_pull(task_ids="evaluate")
        try:
            plan, why = ladder.export_plan(run_of_this_dag(), evaluation)
        except ladder.EscalationError as e:
            raise AirflowFailException(str(e)) from None
        print(why)
        ti = get_current_context()["ti"]
        ti.xcom_push(key="plan", value=plan)
        ti.xcom_push(key="paths", value=plan["paths"] if plan else [])
        return "export_to_s3" if plan else "publish"

    @task(outlets=[MODEL_CHECKPOINT, MODEL_EVALUATION], trigger_rule="none_failed_min_one_success")
    def publish() -> dict:
        context = get_current_context()
        evaluation, report = context["ti"].xcom_pull(task_ids=["evaluate", "build_report"])
        # The newest checkpoint that verifies now, whatever was true when the run ended.
        try:
            published = ladder.publish(run_of_this_dag(), evaluation)
        except (NoTrustedCheckpoint, ladder.EscalationError) as e:
            raise AirflowFailException(str(e)) from None
        for skip in published["skipped"]:
            print(f"not published: {skip['checkpoint_id']}: {skip['reason']}")
        print(
            f"publishing {published['checkpoint']} ({published['verified']} verified)"
            + (f"; {published['note']}" if published.get("note") else "")
        )
        outlet_events = context["outlet_events"]
        outlet_events[MODEL_CHECKPOINT].extra = {
            "run_id": published["run_id"],
            "path": published["checkpoint"],
            "step": published["step"],
            "checkpoint_id": published["checkpoint_id"],
            "verified": published["verified"],
            "skipped": [{k: s[k] for k in ("checkpoint_id", "reason")} for s in published["skipped"]],
        }
        outlet_events[MODEL_EVALUATION].extra = {
            "run_id": published["run_id"],
            **evaluation,
            "report": report.get("markdown"),
        }
        return {**published, "evaluation": evaluation, "report": report}

    outcome = resolve_outcome()
    previous >> outcome
    exported = plan_export(build_report(evaluate(outcome)))
    _plan = "ti.xcom_pull(task_ids='plan_export', key='plan')"
    export_to_s3 = FsxDataRepositoryTaskOperator(
        task_id="export_to_s3",
        kind="export",
        file_system_id=f"{{{{ {_plan}['file_system_id'] }}}}",
        paths=exported["paths"],
        aws_conn_id=f"{{{{ {_plan}['aws_conn_id'] }}}}",
    )
    exported >> export_to_s3
    [exported, export_to_s3] >> publish()  # a branch skips export_to_s3 and goes straight to publish


fsdp_training()
