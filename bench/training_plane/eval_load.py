"""Evaluation load: loading the newest committed checkpoint into the evaluation process against raw
reads of the same files.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import RUN_SETTINGS, summarize


def _read_ranges(ranges: list[tuple[Path, int, int]], buffer: Any) -> int:
    """Read byte ranges of files one after another into ``buffer`` (any writable buffer as big as
    all of them): the bytes land in this process's memory, as a load's do."""
    view = memoryview(buffer)
    handles: dict[Path, int] = {}
    at = 0
    try:
        for path, offset, length in ranges:
            fd = handles.get(path)
            if fd is None:
                fd = handles[path] = os.open(path, os.O_RDONLY)
            done = 0
            while done < length:
                n = os.preadv(fd, [view[at + done : at + length]], offset + done)
                if n <= 0:
                    raise OSError(f"short read of {path} at {offset + done}")
                done += n
            at += length
    finally:
        for fd in handles.values():
            os.close(fd)
    return at


#: One load_model in a new process, timed inside it (imports left out), as ``evaluate`` runs it:
#: once, into memory the process has never used.
_LOAD_IN_NEW_PROCESS = """
import gc, json, sys, time
import torch
from fsdp_resilience.training.contract import EventLog, RunConfig
from fsdp_resilience.training.evaluate import load_model
gc.freeze()  # as evaluate's main does once it has imported what it needs
cfg = RunConfig.from_json(sys.argv[1])
events = EventLog(cfg.layout.events, run_id=cfg.run_id, role="bench")
t0 = time.perf_counter()
load_model(cfg, sys.argv[2], torch.device("cpu"), events)
print(json.dumps(time.perf_counter() - t0))
"""


def _load_in_new_process(cfg: Any, checkpoint_id: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", _LOAD_IN_NEW_PROCESS, cfg.to_json(), checkpoint_id],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"load_model in a new process failed ({out.returncode}): {out.stderr[-2000:]}")
    return float(out.stdout.strip().splitlines()[-1])


def _verified(reason: str | None) -> None:
    if reason is not None:
        raise RuntimeError(f"the bench checkpoint does not verify: {reason}")


def bench_eval_load(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import torch
    from torch.distributed.checkpoint import FileSystemReader

    from fsdp_resilience.training.contract import CheckpointCatalog, EventLog, RunConfig, verify_checkpoint
    from fsdp_resilience.training.evaluate import empty_model, load_into, load_model

    run_dir = work / "eval-run"
    info = CheckpointCatalog(run_dir).latest()
    if info is None:
        raise RuntimeError(
            f"no committed checkpoint in {run_dir}: the stall bench writes it (run with --only stall,eval_load)"
        )
    cfg = RunConfig(
        run_id="bench-eval",
        run_dir=str(run_dir),
        dataset_dir=str(work / "unused"),
        model=args.eval_model,
        seq_len=RUN_SETTINGS["seq_len"],
        device="cpu",
    )
    files = sorted(p for p in info.path.iterdir() if p.is_file())
    metadata = FileSystemReader(str(info.path)).read_metadata()
    # The byte ranges evaluation actually needs: the model's tensors (the optimizer's are skipped).
    ranges = sorted(
        (info.path / s.relative_path, s.offset, s.length)
        for index, s in metadata.storage_data.items()
        if index.fqn.startswith("model.")
    )
    whole_files = [(p, 0, p.stat().st_size) for p in files]
    events = EventLog(cfg.layout.events, run_id=cfg.run_id, role="bench")
    buffer = bytearray(sum(r[2] for r in whole_files))
    device = torch.device("cpu")
    model_bytes = sum(r[2] for r in ranges)
    # How load_model verifies what it loads here (the model digests, or every file's checksums
    # when its direct read does not apply): said in the results, so a fallback is never hidden.
    verified_by = load_into(info, empty_model(cfg, device).state_dict())
    timings: dict[str, list[float]] = {
        "load_model": [],
        "raw_read_model_bytes": [],
        "raw_read_model_bytes_fresh_memory": [],
        "raw_read_files": [],
        "build_model_only": [],
        "verify_checksums": [],
    }
    tasks = {
        "raw_read_files": lambda: _read_ranges(whole_files, buffer),
        # The floor the target is set against: a read into memory that is already mapped.
        "raw_read_model_bytes": lambda: _read_ranges(ranges, buffer),
        # The same read into memory allocated for it, as a new model's is: what mapping in fresh
        # pages adds (a page fault per 4 KiB; costly on a VM).
        "raw_read_model_bytes_fresh_memory": lambda: _read_ranges(
            ranges, torch.empty(model_bytes, dtype=torch.uint8).numpy()
        ),
        # The whole evaluation load: build on the meta device, verify, read into the parameters.
        "load_model": lambda: load_model(cfg, info.checkpoint_id, device, events),
        # What load_model builds before it reads (initialisers skipped, derived buffers filled).
        "build_model_only": lambda: empty_model(cfg, device),
        # What a resume's verification costs (sizes + CRC32C of every file, in one process);
        # evaluation reads and checks only the model's bytes (``verified_by``).
        "verify_checksums": lambda: _verified(verify_checkpoint(info.path)),
    }
    order = list(tasks)
    for trial in range(1 + args.trials):  # trial 0 warms the page cache and the allocator
        for name in order[trial % len(order) :] + order[: trial % len(order)]:
            t0 = time.perf_counter()
            tasks[name]()
            elapsed = time.perf_counter() - t0
            if trial:
                timings[name].append(elapsed)
        gc.collect()
    # The same load, once in each of ``trials`` new processes (after the in-process trials: the
    # page cache is as warm), as ``evaluate`` runs it.
    new_process = [_load_in_new_process(cfg, info.checkpoint_id) for _ in range(args.trials)]
    shutil.rmtree(run_dir, ignore_errors=True)  # hundreds of MB, and nothing reads it again
    out = {name: summarize(values) for name, values in timings.items()}
    out["load_model_new_process"] = summarize(new_process)
    load = out["load_model"]["median"]
    ratio_bytes = round(load / out["raw_read_model_bytes"]["median"], 2)
    ratio_fresh = round(load / out["raw_read_model_bytes_fresh_memory"]["median"], 2)
    ratio_files = round(load / out["raw_read_files"]["median"], 2)
    return {
        "model": args.eval_model,
        "checkpoint": info.checkpoint_id,
        "saved_world_size": info.world_size,
        "files": len(files),
        "file_mb": round(sum(r[2] for r in whole_files) / 1e6, 1),
        "model_mb": round(model_bytes / 1e6, 1),
        "trials": args.trials,
        "build": "on the CPU with its initialisers skipped, parameters left for the load to fill",
        "verified_by": verified_by,
        "verification": (
            "before the read: commit marker, every file's size, CRC32C of .metadata; then reader "
            "threads read each model tensor into its parameter and take the CRC32C of the bytes as "
            "they land there (one pass); after: those CRCs, combined per saved rank, against the "
            "commit's model digests; the model is handed out only if they match"
            if verified_by == "model digests"
            else "size and CRC32C of every file, then DCP load"
        ),
        "page_cache": "warm (the checkpoint was just written; trial 0 is discarded)",
        "new_process": "load_model_new_process: the same load once in each of as many new processes, "
        "timed inside them (imports left out), as evaluate runs",
        "raw_read": "os.preadv into one preallocated buffer that holds all the bytes read "
        "(fresh_memory: into a buffer allocated for each read)",
        "seconds": out,
        "ratios": {
            "load_over_raw_read_model_bytes": ratio_bytes,
            "load_over_raw_read_files": ratio_files,
            "load_over_raw_read_model_bytes_fresh_memory": ratio_fresh,
            "load_new_process_over_raw_read_model_bytes_fresh_memory": round(
                out["load_model_new_process"]["median"] / out["raw_read_model_bytes_fresh_memory"]["median"], 2
            ),
            "verify_over_load": round(out["verify_checksums"]["median"] / load, 3),
            "verify_gib_per_s": round(sum(r[2] for r in whole_files) / 2**30 / out["verify_checksums"]["median"], 2),
        },
        "targets": {
            # The target: a raw read of the same bytes into fresh memory.
            "load <= 1.5x raw read (model bytes, fresh memory)": ratio_fresh <= 1.5,
            "load <= 1.5x raw read (model bytes)": ratio_bytes <= 1.5,
            "load <= 1.5x raw read (whole files)": ratio_files <= 1.5,
        },
    }
