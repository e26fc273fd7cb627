"""Each rank's RNG (fsdp_resilience.training.train.rng)."""

from __future__ import annotations

import torch

from fsdp_resilience.training.train.rng import rank_rng_key, rank_seed, restore_rng, rng_state, set_rng_state


def test_every_rank_and_start_step_gets_its_own_reproducible_seed():
    seeds = {rank_seed(7, rank, step) for rank in range(4) for step in (0, 100)}
    assert len(seeds) == 8
    assert rank_seed(7, 1) == rank_seed(7, 1, 0) == rank_seed(7, 1, 0)
    assert rank_seed(7, 1) != rank_seed(8, 1)


def test_each_rank_saves_its_rng_under_its_own_key():
    assert rank_rng_key(3) == "rank_00003"
    assert rank_rng_key(3) != rank_rng_key(30)


def test_an_rng_state_restores_the_same_draws():
    device = torch.device("cpu")
    state = rng_state(device)
    assert set(state) == {"cpu"}
    first = torch.rand(4)
    set_rng_state(state, device)
    assert torch.equal(torch.rand(4), first)


def test_a_fresh_run_seeds_from_the_rank_and_step():
    device = torch.device("cpu")
    assert restore_rng(None, 0, seed=5, rank=1, world_size=2, device=device) == "seeded"
    drawn = torch.rand(3)
    torch.manual_seed(rank_seed(5, 1, 0))
    assert torch.equal(torch.rand(3), drawn)
