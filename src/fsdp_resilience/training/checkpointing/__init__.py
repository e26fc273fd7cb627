"""The data plane's checkpoints: asynchronous DCP saves with NVRx's writer, the commit protocol,
and resuming from the newest checkpoint that verifies.

- ``checkpointer``: ``AsyncCheckpointer``, the object the training loop calls (save, poll, wait,
  rebind, close, and the overlapped snapshot's wait_snapshot);
- ``save_stats``: ``SaveStats``, where the time of one save went;
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
