"""Each rank's torch RNG (dropout): its seed, and its state saved per rank in every checkpoint, so
a resume replays bitwise."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp

from fsdp_resilience.training.contract import CheckpointInfo
from fsdp_resilience.training.model import name_seed


def rank_seed(seed: int, rank: int, step: int = 0) -> int:
    """The seed of ``rank``'s torch RNG (dropout) when no saved state applies: derived from the run's
    ``seed``, the global rank and the step training starts at (0 for a fresh run), through
    SHA-256 (``model.name_seed``), so every rank draws its own stream and runs replay exactly.

    A checkpoint holds each rank's RNG state, restored on resume. When the world size changed
    since the save, no saved state belongs to a rank any more, and every rank re-seeds with the
    step it resumes at: deterministic, and not a replay of the streams of step 0."""
    return name_seed(seed, f"torch-rng/rank{rank}/step{step}")


def rank_rng_key(rank: int) -> str:
    """A rank's RNG entry under ``trainer.rng``. DCP stores one copy of a key that every rank
    saves (it treats it as replicated), so each rank's state lives under its own key."""
    return f"rank_{rank:05d}"


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def saved_rng_ranks(checkpoint: CheckpointInfo) -> set[int]:
    """The ranks whose RNG state checkpoint ``checkpoint`` holds (read from its DCP metadata)."""
    metadata = dcp.FileSystemReader(str(checkpoint.path)).read_metadata()
    ranks = set()
    for key in metadata.state_dict_metadata:
        parts = key.split(".")
        if parts[:2] == ["trainer", "rng"] and len(parts) > 2 and parts[2].startswith("rank_"):
            ranks.add(int(parts[2][len("rank_") :]))
    return ranks


def restore_rng(
    resumed: CheckpointInfo | None, start: int, *, seed: int, rank: int, world_size: int, device: torch.device
) -> str:
    """Set this rank's torch RNG: its saved state when ``resumed`` holds one for every rank of
    this world size ("restored"), else ``rank_seed`` ("seeded"). Every rank decides alike
    (from the same metadata), so the load below is entered by all of them or none."""
    if resumed is not None and saved_rng_ranks(resumed) == set(range(world_size)):
        key = rank_rng_key(rank)
        state = {"trainer": {"rng": {key: rng_state(device)}}}
        dcp.load(state, checkpoint_id=str(resumed.path))
        set_rng_state(state["trainer"]["rng"][key], device)
        return "restored"
    torch.manual_seed(rank_seed(seed, rank, start))  # seeds CUDA's generators too
    return "seeded" if resumed is None else "reseeded"
