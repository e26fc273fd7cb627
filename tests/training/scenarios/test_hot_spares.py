"""Hot spares on the training plane: launchers beyond ``nodes`` wait in the rendezvous, and a
lost node's place is taken by one at the next in-job restart, with no relaunch and the losses of
a run that never lost a node (ranks, data order and checkpoints stay those of ``nodes`` nodes)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from fsdp_resilience.training.contract import CheckpointCatalog, ConfigError, RunConfig, read_events
from fsdp_resilience.training.contract.replacements import announce_replacement
from fsdp_resilience.training.launch.cli import main as launch_main
from fsdp_resilience.training.launch.command import build_command

from training.support import Run, launch, launch_processes, write_config


def run_nodes(tmp_path, cfg, count: int, timeout: float = 400, env=None) -> tuple[list[int], str]:
    """Launch nodes 0..count-1 of ``cfg`` as pods would (one fsdp_resilience.training.launch each); their exit
    codes and the tail of their logs."""
    cfg_path = tmp_path / f"{cfg.run_id}.json"
    nodes = [launch(cfg, cfg_path, node_rank=i, env=env) for i in range(count)]
    try:
        codes = [p.wait(timeout=timeout) for p in nodes]
    finally:
        for p in nodes:
            p.kill()
    logs = "\n".join(cfg_path.with_suffix(f".node{i}.log").read_text()[-2500:] for i in range(count))
    return codes, logs


def test_spares_need_in_job_restarts_and_are_bounded(tmp_path, dataset):
    base = dict(run_id="x", run_dir=str(tmp_path / "x"), dataset_dir=str(dataset), nodes=2)
    with pytest.raises(ConfigError, match="needs in-job restarts"):
        RunConfig(**base, spare_nodes=1, restart_mode="inprocess")
    with pytest.raises(ConfigError, match="spare_nodes"):
        RunConfig(**base, spare_nodes=9)
    cfg = RunConfig(**base, spare_nodes=1)
    assert (cfg.launch_nodes, cfg.world_size) == (3, 2 * cfg.procs_per_node)
    # A drill may take down a spare's node too; nothing beyond the launch's nodes.
    RunConfig(**base, spare_nodes=1, faults=[{"kind": "node_loss", "step": 1, "node": 2}])
    with pytest.raises(ConfigError, match=r"node index in \[0, 3\)"):
        RunConfig(**base, spare_nodes=1, faults=[{"kind": "node_loss", "step": 1, "node": 3}])
    # A drill that fires once, on whatever round first reaches it (rounds are the rendezvous's
    # to number when spares come and go): any round only.
    RunConfig(**base, faults=[{"kind": "sigkill", "step": 1, "rank": 1, "attempt": None, "once": True}])
    with pytest.raises(ConfigError, match="attempt null"):
        RunConfig(**base, faults=[{"kind": "sigkill", "step": 1, "rank": 1, "attempt": 0, "once": True}])
    # node null: whichever training node holds the highest rank off node 0 (with spares only).
    RunConfig(**base, spare_nodes=1, faults=[{"kind": "node_loss", "step": 1, "node": None}])
    with pytest.raises(ConfigError, match="node=null"):
        RunConfig(**base, faults=[{"kind": "node_loss", "step": 1, "node": None}])


def test_a_spare_joins_with_the_world_size_of_the_training_nodes(tmp_path, dataset, capsys):
    cfg = write_config(tmp_path, dataset, "flags", nodes=2, spare_nodes=1)
    cfg.layout.create()
    cfg.layout.config.write_text(cfg.to_json())  # node 0's copy, which the other nodes wait for
    command = " ".join(build_command(cfg, 2, "127.0.0.1", tmp_path / "ft.yaml", tmp_path))
    from fsdp_resilience.training.launch.command import nvrx_version

    # 0.7's barrier rendezvous: N:M keeps N training and M-N standing by; 0.4.1's c10d fork
    # keeps a fixed N and puts the rest on its redundancy list (N:M would grow the world).
    expected = f"--nnodes=2:{cfg.node_rank_limit}" if nvrx_version() >= (0, 6) else "--nnodes=2 "
    assert expected in command
    # Where NVRx checks a joining node (0.7), the run's storage is one of the checks.
    assert (f"--ft-storage-health-check-path={cfg.layout.checkpoints}" in command) == (nvrx_version() >= (0, 6))
    # Node indices: the launch's three, then those of spares added while it runs; no further.
    assert (
        launch_main(
            [
                "--config",
                str(tmp_path / "flags.json"),
                "--node-rank",
                str(cfg.node_rank_limit - 1),
                "--rdzv-host",
                "127.0.0.1",
                "--dry-run",
            ]
        )
        == 0
    )
    assert (
        launch_main(
            [
                "--config",
                str(tmp_path / "flags.json"),
                "--node-rank",
                str(cfg.node_rank_limit),
                "--rdzv-host",
                "127.0.0.1",
                "--dry-run",
            ]
        )
        == 2
    )
    assert "outside the run's 2 node(s) + 1 spare(s)" in capsys.readouterr().err


def test_node_loss_with_a_spare_recovers_in_job_with_the_same_losses(tmp_path, dataset):
    """Two training nodes and one spare (one rank each). Node 1 dies whole at step 5 (launcher,
    ranks, NVRx helpers); the spare (node 2) takes its place at the in-job restart. Nothing is
    relaunched, and every step's loss equals that of a run with no fault and no spare. The drill
    names no node: it takes the training node that holds the highest rank off node 0, once."""
    common = dict(steps=10, nodes=2, procs_per_node=1)
    clean_cfg = write_config(tmp_path, dataset, "clean", **common)
    codes, logs = run_nodes(tmp_path, clean_cfg, 2)
    assert codes == [0, 0], logs
    clean = Run(clean_cfg, 0, logs)

    cfg = write_config(
        tmp_path,
        dataset,
        "spare",
        spare_nodes=1,
        **common,
        faults=[{"kind": "node_loss", "step": 5, "node": None, "attempt": None, "once": True}],
    )
    codes, logs = run_nodes(tmp_path, cfg, 3)
    assert codes == [0, -9, 0], logs
    run = Run(cfg, 0, logs)
    begins = run.of("launch_begin")
    assert sorted((r["node_rank"], r["standby"]) for r in begins) == [(0, False), (1, False), (2, True)]
    # The spare waited for the training nodes: node 2 began training only after node 1 was lost.
    [lost] = run.of("fault_injected")
    spare_begins = [r for r in run.of("train_begin") if r["node_rank"] == 2]
    assert spare_begins and min(r["ts"] for r in spare_begins) > lost["ts"]
    [promoted] = run.of("spare_promoted")
    assert (promoted["node_rank"], promoted["replaced_node_ranks"]) == (2, [1])
    assert promoted["ts"] > lost["ts"]
    assert any(r["layer"] == "injob" for r in run.of("restart_end"))
    finals = {r["node_rank"]: r["failure_class"] for r in run.of("final")}
    assert finals == {0: "success", 2: "success"}, finals
    # One launch; the world stayed two ranks; the same loss at every step.
    assert {r["world_size"] for r in run.of("train_begin")} == {2}
    assert run.losses() == clean.losses()


def two_losses_one_spare(tmp_path, dataset, run_id: str) -> RunConfig:
    """Two training nodes and one spare; node 1 lost at step 4 (the spare takes its place), then
    the spare's node at step 8."""
    return write_config(
        tmp_path,
        dataset,
        run_id,
        steps=12,
        nodes=2,
        procs_per_node=1,
        spare_nodes=1,
        faults=[
            {"kind": "node_loss", "step": 4, "node": None, "attempt": None, "once": True},
            {"kind": "node_loss", "step": 8, "node": None, "attempt": None, "once": True},
        ],
    )


