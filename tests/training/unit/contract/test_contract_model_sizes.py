"""The presets' sizes (contract/model_sizes.py): torch-free, one source for both planes, and the
host-memory estimate the EKS pods' /dev/shm is sized from."""

from __future__ import annotations

import pytest

from fsdp_resilience.training.contract import GIB, MODEL_PRESETS, PRESETS, host_memory_for_preset, param_count


def test_the_presets_are_the_run_configs_choices_and_the_model_uses_these_very_objects():
    assert tuple(PRESETS) == MODEL_PRESETS
    from fsdp_resilience.training import model

    assert model.PRESETS is PRESETS and model.param_count is param_count


def test_8b_under_hsdp_needs_more_than_64gi_of_dev_shm_on_any_number_of_nodes():
    """HSDP holds a whole replica of the weights and both AdamW moments on every node (about
    87 GiB for 8b), so the old 64Gi default could never hold an 8b save."""
    for nodes in (2, 16, 128, 1024):
        need = host_memory_for_preset("8b", nodes, 8)
        assert need["checkpoint_staging"] == 12 * param_count(PRESETS["8b"])
        assert 86 * GIB < need["checkpoint_staging"] < 88 * GIB
        assert need["shm"] > 64 * GIB
        assert need["shm"] == need["checkpoint_staging"] + 8 * GIB  # + 1 GiB a rank for NCCL and friends
        assert need["total"] == need["shm"] + need["processes"] < 200 * GIB  # far below a p5's 2 TiB


def test_one_rank_a_node_is_plain_fsdp_and_a_node_holds_its_share():
    one = host_memory_for_preset("8b", 1, 1)["checkpoint_staging"]
    assert host_memory_for_preset("8b", 4, 1)["checkpoint_staging"] == one // 4
    assert host_memory_for_preset("8b", 1, 8)["checkpoint_staging"] == one  # one node: FSDP over its 8 ranks


def test_smaller_presets_fit_small_shm():
    assert host_memory_for_preset("1b", 2, 8)["shm"] < 24 * GIB
    assert host_memory_for_preset("tiny", 1, 2)["checkpoint_staging"] < 16 * 2**20


def test_bad_input_says_what_is_wrong():
    with pytest.raises(ValueError, match="unknown model preset '70b'"):
        host_memory_for_preset("70b", 2, 8)
    with pytest.raises(ValueError, match="nodes=0"):
        host_memory_for_preset("8b", 0, 8)
