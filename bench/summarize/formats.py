"""How the benchmark pages write figures: seconds, statistics, timestamps, targets met, tables, the
machine's load, and the checkpoint methods' names."""

from __future__ import annotations

import math
from typing import Any

#: How each checkpoint method saves, for the table's notes.
METHOD_HOW = {
    "memcpy": "copies each rank's tensors into buffers allocated once (no file: the floor)",
    "nvrx_async": "`AsyncCheckpointer.save(overlap_snapshot=True)`, as the training loop saves: the snapshot "
    "copy into reused shared-memory buffers runs in a copy thread during the next forward and backward (a cached "
    "plan is made beside it), `wait_snapshot()` before the next optimizer step waits for what is left of it "
    "(counted in the stall) and hands the save to NVRx's persistent writer process, which writes and fsyncs; "
    "committed by the next poll/wait",
    "nvrx_async_no_checksum": "the project's saves without the writer's CRC32C pass over the files it wrote (a "
    "size-only record instead; bench only: such a checkpoint would never verify)",
    "torch_async_save": "`torch.distributed.checkpoint.async_save` with its default stager (a fresh CPU copy per "
    "save), written by a background thread",
    "torch_async_save_thread": "torch at its best, thread: `dcp.async_save` with one persistent `DefaultStager` "
    "(`StagingOptions` as recorded: shared memory; pinned memory and non-blocking copies "
    "need an accelerator) reused across saves, a gloo group of its own created once, "
    "`AsyncCheckpointerType.THREAD`",
    "torch_async_save_process": "the same with `AsyncCheckpointerType.PROCESS` (a persistent writer process)",
    "dcp_save": "`torch.distributed.checkpoint.save`, returns when written (fsync) and the metadata is out",
    "torch_save": "`torch.save` of each rank's local shards to its own file, then fsync",
}
#: Short names of the checkpoint methods, for table headers and legends.
METHOD_NAMES = {
    "memcpy": "memcpy (floor)",
    "nvrx_async": "project: NVRx async DCP",
    "nvrx_async_no_checksum": "project without checksums",
    "torch_async_save": "torch dcp.async_save",
    "torch_async_save_thread": "torch async_save, best config, thread",
    "torch_async_save_process": "torch async_save, best config, process",
    "dcp_save": "torch dcp.save (sync)",
    "torch_save": "torch.save",
}


def fmt_s(x: float | None) -> str:
    """Seconds, with the precision the value needs."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    if x < 0.01:
        return f"{x * 1000:.1f} ms"
    if x < 1:
        return f"{x * 1000:.0f} ms"
    if x < 10:
        return f"{x:.2f} s"
    if x < 100:
        return f"{x:.1f} s"
    return f"{x:.0f} s"


def fmt_stat(stats: dict[str, Any] | None) -> str:
    """median (min–max, n)"""
    if not stats or not stats.get("n"):
        return "—"
    if stats["n"] == 1:
        return f"{fmt_s(stats['median'])} (n=1)"
    return f"{fmt_s(stats['median'])} ({fmt_s(stats['min'])}–{fmt_s(stats['max'])})"


def fmt_when(iso: str | None) -> str:
    """An ISO timestamp as date and minute (its zone as recorded)."""
    return iso[:16].replace("T", " ") + iso[19:] if iso else "?"


def median_of(x: Any) -> float | None:
    """A figure that is either a number or ``summarize``'s statistics."""
    return x.get("median") if isinstance(x, dict) else x


def fmt_met(met: bool | None) -> str:
    return "—" if met is None else ("met" if met else "**missed**")


def md_table(header: tuple[str, ...], rows: list[tuple[Any, ...]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines + [""]


def fmt_load(part: dict[str, Any]) -> str:
    load = part.get("load") or {}
    during = load.get("loadavg_1m_during") or {}
    if not during.get("n"):
        return "load average not recorded"
    return (
        f"1-min load average {during['min']}–{during['max']} (median {during['median']}) on {load.get('cores')} cores"
    )