def test_a_loss_no_spare_is_left_for_ends_the_launch_in_seconds_and_a_relaunch_resumes(tmp_path, dataset):
    """Two training nodes and one spare; node 1 is lost at step 4 (the spare takes its place), then
    the spare's node at step 8. Nothing is left to take its place and nothing was announced
    (control/membership-deadline.json): node 0 logs waiting_for_nodes naming the lost node and ends
    the launch as restarts_exhausted within seconds, for the ladder to relaunch, instead of waiting
    out the rendezvous' join_timeout (600 s). The relaunch (what the ladder starts: a new launch of
    the same run) resumes from the newest committed checkpoint and finishes."""
    cfg = two_losses_one_spare(tmp_path, dataset, "usedup")
    codes, logs = run_nodes(tmp_path, cfg, 3, timeout=300)
    assert codes == [75, -9, -9], logs
    run = Run(cfg, 0, logs)
    first, second = sorted(run.of("fault_injected"), key=lambda r: r["ts"])
    [promoted] = run.of("spare_promoted")
    assert promoted["node_rank"] == 2 and first["ts"] < promoted["ts"] < second["ts"]
    [waiting] = run.of("waiting_for_nodes")
    assert waiting["node_rank"] == 0 and waiting["missing_node_ranks"] == [2] and waiting["until"] is None
    assert "no replacement announced" in waiting["why"]
    [final] = [r for r in run.of("final") if r["node_rank"] == 0]
    assert final["failure_class"] == "restarts_exhausted" and "(node 2) lost and no spare left" in final["message"]
    assert final["ts"] - second["ts"] < 30, (final["ts"] - second["ts"], logs)

    newest = CheckpointCatalog(cfg.layout.root).latest()
    assert newest is not None and newest.step < 12
    # The training nodes only: a parked spare outlives a launch that succeeds (its backend stops it).
    codes, logs = run_nodes(tmp_path, cfg, 2, timeout=300, env={"TRAINING_LAUNCH_ID": "1"})
    assert codes == [0, 0], logs
    relaunched = [r for r in Run(cfg, 0, logs).of("train_begin") if r.get("launch_id") == "1"]
    resumed = {(r["start_step"], r["resumed_from"]) for r in relaunched}
    assert resumed == {(newest.step, newest.checkpoint_id)}, relaunched
    assert CheckpointCatalog(cfg.layout.root).latest().step == 12


