"""A simulated run: writes a run's events log (and its checkpoints, run.json, eval.json) the way
the launcher, the workers and the control plane do, on a clock it advances itself, so the
report's expected seconds are exact; and the scenarios the report tests build with it.

The logs are written with the contract's ``EventLog`` in the shape real runs give them (see
``src/fsdp_resilience/training/train/`` and ``src/fsdp_resilience/training/restart/``: ``step`` records from rank 0,
``restart_end`` just before the first step after a restart, in-job ``restart_begin`` after the new
``train_begin``).
"""

from __future__ import annotations

import json
from pathlib import Path

from fsdp_resilience.training.contract import Event, EventLog, RunDir

from control.fakes.saved_checkpoints import save_checkpoint

T0 = 1_800_000_000.0
STEP_S = 1.0
BLOCKING_S = 0.25
STEPS = 20
CHECKPOINT_INTERVAL = 10


def loss_at(step: int) -> float:
    # Deterministic, as a resumed run's losses are: a replayed step logs the same loss again.
    return 6.0 / (1.0 + 0.2 * step)


class SimulatedRun:
    """Writes a run's events log the way the launcher, the workers and the control plane do,
    on a clock it advances itself."""

    def __init__(self, run_dir: Path, run_id: str = "sim-run"):
        self.layout = RunDir(run_dir)
        self.layout.create()
        self.run_id = run_id
        self.now = T0
        self.next_pid = 1000
        self.log = EventLog(self.layout.events, run_id=run_id, host="node-a", node_id="node-a")
        self.rank0 = self.log
        self.attempt = 0
        self.iteration = 0
        self.launch_id = ""
        self.fault_ts: float | None = None
        (run_dir / "run.json").write_text(
            json.dumps(
                {
                    "run_id": run_id,
                    "run_dir": str(run_dir),
                    "dataset_dir": "data/x",
                    "model": "tiny",
                    "nodes": 1,
                    "procs_per_node": 2,
                    "steps": STEPS,
                    "checkpoint_interval": CHECKPOINT_INTERVAL,
                    "restart_mode": "layered",
                }
            )
        )

    def emit(self, log: EventLog, event: Event, after: float = 0.0, **fields) -> dict:
        self.now += after
        return log.emit(event, ts=round(self.now, 6), **fields)

    def _workers(self) -> list[EventLog]:
        ranks = []
        for rank in (0, 1):
            ranks.append(
                self.log.bind(
                    pid=self.next_pid,
                    rank=rank,
                    node_rank=0,
                    attempt=self.attempt,
                    iteration=self.iteration,
                    launch_id=self.launch_id,  # as training/train/loop.py binds TRAINING_LAUNCH_ID
                )
            )
            self.next_pid += 1
        self.rank0 = ranks[0]
        return ranks

    def launch(self, startup_s: float = 4.0, launch_id: str = "", start_step: int = 0) -> None:
        self.launch_id = launch_id
        self.attempt, self.iteration = 0, 0
        launcher = self.log.bind(pid=self.next_pid, node_rank=0, role="launcher", launch_id=launch_id)
        self.next_pid += 1
        self.emit(launcher, Event.LAUNCH_BEGIN, nodes=1, procs_per_node=2, restart_mode="layered", command="ft")
        self.now += startup_s
        self.begin_training(start_step)

    def begin_training(self, start_step: int, workers: list[EventLog] | None = None) -> None:
        for log in workers or self._workers():
            self.emit(
                log,
                Event.TRAIN_BEGIN,
                start_step=start_step,
                world_size=2,
                device="cpu",
                resumed_from=f"step_{start_step:08d}" if start_step else None,
            )

    def train(self, first: int, last: int, *, resumed_layer: str | None = None) -> None:
        for step in range(first, last + 1):
            self.now += STEP_S
            if resumed_layer is not None:
                self.rank0.emit(
                    Event.RESTART_END,
                    ts=round(self.now, 6),
                    layer=resumed_layer,
                    step=step,
                    latency_s=round(self.now - self.fault_ts, 3),
                )
                resumed_layer = None
            self.emit(self.rank0, Event.STEP, step=step, loss=loss_at(step), step_s=STEP_S, tokens_per_s=4096.0)
            if step % CHECKPOINT_INTERVAL == 0:
                self.emit(self.rank0, Event.CHECKPOINT_BEGIN, after=BLOCKING_S, step=step, blocking_s=BLOCKING_S)
                self.commit(step)

    def commit(self, step: int) -> None:
        checkpoint = save_checkpoint(self.layout.root, step, world_size=2)
        self.rank0.emit(
            Event.CHECKPOINT_COMMIT, ts=round(self.now, 6), step=step, checkpoint_id=checkpoint.name, save_s=0.4
        )

    def inject(self, kind: str, step: int, rank: int = 1) -> None:
        self.fault_ts = self.now
        self.emit(
            self.rank0 if rank == 0 else self.rank0.bind(rank=1, pid=self.rank0.context["pid"] + 1),
            Event.FAULT_INJECTED,
            kind=kind,
            step=step,
        )

    def detect(self, layer: str, step: int, after: float = 0.01, failure_class: str = "restarts_exhausted") -> None:
        # The class a rank gives a fault it cannot blame on the user: what the launch ends with
        # if no restart recovers it (training/train/fault_handling.py).
        self.emit(
            self.rank0.bind(rank=1, pid=self.rank0.context["pid"] + 1),
            Event.FAULT_DETECTED,
            after=after,
            layer=layer,
            kind="RuntimeError",
            step=step,
            error="peer gone | see logs",
            repeated=False,
            failure_class=failure_class,
        )

    def restart_inprocess(self, detect_s: float, restore_s: float, start_step: int) -> None:
        # Same PIDs, next Wrapper iteration; rank 0 logs restart_begin, then both ranks restore.
        self.emit(self.rank0, Event.RESTART_BEGIN, after=detect_s, layer="inprocess", reason="timeout")
        self.iteration += 1
        pids = [self.rank0.context["pid"], self.rank0.context["pid"] + 1]
        workers = [
            self.log.bind(
                pid=pid,
                rank=rank,
                node_rank=0,
                attempt=self.attempt,
                iteration=self.iteration,
                launch_id=self.launch_id,
            )
            for rank, pid in enumerate(pids)
        ]
        self.rank0 = workers[0]
        self.now += restore_s
        self.begin_training(start_step, workers)

    def restart_injob(self, down_s: float, start_step: int, layer: str = "injob") -> None:
        # New processes: train_begin first, then rank 0 finds out it is recovering.
        self.attempt += 1 if layer == "injob" else 0
        self.iteration = 0
        self.now += down_s
        self.begin_training(start_step)
        self.emit(
            self.rank0, Event.RESTART_BEGIN, layer=layer, reason=f"{layer}: started again", fault_ts=self.fault_ts
        )

    def final(self, failure_class: str = "success", exit_code: int = 0, after: float = 1.5) -> None:
        launcher = self.log.bind(pid=1, node_rank=0, role="launcher", launch_id=self.launch_id)
        if failure_class == "success":
            self.emit(self.rank0, Event.TRAIN_END, step=STEPS, status="completed")
        self.emit(
            launcher,
            Event.FINAL,
            after=after,
            failure_class=failure_class,
            exit_code=exit_code,
            step=STEPS,
            message=f"ended {failure_class}",
        )

    def evaluate(self) -> None:
        evaluation = {"checkpoint_id": f"step_{STEPS:08d}", "step": STEPS, "val_loss": 2.5, "perplexity": 12.18}
        (self.layout.eval_result).write_text(json.dumps(evaluation))
        self.emit(self.log.bind(role="evaluate"), Event.EVAL, after=5.0, **evaluation)


