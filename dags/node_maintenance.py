"""Quarantined nodes: list them, and return repaired ones to service.

When a run's restarts run out on a node, the escalation ladder quarantines it (``replace_nodes``):
a local slot is marked quarantined in ``<FSDP_RUNS_ROOT>/.local-backend/slots.json`` and no job is
placed on it again; an EKS node is cordoned, tainted ``fsdp-resilience/quarantined`` and, unless
``FSDP_EKS_REPLACEMENT=cordon``, replaced by its Auto Scaling group or Karpenter. A local slot
stays out until someone returns it: this DAG is that way back.

list_quarantined -> return_named_nodes -> return_expired_nodes

- **list_quarantined**: each quarantined node with the time and reason of its quarantine (the task
  log shows a table; the XCom holds the list).
- **return_named_nodes**: with `nodes` given, returns them to service with `reason` (required):
  local slots are marked healthy; EKS nodes are uncordoned and lose the quarantine taint and
  annotation (taints other controllers set stay). Recorded: the reason, who (the run and the user
  who triggered it) and when (slots.json, or the node's `fsdp-resilience/return-reason`
  annotation). A node that is no longer in the cluster was replaced: reported, nothing to do. A
  name the local backend does not know fails the task. Skipped when `nodes` is empty.
- **return_expired_nodes**: with `FSDP_QUARANTINE_COOLDOWN_S` > 0, returns the nodes quarantined
  for longer than that, with the reason "automatic return after cool-down of Ns". Then the DAG
  runs by itself every 10 minutes; with 0 (the default) it runs only when triggered, and this task
  is skipped.

The same from a shell: `python -m fsdp_resilience.control.quarantine list | return NODE --reason TEXT |
return-expired` (docs/backends.md: "Quarantined nodes").
"""

from __future__ import annotations

import datetime

from airflow.sdk import Param, dag, get_current_context, task
from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

from fsdp_resilience.control import settings

#: Automatic return is off unless FSDP_QUARANTINE_COOLDOWN_S > 0; then look every 10 minutes.
SCHEDULE = datetime.timedelta(minutes=10) if settings.quarantine_cooldown_s() > 0 else None

PARAMS = {
    "nodes": Param(
        [],
        type="array",
        items={"type": "string", "minLength": 1, "maxLength": 253},
        maxItems=64,
        uniqueItems=True,
        title="Nodes to return",
        description="Node ids to return to service, as list_quarantined shows them (local: slot-N; "
        "EKS: the node name). Empty: only list (and return expired nodes).",
    ),
    "reason": Param(
        None,
        type=["null", "string"],
        minLength=1,
        maxLength=1000,
        title="Reason",
        description="Required when nodes are given: what was checked or fixed. Recorded with the "
        "node's return, with who triggered this run and when.",
    ),
    "backend": Param(
        None,
        type=["null", "string"],
        enum=[None, *settings.BACKENDS],
        title="Backend",
        description="The backend whose nodes to act on; empty: the deployment's "
        "FSDP_DEFAULT_BACKEND (local unless set).",
    ),
}


def _backend():
    from fsdp_resilience.control.quarantine import build_backend

    return build_backend(get_current_context()["params"].get("backend"))


@dag(
    dag_id="node_maintenance",
    schedule=SCHEDULE,
    start_date=datetime.datetime(2025, 1, 1),
    catchup=False,
    max_active_runs=1,
    params=PARAMS,
    tags=["fsdp", "maintenance"],
    doc_md=__doc__,
)
def node_maintenance():
    @task
    def list_quarantined() -> list[dict]:
        from fsdp_resilience.control.quarantine import format_table

        nodes = _backend().quarantined_nodes()
        print(format_table(nodes))
        return nodes

    @task
    def return_named_nodes() -> dict:
        from fsdp_resilience.control.backends.base import BackendError
        from fsdp_resilience.control.quarantine import format_return

        context = get_current_context()
        params = context["params"]
        if not params.get("nodes"):
            raise AirflowSkipException("no nodes named: nothing to return")
        reason = (params.get("reason") or "").strip()
        if not reason:
            raise AirflowFailException(
                f"returning {params['nodes']} needs a reason: trigger again with `reason` "
                "saying what was checked or fixed"
            )
        dag_run = context["dag_run"]
        user = getattr(dag_run, "triggering_user_name", None)
        by = f"Airflow node_maintenance run {dag_run.run_id}" + (f" triggered by {user}" if user else "")
        try:
            result = _backend().return_nodes(params["nodes"], reason, by=by)
        except BackendError as e:
            raise AirflowFailException(str(e)) from None
        print(format_return(result))
        return result.to_dict()

    @task(trigger_rule="none_failed")
    def return_expired_nodes() -> list[str]:
        cooldown = settings.quarantine_cooldown_s()
        if cooldown <= 0:
            raise AirflowSkipException("FSDP_QUARANTINE_COOLDOWN_S is 0: automatic return is off")
        returned = _backend().return_expired(cooldown)
        print(
            f"returned after the cool-down of {cooldown:g}s: {returned}"
            if returned
            else f"no node has been quarantined longer than {cooldown:g}s"
        )
        return returned

    list_quarantined() >> return_named_nodes() >> return_expired_nodes()


node_maintenance()
