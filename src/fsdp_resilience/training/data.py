"""Token shards and a deterministic, resumable batch sampler.

Dataset folder (written by ``python -m fsdp_resilience.training.prepare_data SRC DST``; format "byte-tokens-v1")::

    index.json = {"format": "byte-tokens-v1", "dtype": "uint16", "vocab_size": 256,
                  "train": [{"file": "train_00000.bin", "tokens": N}, ...],
                  "val":   [{"file": "val_00000.bin", "tokens": M}, ...],
                  "source": ..., "created_at": ..., (and separator, files, sha256, params)}
    *.bin      = raw little-endian uint16 tokens, read as a numpy memmap

Sampling: each shard is cut into non-overlapping windows of seq_len + 1 tokens (inputs and the
targets shifted by one) that start every seq_len tokens; windows never cross shards. An epoch
visits all windows in the order of ``numpy.random.default_rng(seed + epoch).permutation``. Each
global step consumes world_size * batch_size consecutive windows of that order, rank r taking
the r-th batch_size of them; an epoch's remainder smaller than a global step is skipped. The
sampler's state is just (epoch, position in the order): the same on every rank, independent of
world size, and resuming from it replays exactly the batches an uninterrupted run would see.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from fsdp_resilience.training.contract import DATASET_INDEX as INDEX_FILE
from fsdp_resilience.training.contract import DATASET_SPLITS as SPLITS
from fsdp_resilience.training.contract import HOW_TO_PREPARE, DatasetError, read_dataset_index


class TokenShards:
    """The memmapped shards of one split, addressed as windows of seq_len + 1 tokens."""

    def __init__(self, dataset_dir: str | os.PathLike, split: str):
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        self.dataset_dir = Path(dataset_dir)
        self.split = split
        index = read_dataset_index(dataset_dir)
        entries = index.get(split)
        if not isinstance(entries, list) or not entries:
            raise DatasetError(f"{self.dataset_dir / INDEX_FILE} lists no {split} shards; {HOW_TO_PREPARE}")
        self.shards: list[np.memmap] = []
        for entry in entries:
            self.shards.append(self._open(entry))

    def _open(self, entry: dict) -> np.memmap:
        try:
            path, tokens = self.dataset_dir / entry["file"], int(entry["tokens"])
        except (KeyError, TypeError, ValueError):
            raise DatasetError(
                f"bad shard entry {entry!r} in {self.dataset_dir / INDEX_FILE}; {HOW_TO_PREPARE}"
            ) from None
        try:
            size = path.stat().st_size
        except OSError:
            raise DatasetError(f"shard {path} is missing; {HOW_TO_PREPARE}") from None
        if tokens <= 0 or size < 2 * tokens:
            raise DatasetError(
                f"shard {path} holds {size // 2} tokens but the index says {tokens} (truncated?); {HOW_TO_PREPARE}"
            )
        return np.memmap(path, dtype="<u2", mode="r", shape=(tokens,))

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self.shards)

    def windows_per_shard(self, seq_len: int) -> np.ndarray:
        return np.array([max(len(s) - 1, 0) // seq_len for s in self.shards], dtype=np.int64)

    def windows(self, indices: np.ndarray, seq_len: int) -> np.ndarray:
        """Windows ``indices`` (global window numbers), as int64 [len(indices), seq_len + 1]."""
        ends = np.cumsum(self.windows_per_shard(seq_len))
        out = np.empty((len(indices), seq_len + 1), dtype=np.int64)
        for row, index in enumerate(indices):
            shard = int(np.searchsorted(ends, index, side="right"))
            start = (int(index) - (int(ends[shard - 1]) if shard else 0)) * seq_len
            out[row] = self.shards[shard][start : start + seq_len + 1]
        return out


def _to_batch(rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.from_numpy(rows)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


class BatchSampler:
    """This rank's training batches; see the module docstring for the order."""

    def __init__(self, shards: TokenShards, seq_len: int, batch_size: int, rank: int, world_size: int, seed: int):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
        self.shards, self.seq_len, self.batch_size = shards, seq_len, batch_size
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.num_windows = int(shards.windows_per_shard(seq_len).sum())
        self.global_batch = world_size * batch_size
        if self.num_windows < self.global_batch:
            raise DatasetError(
                f"the {shards.split} split of {shards.dataset_dir} has {self.num_windows} sequences of "
                f"{seq_len + 1} tokens, fewer than one global batch ({world_size} ranks x {batch_size}); "
                "use more data or a smaller seq_len/batch_size"
            )
        self.epoch, self.position = 0, 0
        self._order_epoch, self._order = -1, np.empty(0, dtype=np.int64)

    def _epoch_order(self) -> np.ndarray:
        if self._order_epoch != self.epoch:  # one permutation per epoch, computed once
            self._order = np.random.default_rng(self.seed + self.epoch).permutation(self.num_windows)
            self._order_epoch = self.epoch
        return self._order

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets): LongTensors [batch_size, seq_len]; targets are inputs shifted by one."""
        if self.position + self.global_batch > self.num_windows:
            self.epoch, self.position = self.epoch + 1, 0
        start = self.position + self.rank * self.batch_size
        indices = self._epoch_order()[start : start + self.batch_size]
        self.position += self.global_batch
        return _to_batch(self.shards.windows(indices, self.seq_len))

    def state_dict(self) -> dict[str, int]:
        return {"epoch": int(self.epoch), "position": int(self.position)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= self.num_windows:
            raise ValueError(f"sampler state {state} does not fit this dataset ({self.num_windows} sequences)")
        self.epoch, self.position = epoch, position


def validation_batches(
    dataset_dir: str | os.PathLike, seq_len: int, batch_size: int, n_batches: int, rank: int, world_size: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Up to ``n_batches`` batches of the val split for this rank, in file order (no shuffle).

    Batch j of rank r holds windows (j * world_size + r) * batch_size onwards, so ranks never
    overlap. Fewer batches come back if the split is too small for n_batches global batches.
    """
    shards = TokenShards(dataset_dir, "val")
    num_windows = int(shards.windows_per_shard(seq_len).sum())
    global_batch = world_size * batch_size
    available = num_windows // global_batch
    if available == 0:
        raise DatasetError(
            f"the val split of {dataset_dir} has {num_windows} sequences of {seq_len + 1} tokens, "
            f"fewer than one global batch ({world_size} ranks x {batch_size})"
        )
    batches = []
    for j in range(min(n_batches, available)):
        start = (j * world_size + rank) * batch_size
        batches.append(_to_batch(shards.windows(np.arange(start, start + batch_size), seq_len)))
    return batches
