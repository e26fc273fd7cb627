"""DAG runs as the tests drive them: ``dag.test()`` of fsdp_training, the states and return
values a user sees in the UI, and a trigger's first event, as the triggerer takes it."""

from __future__ import annotations

from control.support import REPO


def trigger(conf: dict):
    from airflow.dag_processing.dagbag import DagBag

    dag = DagBag(dag_folder=str(REPO / "dags")).get_dag("fsdp_training")
    return dag.test(run_conf=conf)


def states(dag_run) -> dict[str, str]:
    return {ti.task_id: str(ti.state) for ti in dag_run.get_task_instances()}


def xcom(dag_run, task_id: str):
    """A task's return value, as the UI shows it."""
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    with create_session() as session:
        row = session.scalars(
            XComModel.get_many(run_id=dag_run.run_id, dag_ids=dag_run.dag_id, task_ids=task_id, key="return_value")
        ).first()
        return XComModel.deserialize_value(row) if row is not None else None


async def first_event(trigger):
    async for event in trigger.run():
        return event.payload


class XComs:
    """Stands in for a task instance where a task reads other tasks' return values."""

    def __init__(self, **by_task):
        self.by_task = by_task

    def xcom_pull(self, task_ids):
        return self.by_task[task_ids]
