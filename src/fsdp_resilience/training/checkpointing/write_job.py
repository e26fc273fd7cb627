"""What the writer process does for one save: NVRx's write, then the checksums the commit needs.

``write_then_checksum`` runs in the writer, off the training loop: NVRx's write, then the size and
CRC32C of every file this rank wrote (``contract.write_rank_sums``: the commit requires them) and a
CRC32C of the model's bytes (``model_digest``; rank 0 compares it with the previous commit's to flag
a stale save), all before the trainer hears that the write finished. The model digest and what
checksumming cost are this rank's writer record (``write_writer_record``), beside its checksums.
"""

from __future__ import annotations

import json
import os
import queue as queue_lib
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import crc32c
import torch

from fsdp_resilience.training.contract import SUMS_DIR, atomic_write_text, write_rank_sums

#: Beside each rank's checksums in ``.sums/``: its model digest and what checksumming cost.
WRITER_RECORD = "writer_rank_{rank:05d}.json"


def model_digest(tensors: Iterable[tuple[str, tuple, torch.Tensor]]) -> tuple[str, int]:
    """CRC32C over the bytes of ``(fqn, offset, tensor)`` host tensors in fqn/offset order, and
    how many bytes that was. Equal digests of two saves mean the model did not change."""
    value, nbytes = 0, 0
    for _, _, tensor in sorted(tensors, key=lambda t: (t[0], t[1])):
        if tensor.numel() == 0:
            continue
        data = tensor.detach().contiguous().view(-1).view(torch.uint8).numpy()
        value = crc32c.crc32c(data, value)
        nbytes += data.nbytes
    return f"{value:08x}", nbytes


def _model_tensors(buckets: Any) -> Iterable[tuple[str, tuple, torch.Tensor]]:
    """The model's tensors in NVRx write buckets: ``(path, name, (bytes_items, tensor_items))``."""
    for _path, _name, (_bytes, tensors) in buckets or ():
        for item, tensor in tensors:
            if item.index.fqn.startswith("model."):
                yield item.index.fqn, tuple(item.index.offset or ()), tensor


def write_writer_record(path: str | os.PathLike, rank: int, **record: Any) -> None:
    """``.sums/writer_rank_NNNNN.json``: this rank's model digest and checksum cost."""
    folder = Path(path) / SUMS_DIR
    folder.mkdir(exist_ok=True)  # never parents: a removed checkpoint folder stays removed
    atomic_write_text(folder / WRITER_RECORD.format(rank=rank), json.dumps(record, sort_keys=True))


def read_writer_records(path: str | os.PathLike, world_size: int) -> list[dict[str, Any]] | None:
    """Every rank's writer record, or None if one is missing or unreadable."""
    records = []
    for rank in range(world_size):
        try:
            records.append(json.loads((Path(path) / SUMS_DIR / WRITER_RECORD.format(rank=rank)).read_text()))
        except (OSError, ValueError):
            return None
    return records


def write_then_checksum(
    write_fn: Any, checkpoint_dir: str, sums_rank: int, rank: int, buckets: Any, results_queue: Any
) -> None:
    """One save, in the writer process: ``write_fn`` (NVRx's write, both versions' signature
    ``(rank, buckets, results_queue)``), then the checksums of the files it wrote and the model
    digest, and only then the write's outcome to the trainer: when the trainer sees "done", the
    checksums are on disk. A failure of either is reported as the write's failure.

    ``sums_rank`` is this rank in the checkpoint's process group (the commit reads ``.sums`` for
    ranks 0..world-1); NVRx names the shard files by the global rank."""
    local: queue_lib.Queue = queue_lib.Queue()  # NVRx puts its result here, in this process
    try:
        write_fn(rank, buckets, local)
        result = local.get_nowait()
    except Exception as e:  # noqa: BLE001 - relayed to the trainer like NVRx's own write errors
        result = e
    if not isinstance(result, BaseException):
        try:
            began = time.monotonic()
            names = sorted({wr.storage_data.relative_path for results in result.values() for wr in results})
            sums = write_rank_sums(checkpoint_dir, sums_rank, names)
            crc, model_bytes = model_digest(_model_tensors(buckets))
            write_writer_record(
                checkpoint_dir,
                sums_rank,
                model_crc32c=crc,
                model_bytes=model_bytes,
                checksum_bytes=sum(s["size"] for s in sums.values()),
                checksum_s=round(time.monotonic() - began, 6),
            )
        except Exception as e:  # noqa: BLE001 - e.g. ENOSPC: the save must not commit
            result = e
    results_queue.put(result)