# -- scenarios --------------------------------------------------------------------------------


def clean_run(run_dir: Path) -> SimulatedRun:
    run = SimulatedRun(run_dir, "clean-run")
    run.launch(startup_s=4.0)
    run.train(1, STEPS)
    run.final()
    run.evaluate()
    return run


def inprocess_run(run_dir: Path) -> SimulatedRun:
    """An exception in rank 1 at step 13: in-process restart from step 10, replays 11 and 12."""
    run = SimulatedRun(run_dir, "inprocess-run")
    run.launch(startup_s=4.0)
    run.train(1, 12)
    run.inject("exception", 13)
    run.detect("inprocess", 13)
    run.restart_inprocess(detect_s=3.0, restore_s=0.5, start_step=10)
    run.train(11, STEPS, resumed_layer="inprocess")
    run.final()
    return run


def injob_run(run_dir: Path) -> SimulatedRun:
    """SIGKILL of rank 0 at step 13: ft_launcher starts new processes, which resume from step 10."""
    run = SimulatedRun(run_dir, "injob-run")
    run.launch(startup_s=4.0)
    run.train(1, 12)
    run.inject("sigkill", 13, rank=0)
    run.detect("inprocess", 13, after=0.05)
    run.restart_injob(down_s=12.0, start_step=10)
    run.train(11, STEPS, resumed_layer="injob")
    run.final()
    return run


