"""Checkpoint stall: start the ranks (``stall_rank``) and collect their measurements."""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import RUN_SETTINGS, free_port
from bench.training_plane.stall_rank import (
    INTERFERENCE_MAX_S,
    METHODS,
    NEXT_STEP_BATCH,
    STEP_DIM,
    STEP_MATMULS,
    TORCH_ASYNC,
    WIDTH,
    _stall_rank,
)


def bench_stall(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import torch
    import torch.multiprocessing as mp

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    scratch = Path(tempfile.mkdtemp(prefix="stall-", dir=args.scratch))
    spec = {
        "device": device,
        "scratch": str(scratch),
        "sizes_mb": args.sizes_mb,
        "trials": args.trials,
        "warmup": 1,
        "methods": list(METHODS),
        "result": str(work / "stall-result.json"),
        "eval": "eval_load" in args.only,
        "nvrx_run_dir": str(work / "eval-run") if "eval_load" in args.only else str(scratch / "nvrx"),
        "eval_model": args.eval_model,
        "eval_seq_len": RUN_SETTINGS["seq_len"],
    }
    shutil.rmtree(work / "eval-run", ignore_errors=True)
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_stall_rank, args=(r, args.nproc, port, spec)) for r in range(args.nproc)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + args.stall_timeout_s
    for p in procs:
        p.join(timeout=max(1.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    shutil.rmtree(scratch, ignore_errors=True)
    errors = "\n".join(f.read_text() for f in sorted(work.glob("stall-result.rank*.error")))
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"stall ranks exited {[p.exitcode for p in procs]}:\n{errors}")
    raw = json.loads(Path(spec["result"]).read_text())
    sizes = raw["sizes"]
    for size in sizes:
        m = size["methods"]
        project = m["nvrx_async"]["blocking_s"]["median"]
        # torch's baseline: the better of its thread and process checkpointers (both are kept).
        torch_best = min(TORCH_ASYNC, key=lambda k: m[k]["blocking_s"]["median"])
        torch_stall = m[torch_best]["blocking_s"]["median"]
        size["torch_async_save_best"] = torch_best
        size["ratios"] = {
            "nvrx_async_over_memcpy": round(project / m["memcpy"]["blocking_s"]["median"], 2),
            "nvrx_async_over_dcp_save": round(project / m["dcp_save"]["blocking_s"]["median"], 3),
            "nvrx_async_over_torch_async_save_best": round(project / torch_stall, 3),
            "torch_async_save_best_over_dcp_save": round(torch_stall / m["dcp_save"]["blocking_s"]["median"], 3),
            "nvrx_async_interference": m["nvrx_async"].get("interference"),
            "torch_async_save_best_interference": m[torch_best].get("interference"),
            # What checksums add to the stall and to save-to-commit, side by side with the same
            # saves without the CRC32C pass.
            "checksum_stall_overhead": round(project / m["nvrx_async_no_checksum"]["blocking_s"]["median"] - 1, 3),
            "checksum_commit_overhead": round(
                m["nvrx_async"]["complete_s"]["median"] / m["nvrx_async_no_checksum"]["complete_s"]["median"] - 1, 3
            ),
        }
        size["targets"] = {
            "nvrx_async <= 0.2x memcpy": size["ratios"]["nvrx_async_over_memcpy"] <= 0.2,
            "nvrx_async <= torch async_save at its best": size["ratios"]["nvrx_async_over_torch_async_save_best"]
            <= 1.0,
            "writer interference <= 1.3": (m["nvrx_async"].get("interference") or float("inf")) <= 1.3,
            "nvrx_async <= 1/10 dcp_save": size["ratios"]["nvrx_async_over_dcp_save"] <= 0.1,
            "checksums add <= 10% to the stall": size["ratios"]["checksum_stall_overhead"] <= 0.10,
        }
    return {
        "world_size": args.nproc,
        "device": device,
        "backend": "cpu:gloo,cuda:nccl" if device == "cuda" else "gloo",
        "scratch_dir": args.scratch or tempfile.gettempdir(),
        "trials": args.trials,
        "warmup_trials": 1,
        "state": f"FSDP2 Linear({WIDTH},{WIDTH}) stack, fp32 params + AdamW exp_avg/exp_avg_sq, split over ranks",
        "blocking": "seconds until the training loop may modify the state again (state-dict collection, "
        "snapshot/staging and hand-off; the memcpy floor copies an already collected state), "
        "slowest rank, per save. Each save is followed by the model's next forward and backward "
        f"(batch {NEXT_STEP_BATCH}x{WIDTH}), as in training; the project's snapshot copy runs during it "
        "and the wait for the copy's rest before the next optimizer step counts as blocking. "
        "complete = until durable (fsync) / committed, that forward and backward included",
        "interference": f"stand-in steps ({STEP_MATMULS} matmuls of {STEP_DIM}x{STEP_DIM} on each rank): median "
        "step time with a save in flight (from its return until the rank's write is done, at "
        f"most {INTERFERENCE_MAX_S:g}s) over the median without (pooled over the methods)",
        "sizes": sizes,
        "eval_checkpoint": raw.get("eval_checkpoint"),
    }
