"""Checkpoints you can trust (issue 11), with real processes: 2 gloo ranks, FSDP2, NVRx's writer
processes, real damage to real checkpoint files, real SIGSTOP/SIGKILL. Nothing is mocked.

- every file of a commit is listed with its size and CRC32C, computed by the writers;
- a save without a rank's checksums is not committed;
- resume verifies before it trusts: flipped bytes in model weights and in optimizer state, a
  deleted shard, a damaged ``.metadata``, a garbage or dangling ``latest`` pointer, a checkpoint
  that verifies but fails to load: each falls back to the newest earlier one that verifies and
  loads, on every rank alike, with a quarantine record and an event saying why;
- retention keeps the newest checkpoint known to verify, even below a newer damaged one;
- a stopped (stuck) writer is killed and replaced within its bound, mid-save and after a restart,
  and nothing it forked outlives it (the writer process alone: test_checkpoint_writer_process.py);
- a save whose model did not change while the step advanced is flagged stale.

One 2-rank scenario runs once per module; each test checks one of its phases.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from test_checkpoint import _flat, _mismatches, _running

from fsdp_resilience.training.checkpointing.resume import CheckpointMismatchError, load_latest
from fsdp_resilience.training.contract import (
    COMMIT_MARKER,
    QUARANTINE_RECORD,
    CheckpointCatalog,
    Event,
    EventLog,
    RunDir,
    atomic_write_text,
    checkpoint_files,
    file_checksum,
    read_commit_marker,
    read_events,
)

from shared import run_on_two_ranks

WIDTH, DEPTH = 256, 4
STALL_S = 5.0  # the writers' stall bound in the scenario


# --------------------------------------------------------------------------------------------
# The 2-rank scenario
# --------------------------------------------------------------------------------------------


def _build_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])


def _flip(path: Path, offset: int, n: int = 16) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        data = f.read(n)
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in data))


def _region(step_dir: Path, fqn_prefix: str, file_name: str) -> tuple[str, int]:
    """The middle of the first stored item named ``fqn_prefix...`` in ``file_name`` (DCP metadata)."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(step_dir)).read_metadata()
    for index, info in sorted(metadata.storage_data.items(), key=lambda kv: kv[0].fqn):
        if index.fqn.startswith(fqn_prefix) and info.relative_path == file_name and info.length > 64:
            return index.fqn, info.offset + info.length // 2
    raise AssertionError(f"no {fqn_prefix}* item in {file_name}")


