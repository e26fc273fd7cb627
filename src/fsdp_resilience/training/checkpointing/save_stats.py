"""``SaveStats``: where the time of one checkpoint save went (``AsyncCheckpointer.last_save``)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class SaveStats:
    """Where the time of one ``save`` went (seconds); ``blocking_s`` is what the caller waited."""

    step: int
    mode: str  # "async" | "sync"
    blocking_s: float
    settle_s: float  # finishing the previous save + agreeing the writers are ready
    snapshot_s: float  # memcpy into the reused buffers (async only)
    plan_s: float  # DCP planning (a collective) + NVRx write preparation
    schedule_s: float  # handing the shard to the writer process
    snapshot_bytes: int
    #: ``overlap_snapshot``: how long ``wait_snapshot`` then waited for the copy to finish (the
    #: rest of the copy ran during the next forward and backward). The loop's whole stall for the
    #: save is ``blocking_s + snapshot_wait_s``. None until ``wait_snapshot`` ran; 0.0 without overlap.
    snapshot_wait_s: float | None = None
    #: Whether the save was planned in the background, beside the copy (a cached plan, overlapped).
    plan_overlapped: bool = False
