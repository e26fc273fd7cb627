"""The data plane's checkpoints: asynchronous DCP saves with NVRx's writer, the commit protocol,
and resuming from the newest checkpoint that verifies.

- ``checkpointer``: ``AsyncCheckpointer``, the object the training loop calls (save, poll, wait,
  rebind, close), and ``SaveStats``;
- ``rounds``: the collective rounds every rank runs (settle before a save, finalize after it) and
  ``CheckpointWriterError``, which every rank raises at the same point when a save fails anywhere;
- ``commit``: rank 0's commit (DCP's ``.metadata``, then the marker), stale-save detection,
  retention in the background, the checksum records the trainer writes itself;
- ``snapshot``: the state a checkpoint holds (``app_state``) and the one host copy a save makes
  (``SnapshotBuffers``), with NVRx's file writer over it;
- ``writer``: the persistent writer process per rank, started, watched for stalls and replaced;
- ``write_job``: what the writer does for one save (NVRx's write, then checksums and model digest);
- ``write_results``: each save's write results back from the writer, tagged with its number;
- ``resume``: choosing, verifying, quarantining and loading a checkpoint;
- ``model_bytes``: reading a checkpoint's model tensors straight into parameters (evaluation).
"""

from fsdp_resilience.training.checkpointing.checkpointer import AsyncCheckpointer, SaveStats
from fsdp_resilience.training.checkpointing.model_bytes import (
    NotDirectlyReadable,
    plan_direct_read,
    read_model_bytes,
)
from fsdp_resilience.training.checkpointing.resume import (
    CheckpointMismatchError,
    check_checkpoint,
    choose_checkpoint,
    load_checkpoint,
    load_latest,
    restore_checkpoint,
)
from fsdp_resilience.training.checkpointing.rounds import CheckpointWriterError
from fsdp_resilience.training.checkpointing.snapshot import SnapshotBuffers, app_state, restore_app_state
from fsdp_resilience.training.checkpointing.writer import writer_stall_bound

__all__ = [
    "AsyncCheckpointer",
    "CheckpointMismatchError",
    "CheckpointWriterError",
    "NotDirectlyReadable",
    "SaveStats",
    "SnapshotBuffers",
    "app_state",
    "check_checkpoint",
    "choose_checkpoint",
    "load_checkpoint",
    "load_latest",
    "plan_direct_read",
    "read_model_bytes",
    "restore_app_state",
    "restore_checkpoint",
    "writer_stall_bound",
]
