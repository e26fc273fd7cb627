"""Write results from the writer process back to the trainer, each tagged with its save's number.

NVRx hands a save's write results over a ``results_queue``; its default is a queue served by a
manager process (a third interpreter per rank). Here each save gets a numbered slot
(``_ResultSlot``) and the result travels on the writer's own completion queue
(``_WriteResultsChannel``), so an abandoned save's late result is never read as a newer save's.
"""

from __future__ import annotations

import itertools
import queue as queue_lib
from typing import Any

from nvidia_resiliency_ext.checkpointing.async_ckpt import filesystem_async as nvrx_filesystem

#: In the writer process: the completion queue that write results travel back on (set at start by
#: ``writer._writer_main``).
_results_out: Any = None

#: The tag of a write result on the completion queue (NVRx itself only sends call indices there).
_RESULT = "write_result"


class _ResultSlot:
    """One save's write-results "queue" (NVRx's ``results_queue`` argument): ``put`` in the
    writer process, ``get_nowait`` in the trainer. Only its number travels to the writer."""

    def __init__(self, number: int, channel: "_WriteResultsChannel | None"):
        self.number = number
        self._channel = channel

    def __getstate__(self) -> dict[str, Any]:
        return {"number": self.number}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.number, self._channel = state["number"], None

    def put(self, result: Any) -> None:
        """In the writer: send this save's result to the trainer."""
        if _results_out is None:
            raise RuntimeError(
                "a checkpoint write result can only be sent from the writer process "
                "(fsdp_resilience.training.checkpointing.writer._writer_main)"
            )
        _results_out.put((_RESULT, self.number, result))

    def get_nowait(self) -> Any:
        """In the trainer: this save's result (raises ``queue.Empty`` if it has not arrived)."""
        if self._channel is None:
            raise RuntimeError(
                "this write-results slot is not a save's: AsyncCheckpointer gives every save its "
                "own (see _WriteResultsChannel.new_queue)"
            )
        return self._channel.take(self.number)


class _WriteResultsChannel:
    """Write results from the writer to the trainer, carried on the writer's completion queue.

    Every save gets its own numbered slot (``new_queue``). In the writer the slot sends
    ``(_RESULT, number, result)`` on the completion queue, ahead of the call index NVRx sends when
    the call returns (one process, one queue: they arrive in that order). In the trainer the
    writer's ``wait_completed`` files the result here under its number, and the save's
    ``retrieve_write_results`` takes it by number. So an abandoned save's late result is filed
    under its own number, never read as a newer save's; reading a save's result drops older ones.
    No process of its own: NVRx's default (a manager process) is replaced by a slot that refuses use.
    """

    def __init__(self) -> None:
        self._numbers = itertools.count()
        self._results: dict[int, Any] = {}
        self._installed: _ResultSlot | None = None
        if getattr(nvrx_filesystem, "_results_queue", "missing") is None:
            # NVRx's module-wide default: ours, so NVRx never spawns a manager for it. Every save
            # replaces it with its own slot before the request is built.
            self._installed = nvrx_filesystem._results_queue = _ResultSlot(-1, None)

    def new_queue(self) -> _ResultSlot:
        return _ResultSlot(next(self._numbers), self)

    def file(self, number: int, result: Any) -> None:
        self._results[number] = result

    def take(self, number: int) -> Any:
        if number not in self._results:
            raise queue_lib.Empty
        for older in [n for n in self._results if n < number]:  # abandoned saves' late results
            del self._results[older]
        return self._results.pop(number)

    def close(self) -> None:
        if self._installed is not None and getattr(nvrx_filesystem, "_results_queue", None) is self._installed:
            nvrx_filesystem._results_queue = None
        self._installed = None
        self._results.clear()