def _run_scenario(rank: int, port: int, tmp: Path) -> dict[str, Any]:
    """Everything one rank does, phase by phase; returns what each phase saw."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fsdp_resilience.training.checkpointing.checkpointer import AsyncCheckpointer
    from fsdp_resilience.training.checkpointing.rounds import CheckpointWriterError
    from fsdp_resilience.training.checkpointing.snapshot import app_state

    run_dir = tmp / "run"
    layout = RunDir(run_dir)
    events = EventLog(layout.events, rank=rank)
    ckpt = AsyncCheckpointer(run_dir, rank=rank, world_size=2, events=events, keep=100, writer_stall_s=STALL_S)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=120)
    )
    ckpt.rebind()
    mesh = init_device_mesh("cpu", (2,))

    def sharded_model(seed: int) -> torch.nn.Module:
        model = _build_model(seed)
        for layer in model:
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    model = sharded_model(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = torch.Generator().manual_seed(100 + rank)
    expected: dict[int, dict[str, Any]] = {}
    results: dict[str, Any] = {"rank": rank}

    def train(steps: int = 1) -> None:
        for _ in range(steps):
            model(torch.randn(8, WIDTH, generator=batches)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()

    def state(step: int) -> dict[str, Any]:
        return app_state(model, optimizer, {"step": step, "rng": torch.get_rng_state()})

    def save(step: int) -> list[int]:
        expected[step] = _flat(state(step))
        ckpt.save(step, state(step))
        return [c.step for c in ckpt.wait()]

    def train_and_save(steps: list[int]) -> list[int]:
        committed = []
        for step in steps:
            train()
            committed += save(step)
        return committed

    def resume() -> dict[str, Any]:
        """What a restarted rank does: a fresh model, the newest checkpoint that verifies and loads."""
        fresh_model = sharded_model(7)
        fresh_optimizer = torch.optim.AdamW(fresh_model.parameters(), lr=1e-3)
        fresh_model(torch.randn(8, WIDTH)).square().mean().backward()
        fresh_optimizer.step()  # so the optimizer state exists to be loaded into
        fresh = app_state(fresh_model, fresh_optimizer, {"step": -1, "rng": torch.zeros_like(torch.get_rng_state())})
        info = load_latest(run_dir, fresh, events=events)
        loaded = _flat(fresh)
        return {
            "step": info.step if info else None,
            "mismatches": _mismatches(expected[info.step], loaded) if info else None,
        }

    def damage(what) -> None:
        """Rank 0 damages the run dir while every rank waits; then all resume."""
        dist.barrier()
        if rank == 0:
            what()
        dist.barrier()

    # S. Saves with training in between; then one whose rank-1 checksums vanish before the commit.
    results["S"] = {"committed": train_and_save([2, 4, 6, 8, 10])}
    ckpt.save(11, state(11))
    if rank == 1:
        sums = layout.checkpoint_dir(11) / ".sums" / "rank_00001.json"
        while not sums.exists():  # the writer writes them right after its shard
            time.sleep(0.01)
        sums.unlink()
    dist.barrier()
    try:
        ckpt.wait()
        results["S"]["nosums_error"] = None
    except CheckpointWriterError as e:
        results["S"]["nosums_error"] = {"message": str(e), "failed_ranks": list(e.failed_ranks)}
    results["S"]["nosums_marker"] = (layout.checkpoint_dir(11) / COMMIT_MARKER).exists()

    # T. Stale: step 12 saves the same model as step 10 (no training since); later saves train.
    results["T"] = {"committed": save(12) + train_and_save([14, 16, 18, 20])}

    # D. Damage, newest first; each resume must land on the newest older one that verifies + loads.
    def flip_model() -> None:
        fqn, offset = _region(layout.checkpoint_dir(20), "model.", "__1_0.distcp")
        _flip(layout.checkpoint_dir(20) / "__1_0.distcp", offset)

    def flip_optim() -> None:
        fqn, offset = _region(layout.checkpoint_dir(18), "optim.state.", "__0_0.distcp")
        _flip(layout.checkpoint_dir(18) / "__0_0.distcp", offset)

    def delete_shard() -> None:
        (layout.checkpoint_dir(16) / "__1_0.distcp").unlink()

    def damage_metadata() -> None:
        path = layout.checkpoint_dir(14) / ".metadata"
        _flip(path, path.stat().st_size // 2)

    def garbage_latest() -> None:
        layout.latest_pointer.write_bytes(b"\x00garbage\xff\n")

    def dangling_latest() -> None:
        atomic_write_text(layout.latest_pointer, "step_99999999\n")

    def verifies_but_does_not_load() -> None:
        # Rank 1's shard rewritten with noise, and the marker rewritten to match: verification
        # passes; DCP's read fails on rank 1 only, and both ranks must agree.
        path = layout.checkpoint_dir(12)
        shard = path / "__1_0.distcp"
        shard.write_bytes(os.urandom(shard.stat().st_size))
        marker = read_commit_marker(path)
        marker["files"]["__1_0.distcp"] = file_checksum(shard)
        atomic_write_text(path / COMMIT_MARKER, json.dumps(marker))

    results["D"] = {}
    for name, what in [
        ("flip_model", flip_model),
        ("flip_optim", flip_optim),
        ("delete_shard", delete_shard),
        ("damage_metadata", damage_metadata),
        ("garbage_latest", garbage_latest),
        ("dangling_latest", dangling_latest),
        ("load_fails", verifies_but_does_not_load),
    ]:
        damage(what)
        results["D"][name] = resume()
    ckpt.trust(results["D"]["load_fails"]["step"])  # as train/loop.py does after a resume

    # R. Retention keeps our newest commit although a newer committed checkpoint exists that is
    # damaged (here: a copy of step 10 as step 90 with flipped bytes, sizes intact).
    def newer_damaged_copy() -> None:
        shutil.copytree(layout.checkpoint_dir(10), layout.checkpoint_dir(90))
        _flip(layout.checkpoint_dir(90) / "__0_0.distcp", 200)

    damage(newer_damaged_copy)
    ckpt.keep = 1
    train()
    committed_32 = save(32)
    if rank == 0:
        deadline = time.monotonic() + 60
        # Retention runs in the background and deletes the oldest first: step 10 goes last.
        while layout.checkpoint_dir(10).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    dist.barrier()
    results["R"] = {
        "committed_32": committed_32,
        "trusted": ckpt.trusted_step,
        "after_retention": [c.step for c in CheckpointCatalog(run_dir).committed()],
    }

    # W. A stopped writer mid-save: the save fails on every rank within the bound, the writer is
    # replaced, the next save commits.
    stopped = []
    train()
    if rank == 1:
        stopped += ckpt.writer_pids()
        os.kill(stopped[-1], signal.SIGSTOP)
    expected[34] = _flat(state(34))
    ckpt.save(34, state(34))
    began = time.monotonic()
    error = None
    try:
        ckpt.wait()
    except CheckpointWriterError as e:
        error = {"message": str(e), "failed_ranks": list(e.failed_ranks)}
    raised_after_s = time.monotonic() - began
    old_gone = [p for p in stopped if not _running(p)]
    train()
    results["W"] = {
        "error": error,
        "raised_after_s": raised_after_s,
        "stopped": list(stopped),
        "old_gone": old_gone,
        "new_writer": ckpt.writer_pids(),
        "torn_34": not (layout.checkpoint_dir(34) / COMMIT_MARKER).exists(),
        "next": save(36),
    }

    # X. The same after a restart: the save is abandoned, the group replaced; the next save must
    # not wait on the stopped writer longer than the bound.
    train()
    if rank == 1:
        stopped += ckpt.writer_pids()
        os.kill(stopped[-1], signal.SIGSTOP)
    ckpt.save(38, state(38))
    abandoned = ckpt.abandon_pending()
    group = dist.new_group(ranks=[0, 1], backend="gloo")
    ckpt.rebind(group)
    train()
    began = time.monotonic()
    expected[40] = _flat(state(40))
    ckpt.save(40, state(40))
    settle_s = time.monotonic() - began
    results["X"] = {
        "abandoned": abandoned,
        "settle_s": settle_s,
        "committed": [c.step for c in ckpt.wait()],
        "new_writer": ckpt.writer_pids(),
        "stopped": list(stopped),
    }

    # F. Close, then resume once more: step 90 (damaged) is quarantined, 40 loads.
    started = ckpt.helper_pids()
    ckpt.close()
    results["F"] = {
        "started": started,
        "alive_after_close": [p for p in started + stopped if _running(p)],
        "children_left": [],
    }
    for child in psutil.Process().children(recursive=True):
        try:
            results["F"]["children_left"].append(" ".join(child.cmdline())[-200:])
        except psutil.NoSuchProcess:
            pass
    results["F"]["resume"] = resume()
    dist.destroy_process_group()
    return results


@pytest.fixture(scope="module")
def scenario(tmp_path_factory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("trust")
    return {"tmp": tmp, "layout": RunDir(tmp / "run"), **run_on_two_ranks(_run_scenario, tmp, timeout_s=420)}


def _quarantined(scenario) -> dict[int, dict]:
    return {r["step"]: r for r in CheckpointCatalog(scenario["layout"]).quarantined()}


@pytest.mark.slow
def test_commit_marker_lists_every_file_with_its_checksum(scenario):
    assert scenario[0]["S"]["committed"] == [2, 4, 6, 8, 10]
    # The checkpoints that survived the scenario untouched: 40 (and, in quarantine, the originals).
    for info in CheckpointCatalog(scenario["layout"]).committed():
        marker = read_commit_marker(info.path)
        assert marker["checksum"] == "crc32c" and marker["world_size"] == 2
        assert sorted(marker["files"]) == checkpoint_files(info.path)
        assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(marker["files"])
        for name, recorded in marker["files"].items():
            assert file_checksum(info.path / name) == recorded, name
        assert len(marker["model_crc32c"]) == 2


@pytest.mark.slow
def test_a_save_without_a_ranks_checksums_is_not_committed(scenario):
    for r in range(2):
        s = scenario[r]["S"]
        assert s["nosums_error"] is not None, f"rank {r} committed a save without rank 1's checksums"
        assert "could not commit step_00000011" in s["nosums_error"]["message"]
        assert not s["nosums_marker"]
    assert "no checksums from rank(s) [1]" in scenario[0]["S"]["nosums_error"]["message"]  # rank 0 knows why


@pytest.mark.slow
def test_each_damage_falls_back_to_the_newest_verified_checkpoint(scenario):
    want = {
        "flip_model": 18,
        "flip_optim": 16,
        "delete_shard": 14,
        "damage_metadata": 12,
        "garbage_latest": 12,
        "dangling_latest": 12,
        "load_fails": 10,
    }
    for case, step in want.items():
        for r in range(2):
            got = scenario[r]["D"][case]
            assert got["step"] == step, f"{case}: rank {r} resumed from {got['step']}, not {step}"
            assert got["mismatches"] == [], f"{case}: rank {r} loaded state that differs from step {step}'s"
    quarantined = _quarantined(scenario)
    reasons = {step: quarantined[step]["reason"] for step in (20, 18, 16, 14, 12)}
    assert "rank 1: __1_0.distcp fails its crc32c check" in reasons[20]  # rank 1 checksums its own shard
    assert "rank 0: __0_0.distcp fails its crc32c check" in reasons[18]
    assert "__1_0.distcp is missing" in reasons[16]
    assert "rank 0: .metadata fails its crc32c check" in reasons[14]
    # DCP raises on both ranks: the reason says which reads failed, and how.
    assert reasons[12].startswith("load failed: rank 0: DCP's read failed on rank(s)") and "Error" in reasons[12]
    assert [quarantined[s]["phase"] for s in (20, 18, 16, 14, 12)] == ["verify"] * 4 + ["load"]
    for record in quarantined.values():
        assert Path(record["path"], QUARANTINE_RECORD).is_file() and Path(record["path"], ".metadata").exists()
    events = read_events(scenario["layout"].events, Event.CHECKPOINT_QUARANTINED)
    assert [(e["step"], e["reason"]) for e in events[:5]] == [(s, reasons[s]) for s in (20, 18, 16, 14, 12)]
    assert all(e["rank"] == 0 and e["moved_to"] for e in events)


@pytest.mark.slow
def test_nothing_committed_and_verified_is_lost(scenario):
    """Every checkpoint ever committed is committed still, in quarantine (damaged here), or was
    removed by retention only after a newer verified one was committed."""
    layout = scenario["layout"]
    commits = [e["step"] for e in read_events(layout.events, Event.CHECKPOINT_COMMIT)]
    assert commits == [2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 32, 36, 40]
    assert [c.step for c in CheckpointCatalog(layout).committed()] == [40]
    assert sorted(_quarantined(scenario)) == [12, 14, 16, 18, 20, 90]
    assert scenario[0]["F"]["resume"] == {"step": 40, "mismatches": []}
    assert scenario[1]["F"]["resume"] == {"step": 40, "mismatches": []}


@pytest.mark.slow
def test_retention_keeps_the_newest_verified_checkpoint_below_a_newer_damaged_one(scenario):
    r = scenario[0]["R"]
    assert r["committed_32"] == [32] and r["trusted"] == 32
    # keep=1 would keep only step 90 (newer, damaged, its sizes intact): 32 is protected.
    assert r["after_retention"] == [32, 90]


@pytest.mark.slow
def test_a_stopped_writer_is_replaced_and_the_next_save_commits(scenario):
    for r in range(2):
        w = scenario[r]["W"]
        assert w["error"] is not None, f"rank {r}: the save on a stopped writer did not fail"
        assert w["error"]["failed_ranks"] == [1] and "writer process died or stalled" in w["error"]["message"]
        assert w["raised_after_s"] < STALL_S + 30, w["raised_after_s"]  # the bound, with a loaded box's slack
        assert w["torn_34"] and w["next"] == [36]
    rank1 = scenario[1]["W"]
    assert "made no progress" in rank1["error"]["message"]  # the rank whose writer stalled says how
    assert rank1["old_gone"] == rank1["stopped"], "the stopped writer was not killed"
    assert rank1["new_writer"] and rank1["new_writer"] != rank1["stopped"]
    print(f"\n[stopped writer] save failed after {rank1['raised_after_s']:.1f}s (writer_stall_s={STALL_S})")


@pytest.mark.slow
def test_after_a_restart_the_stuck_writer_is_not_waited_on_again(scenario):
    for r in range(2):
        x = scenario[r]["X"]
        assert x["abandoned"] == 38 and x["committed"] == [40]
        assert x["settle_s"] < STALL_S + 60, x["settle_s"]
    rank1 = scenario[1]["X"]
    assert rank1["new_writer"] and rank1["new_writer"][0] not in rank1["stopped"]
    assert not (scenario["layout"].checkpoint_dir(38) / COMMIT_MARKER).exists()


@pytest.mark.slow
def test_close_leaves_no_process_stopped_or_alive(scenario):
    for r in range(2):
        f = scenario[r]["F"]
        assert f["alive_after_close"] == []
        assert all("resource_tracker" in c for c in f["children_left"]), f["children_left"]


@pytest.mark.slow
def test_a_save_of_an_unchanged_model_is_flagged_stale(scenario):
    stale = read_events(scenario["layout"].events, Event.CHECKPOINT_STALE)
    assert [(e["step"], e["checkpoint_id"], e["same_as"]) for e in stale] == [(12, "step_00000012", "step_00000010")]


@pytest.mark.slow
def test_evaluation_without_a_group_quarantines_and_reports_nothing_verified(scenario, tmp_path):
    """One process, no process group (as evaluation runs): a damaged only checkpoint is
    quarantined, nothing is loaded, and the skip says why."""
    layout = RunDir(tmp_path / "run")
    layout.create()
    shutil.copytree(scenario["layout"].checkpoint_dir(40), layout.checkpoint_dir(40))
    plain = _build_model(seed=3)
    state = {"model": plain.state_dict()}
    before = {k: v.clone() for k, v in state["model"].items()}
    _flip(layout.checkpoint_dir(40) / "__1_0.distcp", 300)
    events = EventLog(layout.events)
    assert load_latest(layout.root, state, events=events) is None
    assert all(torch.equal(before[k], v) for k, v in plain.state_dict().items())
    (record,) = CheckpointCatalog(layout).quarantined()
    assert "__1_0.distcp fails its crc32c check" in record["reason"]
    skips = read_events(layout.events, Event.CHECKPOINT_SKIP)
    assert skips and "starting from scratch" in skips[-1]["reason"]


@pytest.mark.slow
def test_another_model_is_a_mismatch_not_damage(scenario, tmp_path):
    layout = RunDir(tmp_path / "run")
    layout.create()
    shutil.copytree(scenario["layout"].checkpoint_dir(40), layout.checkpoint_dir(40))
    other = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH * 2) for _ in range(DEPTH)])
    with pytest.raises(CheckpointMismatchError, match="shape"):
        load_latest(layout.root, {"model": other.state_dict()})
    assert CheckpointCatalog(layout).quarantined() == []
    assert [c.step for c in CheckpointCatalog(layout).committed()] == [40]


@pytest.mark.slow
def test_evaluation_verifies_the_model_bytes_it_loads_and_never_reads_the_optimizers(scenario, tmp_path):
    """Evaluation reads the model's bytes of a 2-rank checkpoint straight into a plain model's
    parameters and checks them against the digests the commit recorded: damaged optimizer state
    (which a resume rejects) does not stop it, a damaged model byte does."""
    from torch.distributed.checkpoint import load as dcp_load

    from fsdp_resilience.training.contract import verify_checkpoint
    from fsdp_resilience.training.evaluate import UntrustedCheckpoint, load_into

    layout = RunDir(tmp_path / "run")
    layout.create()
    shutil.copytree(scenario["layout"].checkpoint_dir(40), layout.checkpoint_dir(40))
    info = CheckpointCatalog(layout).latest()
    expected = {"model": _build_model(seed=3).state_dict()}
    dcp_load(expected, checkpoint_id=str(info.path))

    _, at = _region(info.path, "optim.", "__0_0.distcp")
    _flip(info.path / "__0_0.distcp", at)
    assert "__0_0.distcp fails its crc32c check" in verify_checkpoint(info.path)
    model = _build_model(seed=4)
    assert load_into(info, model.state_dict()) == "model digests"
    assert all(torch.equal(v, expected["model"][k]) for k, v in model.state_dict().items())
    _flip(info.path / "__0_0.distcp", at)  # flipped back: only the model byte below is damaged
    assert verify_checkpoint(info.path) is None

    _, at = _region(info.path, "model.", "__1_0.distcp")
    _flip(info.path / "__1_0.distcp", at)
    with pytest.raises(UntrustedCheckpoint, match="__1_0.distcp fails its crc32c check"):
        load_into(info, _build_model(seed=5).state_dict())
