"""The spare pool keeper's bookkeeping (control/spare_refill.py): which nodes of a launch were
already made up for, and how much of max_node_replacements this DAG run spent, read from the run's
events log (only records since the DAG run's first launch count). keep_spare_pool itself runs on
the local backend in test_ladder_and_trigger.py and on the fake cluster in test_eks_dag.py."""

from __future__ import annotations

import time

from fsdp_resilience.control.spare_refill import handled_nodes, node_replacements_done, spares_added
from fsdp_resilience.control.task_data import Launch, Run
from fsdp_resilience.training.contract import Event, EventLog, RunConfig


def make_run(tmp_path) -> Run:
    cfg = RunConfig(run_id="run", run_dir=str(tmp_path / "run"), dataset_dir=str(tmp_path / "data"))
    return Run(config=cfg.to_dict(), backend={"name": "local"}, max_node_replacements=3)


def make_launch(run: Run, launch_id: str, launched_at: float) -> Launch:
    return Launch(
        backend=run.backend,
        handle={"launch_id": launch_id, "job_name": f"r-run-{launch_id}"},
        run_dir=run.config["run_dir"],
        final_step=10,
        stall_timeout_s=60.0,
        launched_at=launched_at,
    )


def test_only_this_launchs_refills_since_it_began_are_handled_and_all_of_the_dag_run_count(tmp_path):
    run = make_run(tmp_path)
    cfg = RunConfig.from_dict(run.config)
    log = EventLog(cfg.layout.events, run_id=cfg.run_id, role="control-plane")
    log.emit(Event.SPARE_ADDED, launch_id="0", lost_node_rank=1, lost_node_id="old")  # an earlier DAG run's
    time.sleep(0.01)
    since = time.time()
    log.emit(Event.SPARE_ADDED, launch_id="0", lost_node_rank=1, lost_node_id="slot-1")
    log.emit(Event.SPARE_ADDED, launch_id="0", lost_node_rank="?", lost_node_id="slot-9")  # no rank: not a node
    log.emit(Event.ESCALATION, rung=1)
    log.emit(Event.SPARE_ADDED, launch_id="1", lost_node_rank=2, lost_node_id="slot-2")
    first = make_launch(run, "0", since)
    assert [r["lost_node_id"] for r in spares_added(run, first)] == ["slot-1", "slot-9"]
    assert handled_nodes(run, first) == ["1@slot-1"]
    assert handled_nodes(run, make_launch(run, "1", since)) == ["2@slot-2"]
    assert node_replacements_done(run, since) == (1, 3)
    assert node_replacements_done(run, time.time() + 60) == (0, 0)
