"""Where a training worker sits (fsdp_resilience.training.train.env)."""

from __future__ import annotations

from fsdp_resilience.training.faults import NODE_RANK_ENV
from fsdp_resilience.training.train.env import WorkerEnv

WORKER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", NODE_RANK_ENV, "GROUP_RANK", "TORCHELASTIC_RESTART_COUNT")


def test_a_worker_started_by_hand_is_rank_0_of_1(monkeypatch):
    for var in WORKER_VARS:
        monkeypatch.delenv(var, raising=False)
    assert WorkerEnv.from_environ() == WorkerEnv(rank=0, local_rank=0, world_size=1, node_rank=0, attempt=0)


def test_the_node_is_the_launched_one_not_the_rendezvous_order(monkeypatch):
    for var, value in (
        ("RANK", "5"),
        ("LOCAL_RANK", "1"),
        ("WORLD_SIZE", "8"),
        ("GROUP_RANK", "3"),
        ("TORCHELASTIC_RESTART_COUNT", "2"),
    ):
        monkeypatch.setenv(var, value)
    monkeypatch.delenv(NODE_RANK_ENV, raising=False)
    assert WorkerEnv.from_environ() == WorkerEnv(rank=5, local_rank=1, world_size=8, node_rank=3, attempt=2)
    monkeypatch.setenv(NODE_RANK_ENV, "2")  # what fsdp_resilience.training.launch set
    assert WorkerEnv.from_environ().node_rank == 2


def test_the_worker_env_needs_no_torch():
    import subprocess
    import sys

    code = "import sys; sys.modules['torch'] = None\nimport fsdp_resilience.training.train.env\nprint('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