def test_a_replacement_announced_for_a_loss_no_spare_covers_joins_and_training_goes_on(tmp_path, dataset):
    """The same two losses, with a replacement announced (control/membership-deadline.json, as the
    pool keeper announces the spare it adds): node 0 waits for it, and this test, playing the
    keeper, starts it (node 3) once the second loss happened. It joins, training goes on in the
    same launch and succeeds; nothing ends early. (Started before node 0 looks, node 3 would be a
    parked spare like any other, and node 0 would not wait at all.)"""
    cfg = two_losses_one_spare(tmp_path, dataset, "announced")
    cfg_path = tmp_path / f"{cfg.run_id}.json"
    nodes = [launch(cfg, cfg_path, node_rank=i) for i in range(3)]
    try:
        cfg.layout.root.mkdir(parents=True, exist_ok=True)  # the launchers may not have made it yet
        assert announce_replacement(
            cfg.layout.control, "", until=time.time() + 240, why="the test adds a spare for the second loss"
        )
        deadline = time.time() + 240
        while not read_events(cfg.layout.events, "waiting_for_nodes") and time.time() < deadline:
            time.sleep(0.2)
        nodes.append(launch(cfg, cfg_path, node_rank=3))  # the keeper's spare, after node 0 began to wait
        codes = [p.wait(timeout=300) for p in nodes]
    finally:
        for p in nodes:
            p.kill()
    logs = "\n".join(cfg_path.with_suffix(f".node{i}.log").read_text()[-2500:] for i in range(4))
    assert codes == [0, -9, -9, 0], logs
    run = Run(cfg, 0, logs)
    second = max(r["ts"] for r in run.of("fault_injected"))
    [waiting] = run.of("waiting_for_nodes")
    assert waiting["node_rank"] == 0 and waiting["until"] is not None and waiting["ts"] > second
    assert "the test adds a spare" in waiting["why"]
    assert [r["node_rank"] for r in run.of("spare_promoted")] == [2, 3]
    finals = {r["node_rank"]: r["failure_class"] for r in run.of("final")}
    assert finals == {0: "success", 3: "success"}, finals
    assert {r["world_size"] for r in run.of("train_begin")} == {2}


def test_a_spare_that_hangs_when_a_node_is_lost_is_not_waited_for(tmp_path, dataset):
    """The spare's node hangs (every process of it stopped) before node 1 is lost. Its launcher
    stops beating, so it counts as no spare: node 0 ends the launch as for a loss no spare
    covers, instead of waiting for a spare that never comes."""
    cfg = write_config(
        tmp_path,
        dataset,
        "hungspare",
        steps=40,
        nodes=2,
        procs_per_node=1,
        spare_nodes=1,
        faults=[{"kind": "node_loss", "step": 12, "node": 1, "attempt": None, "once": True}],
    )
    cfg_path = tmp_path / f"{cfg.run_id}.json"
    nodes = [launch(cfg, cfg_path, node_rank=i) for i in range(3)]
    stopped: list[int] = []
    try:
        deadline = time.time() + 240
        while not [r for r in read_events(cfg.layout.events, "step") if r["step"] >= 2] and time.time() < deadline:
            time.sleep(0.2)
        spare = nodes[2].pid
        for pid in [spare] + [p for p, _ in launch_processes(spare)]:
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)
        codes = [p.wait(timeout=240) for p in nodes[:2]]
    finally:
        for p in nodes:
            p.kill()
        for pid in stopped:  # the spare's processes end once they run again (parent-death signals)
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    logs = "\n".join(cfg_path.with_suffix(f".node{i}.log").read_text()[-2500:] for i in range(3))
    assert codes == [75, -9], logs
    run = Run(cfg, 0, logs)
    [lost] = run.of("fault_injected")
    [waiting] = run.of("waiting_for_nodes")
    assert waiting["missing_node_ranks"] == [1] and waiting["until"] is None
    [final] = [r for r in run.of("final") if r["node_rank"] == 0]
    assert final["failure_class"] == "restarts_exhausted" and final["ts"] - lost["ts"] < 60, (final, lost)
