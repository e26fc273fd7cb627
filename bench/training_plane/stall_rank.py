"""Checkpoint stall, one process per rank: the methods compared, and what each rank measures
(blocking time per save, writer interference), then the evaluation checkpoint.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from bench.common import log, summarize

METHODS = (
    "memcpy",
    "nvrx_async",
    "nvrx_async_no_checksum",
    "torch_async_save_thread",
    "torch_async_save_process",
    "dcp_save",
    "torch_save",
)
METHOD_LABELS = {
    "memcpy": "memcpy of the collected state into reused buffers (floor; state-dict collection not included)",
    "nvrx_async": "project: NVRx async DCP (AsyncCheckpointer), CRC32C of every file in the writer",
    "nvrx_async_no_checksum": "the same without the CRC32C pass (sizes only): what checksums cost",
    "torch_async_save_thread": "torch dcp.async_save, AsyncCheckpointerType.THREAD, a persistent DefaultStager "
    "(shared, cached staging; pinned on CUDA) and a process group of its own, both reused",
    "torch_async_save_process": "the same with AsyncCheckpointerType.PROCESS (a persistent checkpoint process)",
    "dcp_save": "torch dcp.save (synchronous)",
    "torch_save": "torch.save of each rank's shard (+ fsync)",
}
TORCH_ASYNC = ("torch_async_save_thread", "torch_async_save_process")
# Writer interference: "steps" of matmuls run with a save in flight vs without, per method.
INTERFERENCE_METHODS = ("nvrx_async", *TORCH_ASYNC)
STEP_MATMULS, STEP_DIM = 4, 512
INTERFERENCE_TRIALS = 3  # saves per method: each lasts as long as its write, which the steps slow down
INTERFERENCE_MAX_S = 5.0  # steps per save stop after this long (a nice'd writer may barely run meanwhile)
WIDTH = 1024  # Linear(1024, 1024): 1.05 M params, 12.6 MB with AdamW's two moments
#: After every save, each method's trial runs the model's next forward and backward (a batch of
#: this many rows), as the training loop would: the project's snapshot copy overlaps it, and the
#: optimizer step after it waits for the copy (``wait_snapshot``), which the stall includes.
NEXT_STEP_BATCH = 32


def write_sizes_only(
    write_fn: Any, checkpoint_dir: str, sums_rank: int, rank: int, buckets: Any, results_queue: Any
) -> None:
    """The writer's job without the checksum pass, for ``nvrx_async_no_checksum`` only: NVRx's
    write, then a ``.sums`` record with sizes and a dummy CRC (the commit checks sizes; nothing
    ever loads these folders). Run in the writer process, as ``write_then_checksum`` is."""
    import queue

    from fsdp_resilience.training.contract import CHECKSUM_ALGORITHM, SUMS_DIR, atomic_write_text

    local: queue.Queue = queue.Queue()
    try:
        write_fn(rank, buckets, local)
        result = local.get_nowait()
        if not isinstance(result, BaseException):
            names = sorted({wr.storage_data.relative_path for results in result.values() for wr in results})
            sums = {
                n: {"size": os.path.getsize(os.path.join(checkpoint_dir, n)), CHECKSUM_ALGORITHM: "00000000"}
                for n in names
            }
            os.makedirs(os.path.join(checkpoint_dir, SUMS_DIR), exist_ok=True)
            atomic_write_text(Path(checkpoint_dir) / SUMS_DIR / f"rank_{sums_rank:05d}.json", json.dumps(sums))
    except Exception as e:  # noqa: BLE001 - reported like the real job does
        result = e
    results_queue.put(result)


def _local_tensors(state: Any, prefix: str = "") -> dict[str, Any]:
    """Nested state -> {"a.b": tensor} with DTensors as their local shards (what each rank holds)."""
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(state, dict):
        out: dict[str, Any] = {}
        for k, v in state.items():
            out.update(_local_tensors(v, f"{prefix}{k}."))
        return out
    if isinstance(state, (list, tuple)):
        out = {}
        for i, v in enumerate(state):
            out.update(_local_tensors(v, f"{prefix}{i}."))
        return out
    if isinstance(state, DTensor):
        return {prefix[:-1]: state.to_local()}
    if isinstance(state, torch.Tensor):
        return {prefix[:-1]: state}
    return {}


def _stall_rank(rank: int, world: int, port: int, spec: dict[str, Any]) -> None:
    """Everything one rank does; rank 0 writes the results to spec["result"]."""
    try:
        result = _run_stall_rank(rank, world, port, spec)
        if rank == 0:
            Path(spec["result"]).write_text(json.dumps(result, default=str))
    except BaseException:
        Path(spec["result"]).with_suffix(f".rank{rank}.error").write_text(traceback.format_exc())
        raise


def _run_stall_rank(rank: int, world: int, port: int, spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_resilience.training.checkpointing.checkpointer import AsyncCheckpointer

    device = (
        torch.device(spec["device"], rank % max(1, torch.cuda.device_count()))
        if spec["device"] == "cuda"
        else torch.device("cpu")
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # Built before the process group, as train/loop.py does: the writer process boots meanwhile. Its
    # run dir ends up holding the checkpoint the evaluation bench loads (one writer boot, not two).
    ckpt = AsyncCheckpointer(spec["nvrx_run_dir"], rank=rank, world_size=world, keep=10_000, device=device)
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"  # async_save needs a CPU backend
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=600)
    )
    ckpt.rebind()
    mesh = init_device_mesh(device.type, (world,))
    # torch's async_save at its best (its docs): a process group of its own, made once and reused.
    torch_group = dist.new_group(backend="gloo")
    sizes_out, step = [], 0
    for target_mb in spec["sizes_mb"]:
        size, step = _stall_size(target_mb, step, ckpt, mesh, device, rank, world, spec, torch_group)
        gc.collect()
        if rank == 0:
            sizes_out.append(size)
            log(
                f"stall {target_mb} MB: "
                + ", ".join(f"{m} {v['blocking_s'].get('median')}s" for m, v in size["methods"].items())
            )
    eval_checkpoint = _save_eval_checkpoint(ckpt, step + 1, rank, world, mesh, device, spec) if spec["eval"] else None
    ckpt.close()
    dist.destroy_process_group()
    return {"sizes": sizes_out, "eval_checkpoint": eval_checkpoint}


def _torch_stager(device: Any) -> tuple[Any, dict[str, bool]]:
    """torch's persistent stager at its best here: shared-memory staging buffers cached across
    saves; pinned memory and non-blocking copies only where an accelerator exists (DefaultStager
    refuses non-blocking copies without one, and pinning needs CUDA). Staging is synchronous on
    CPU: the stall lasts until staging completes either way, and a staging thread only adds a hop."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    cuda = device.type == "cuda"
    options = {
        "use_pinned_memory": cuda,
        "use_shared_memory": True,
        "use_async_staging": cuda,
        "use_non_blocking_copy": cuda,
    }
    return DefaultStager(StagingOptions(**options)), options