def relaunch_run(run_dir: Path) -> SimulatedRun:
    """In-job restarts exhausted at step 13; the control plane escalates and relaunches."""
    run = SimulatedRun(run_dir, "relaunch-run")
    run.launch(startup_s=4.0, launch_id="launch-1")
    run.train(1, 12)
    run.inject("sigkill", 13, rank=0)
    run.final("restarts_exhausted", 75, after=2.0)
    control_plane = run.log.bind(pid=7, role="control-plane")
    run.emit(
        control_plane,
        Event.ESCALATION,
        after=3.0,
        rung=1,
        from_launch="launch-1",
        to_launch="launch-2",
        failure_class="restarts_exhausted",
        nodes=["node-a"],
        reason="restarts exhausted: replace node-a",
    )
    run.now += 20.0  # node replacement
    run.launch(startup_s=6.0, launch_id="launch-2", start_step=10)
    run.emit(run.rank0, Event.RESTART_BEGIN, layer="relaunch", reason="relaunch: started again", fault_ts=run.fault_ts)
    run.train(11, STEPS, resumed_layer="relaunch")
    run.final()
    return run


def spare_run(run_dir: Path) -> SimulatedRun:
    """Hot spares: node-b (node 1) is lost at step 13; the spare node-c takes its place at the
    in-job restart (spare_promoted), and the control plane quarantines node-b and adds node-d as
    a new spare while training goes on (spare_added; its launcher logs a standby launch_begin)."""
    run = SimulatedRun(run_dir, "spare-run")
    run.launch(startup_s=4.0, launch_id="0")
    run.train(1, 12)
    run.inject("node_loss", 13, rank=1)
    run.detect("injob", 13, after=0.05)
    run.restart_injob(down_s=6.0, start_step=10)
    run.emit(
        run.rank0,
        Event.SPARE_PROMOTED,
        node_id="node-c",
        node_rank=2,
        replaces=["node-b"],
        replaced_node_ranks=[1],
        members=["node-a", "node-c"],
        previous_attempt=0,
        launch_id="0",
    )
    run.train(11, 14, resumed_layer="injob")
    run.emit(
        run.log.bind(pid=7, role="control-plane"),
        Event.SPARE_ADDED,
        launch_id="0",
        lost_node_id="node-b",
        lost_node_rank=1,
        quarantined=["node-b"],
        node_id="node-d",
        node_rank=3,
        reason="launch 0: node 1 lost while training went on",
    )
    run.emit(
        run.log.bind(pid=8, node_rank=3, node_id="node-d", role="launcher", launch_id="0"),
        Event.LAUNCH_BEGIN,
        nodes=2,
        spare_nodes=1,
        procs_per_node=1,
        restart_mode="injob",
        command="ft",
        standby=True,
    )
    run.train(15, STEPS)
    run.final()
    return run


SCENARIOS = {
    "clean": clean_run,
    "inprocess": inprocess_run,
    "injob": injob_run,
    "relaunch": relaunch_run,
    "spare": spare_run,
}