def _step_s(a: Any, b: Any) -> float:
    """One stand-in training step (matmuls on this rank), in seconds."""
    t0 = time.perf_counter()
    for _ in range(STEP_MATMULS):
        a = (a @ b).tanh_()
    if a.is_cuda:
        import torch

        torch.cuda.synchronize()
    return time.perf_counter() - t0


def _stall_size(
    target_mb: int,
    step: int,
    ckpt: Any,
    mesh: Any,
    device: Any,
    rank: int,
    world: int,
    spec: dict[str, Any],
    torch_group: Any,
) -> tuple[dict[str, Any] | None, int]:
    """All methods on a state of ``target_mb`` (total over ranks); (rank 0's results, last step)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse
    from torch.distributed.fsdp import fully_shard

    import fsdp_resilience.training.checkpointing.checkpointer as checkpoint_module
    from fsdp_resilience.training.checkpointing.snapshot import app_state
    from fsdp_resilience.training.checkpointing.write_job import write_then_checksum as real_job

    scratch = Path(spec["scratch"])
    layers = max(1, round(target_mb * 1e6 / (12 * (WIDTH * WIDTH + WIDTH))))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, device=device) for _ in range(layers)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    model(torch.randn(4, WIDTH, device=device)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

    t0 = time.perf_counter()
    state = app_state(model, optimizer, {"step": 0})
    state_dict_s = time.perf_counter() - t0
    local = _local_tensors(state)
    stagers = {m: _torch_stager(device) for m in TORCH_ASYNC}
    checkpointer_types = {
        "torch_async_save_thread": AsyncCheckpointerType.THREAD,
        "torch_async_save_process": AsyncCheckpointerType.PROCESS,
    }
    local_bytes = sum(t.numel() * t.element_size() for t in local.values())
    floor_buffers: dict[str, Any] = {}

    def gather(value: Any) -> list[Any]:
        out: list[Any] = [None] * world
        dist.all_gather_object(out, value)
        return out

    def memcpy() -> None:
        for name, tensor in local.items():
            buffer = floor_buffers.get(name)
            if buffer is None:
                buffer = floor_buffers[name] = torch.empty(
                    tensor.shape, dtype=tensor.dtype, pin_memory=device.type == "cuda"
                )
            buffer.copy_(tensor, non_blocking=device.type == "cuda")
        if device.type == "cuda":
            torch.cuda.synchronize()

    def start(method: str, folder: Path) -> tuple[Callable[[], bool], Callable[[], None], dict[str, Any]]:
        """Start one save by ``method``; returns once the training loop may modify the state
        again (for every method but the memcpy floor, that includes collecting the state dict as
        the loop does: ``app_state``). Returns (is this rank's write done, wait for the rest, extra)."""
        extra: dict[str, Any] = {}
        t0 = time.perf_counter()
        if method == "memcpy":
            memcpy()
            return (lambda: True), (lambda: None), extra
        saved = app_state(model, optimizer, {"step": step})
        extra["state_dict_s"] = time.perf_counter() - t0
        if method in ("nvrx_async", "nvrx_async_no_checksum"):
            # The writer's job is picked per save (checkpointer.py binds it when the save starts).
            checkpoint_module.write_then_checksum = real_job if method == "nvrx_async" else write_sizes_only
            ckpt.save(step, saved, overlap_snapshot=True)  # as train/loop.py saves

            def written() -> bool:
                ckpt.wait_snapshot()  # the stand-in steps write nothing; hand the save over
                return ckpt.pending_written()

            return written, ckpt.wait, extra
        if method in TORCH_ASYNC:
            stager, _ = stagers[method]
            response = dcp.async_save(
                saved,
                checkpoint_id=str(folder),
                process_group=torch_group,
                async_stager=stager,
                async_checkpointer_type=checkpointer_types[method],
            )
            if isinstance(response, AsyncSaveResponse):  # async staging (CUDA)
                response.staging_completion.result()  # the state may change only after staging
                response = response.upload_completion
            return response.done, response.result, extra
        if method == "dcp_save":
            dcp.save(saved, checkpoint_id=str(folder))
        elif method == "torch_save":
            folder.mkdir(parents=True, exist_ok=True)
            with open(folder / f"rank{rank}.pt", "wb") as f:
                torch.save(_local_tensors(saved), f)
                f.flush()
                os.fsync(f.fileno())
        else:
            raise ValueError(method)
        return (lambda: True), (lambda: None), extra

    next_batch = torch.randn(NEXT_STEP_BATCH, WIDTH, device=device)

    def next_forward_backward() -> float:
        """The model's next forward and backward, as the loop runs them after a save (they read
        the parameters, never write them); seconds."""
        t0 = time.perf_counter()
        model(next_batch).square().mean().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        optimizer.zero_grad(set_to_none=True)  # the gradients are not part of the saved state
        return elapsed

    def run(method: str, folder: Path) -> tuple[float, float, dict[str, Any]]:
        """(blocking s, complete s, extra) of one save by ``method``, followed by the model's next
        forward and backward. Blocking: until the loop may write the state again: the save's own
        return, plus for the project the wait for its snapshot copy before the next optimizer
        step. Complete: from the save until durable / committed, the forward and backward included."""
        t0 = time.perf_counter()
        _, finish, extra = start(method, folder)
        blocking = time.perf_counter() - t0
        extra["next_step_s"] = next_forward_backward()
        if method.startswith("nvrx_async"):
            waited_from = time.perf_counter()
            ckpt.wait_snapshot()  # before the next optimizer step: the copy's rest, then the hand-over
            blocking += time.perf_counter() - waited_from
        finish()
        complete = time.perf_counter() - t0
        if method.startswith("nvrx_async"):
            s = ckpt.last_save
            extra.update(
                {
                    "settle_s": s.settle_s,
                    "snapshot_s": s.snapshot_s,
                    "snapshot_wait_s": s.snapshot_wait_s,
                    "plan_s": s.plan_s,
                    "schedule_s": s.schedule_s,
                }
            )
            if method == "nvrx_async":
                marker = json.loads((ckpt.layout.checkpoint_dir(step) / "COMMITTED.json").read_text())
                extra["checksum_s"] = max(marker.get("checksum_s") or [0.0])
        return blocking, complete, extra

    step_a = torch.randn(STEP_DIM, STEP_DIM, device=device)
    step_b = torch.randn(STEP_DIM, STEP_DIM, device=device) / STEP_DIM**0.5

    def interference(method: str, folder: Path) -> tuple[list[float], list[float], float]:
        """Step times without a save in flight, then with one (from the save's return until this
        rank's write is done; at least one step), and how long the write stayed in flight (None:
        past ``INTERFERENCE_MAX_S``, when stepping stops). Every rank keeps stepping until every
        rank's write is done (a non-blocking all-reduce tells), so no rank's steps run on cores
        another rank left idle."""
        _step_s(step_a, step_b)  # the first step after the barrier runs cold: not counted
        idle = [_step_s(step_a, step_b) for _ in range(5)]
        done, finish, _ = start(method, folder)
        began = time.perf_counter()
        busy, in_flight_s, all_done = [], None, None
        while True:
            step_s = _step_s(step_a, step_b)
            if all_done is None:
                busy.append(step_s)
                if done():
                    in_flight_s = time.perf_counter() - began
                if in_flight_s is not None or time.perf_counter() - began > INTERFERENCE_MAX_S:
                    all_done = dist.all_reduce(torch.ones(1), async_op=True)
            elif all_done.is_completed() or time.perf_counter() - began > INTERFERENCE_MAX_S:
                break
        all_done.wait()
        finish()
        return idle, busy, in_flight_s

    rows: dict[str, list[Any]] = {m: [] for m in spec["methods"]}
    warm: dict[str, list[float]] = {m: [] for m in spec["methods"]}
    for trial in range(spec["warmup"] + spec["trials"]):
        for method in spec["methods"]:  # round-robin: machine noise hits every method alike
            step += 1
            dist.barrier()
            blocking, complete, extra = run(method, scratch / method / f"step_{step:08d}")
            per_rank = gather((blocking, complete, extra))
            if rank == 0:
                # The loop goes on when the slowest rank does (its next collective waits).
                record = (max(b for b, _, _ in per_rank), max(c for _, c, _ in per_rank), per_rank[0][2])
                if trial < spec["warmup"]:
                    warm[method].append(record[0])
                else:
                    rows[method].append(record)
                if method.startswith("nvrx_async"):  # its folders are in the run-dir layout
                    for old in ckpt.layout.checkpoints.glob("step_*"):
                        shutil.rmtree(old, ignore_errors=True)
                elif method != "memcpy":
                    shutil.rmtree(scratch / method, ignore_errors=True)
                os.sync()  # no write-back of this save lands in the next one's timing
            dist.barrier()
    checkpoint_module.write_then_checksum = real_job  # later saves (the evaluation checkpoint) verify
    steps: dict[str, dict[str, list[float]]] = {
        m: {"idle": [], "busy": [], "in_flight": []} for m in INTERFERENCE_METHODS if m in spec["methods"]
    }
    for _trial in range(min(spec["trials"], INTERFERENCE_TRIALS)):
        for method in steps:  # round-robin, as above
            step += 1
            dist.barrier()
            idle, busy, in_flight_s = interference(method, scratch / method / f"step_{step:08d}")
            per_rank = gather((idle, busy, in_flight_s))
            if rank == 0:
                for r_idle, r_busy, r_in_flight_s in per_rank:
                    steps[method]["idle"] += r_idle
                    steps[method]["busy"] += r_busy
                    steps[method]["in_flight"].append(r_in_flight_s)
                for old in ckpt.layout.checkpoints.glob("step_*"):
                    shutil.rmtree(old, ignore_errors=True)
                shutil.rmtree(scratch / method, ignore_errors=True)
                os.sync()
            dist.barrier()
    for stager, _ in stagers.values():
        stager.close()
    total_bytes = sum(gather(local_bytes))
    if rank != 0:
        return None, step
    # Steps without a save in flight, pooled over every method's trials: the same conditions for
    # each method's ratio (what ran just before one method's trials does not bias its baseline).
    idle_all = summarize(v for m in steps.values() for v in m["idle"])
    methods_out = {}
    for method, records in rows.items():
        entry = {
            "label": METHOD_LABELS[method],
            "blocking_s": summarize(r[0] for r in records),
            "complete_s": summarize(r[1] for r in records),
            "warmup_blocking_s": [round(w, 4) for w in warm[method]],
        }
        if method.startswith("nvrx_async"):
            entry["breakdown_median_s"] = {
                k: summarize(r[2][k] for r in records)["median"]
                for k in ("settle_s", "snapshot_s", "snapshot_wait_s", "plan_s", "schedule_s")
            }
        if method == "nvrx_async":
            entry["checksum_s_per_save"] = summarize(r[2]["checksum_s"] for r in records)
        if method != "memcpy":
            entry["state_dict_s"] = summarize(r[2]["state_dict_s"] for r in records)
        # The next forward and backward after this method's save: for the project, with the
        # snapshot copy running beside it (compare the memcpy floor's: nothing beside it).
        entry["next_step_s"] = summarize(r[2]["next_step_s"] for r in records)
        if method in TORCH_ASYNC:
            entry["staging_options"] = stagers[method][1]
        if method in steps:
            busy = summarize(steps[method]["busy"])
            entry["step_s_idle"], entry["step_s_save_in_flight"] = summarize(steps[method]["idle"]), busy
            # How long a write stays in flight while the steps run (a nice'd writer yields to them);
            # None where it was still in flight when stepping stopped (INTERFERENCE_MAX_S).
            entry["write_in_flight_s_while_stepping"] = summarize(steps[method]["in_flight"])
            entry["writes_past_stepping_window"] = sum(v is None for v in steps[method]["in_flight"])
            entry["interference"] = round(busy["median"] / idle_all["median"], 3)
        methods_out[method] = entry
    return {
        "target_mb": target_mb,
        "state_mb": round(total_bytes / 1e6, 1),
        "per_rank_mb": round(local_bytes / 1e6, 1),
        "layers": layers,
        "state_dict_s": round(state_dict_s, 4),
        "step_s_idle": idle_all,
        "methods": methods_out,
    }, step


def _save_eval_checkpoint(
    ckpt: Any, step: int, rank: int, world: int, mesh: Any, device: Any, spec: dict[str, Any]
) -> dict[str, Any]:
    """A training checkpoint of the ``spec["eval_model"]`` GPT (FSDP2 over the ranks, AdamW state
    after one step), committed by the project's checkpointer: what evaluation loads."""
    import torch

    from fsdp_resilience.training.checkpointing.snapshot import app_state
    from fsdp_resilience.training.model import cross_entropy_loss
    from fsdp_resilience.training.parallelize import build_sharded_model

    model = build_sharded_model(spec["eval_model"], mesh, device, seed=1234, max_seq_len=spec["eval_seq_len"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    tokens = torch.randint(0, 256, (2, spec["eval_seq_len"] + 1), generator=torch.Generator().manual_seed(rank))
    tokens = tokens.to(device)
    cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    optimizer.step()
    ckpt.save(step, app_state(model, optimizer, {"step": step}))
    ckpt.wait()
    return {"model": spec["eval_model"], "saved_world_size": world, "step": step}
