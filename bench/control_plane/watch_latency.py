"""Checkpoint commit -> the watch sees it: ``TrainingProgressTrigger`` driven with asyncio against a
stand-in job, as the triggerer runs it."""

from __future__ import annotations

import asyncio
import random
import shutil
import time
from pathlib import Path
from typing import Any

from bench.common import summarize
from fsdp_resilience.control.backends import JobStatus, TrainingBackend


def _stand_in_status(self: Any, handle: Any) -> JobStatus:
    path = Path(self.state_dir) / "state"
    state = path.read_text().strip() if path.exists() else "running"
    return JobStatus(state=state, failure_class="success" if state == "succeeded" else None)


def _not_here(self: Any, *args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("the watch benchmark's stand-in job only answers status()")


#: A stand-in job for timing the watch alone: its state is what the benchmark writes to
#: ``<state_dir>/state`` ("running" until then). The watch only asks for ``status``; every other
#: method of the interface (whatever it holds by now) says it is not used here.
RunDirJob = type(
    "RunDirJob",
    (TrainingBackend,),
    {
        **{name: _not_here for name in TrainingBackend.__abstractmethods__},
        "__module__": __name__,
        "__doc__": "Stand-in job whose state the watch benchmark sets.",
        "name": "bench-rundir",
        "__init__": lambda self, state_dir: setattr(self, "state_dir", state_dir),
        "status": _stand_in_status,
        "to_config": lambda self: {"name": "bench-rundir", "state_dir": self.state_dir},
    },
)


def bench_watch(work: Path, trials: int, poll_s: float, seed: int) -> dict[str, Any]:
    """Commit the final checkpoint at a random phase of the trigger's poll loop (and mark the job
    succeeded) and time until the trigger fires: how long a commit waits to be seen."""
    from fsdp_resilience.control.backends import JobHandle, register_backend
    from fsdp_resilience.control.triggers.training_progress import TrainingProgressTrigger
    from fsdp_resilience.training.contract import CheckpointCatalog, RunDir, write_rank_sums

    register_backend(RunDirJob.name, RunDirJob)
    rng = random.Random(seed)
    final = 10

    async def trial(root: Path) -> tuple[float, dict[str, Any]]:
        layout = RunDir(root / "run")
        layout.create()
        trigger = TrainingProgressTrigger(
            backend={"name": RunDirJob.name, "state_dir": str(root)},
            handle=JobHandle(backend=RunDirJob.name, run_id="watch", launch_id="0", job_name="watch-0").to_dict(),
            run_dir=str(layout.root),
            final_step=final,
            stall_timeout_s=3600.0,
            launched_at=time.time(),
            poll_interval_s=poll_s,
        )
        fired: asyncio.Future = asyncio.get_running_loop().create_future()

        async def run_trigger() -> None:
            async for event in trigger.run():
                fired.set_result((time.time(), event.payload))
                return

        task = asyncio.ensure_future(run_trigger())
        try:
            await asyncio.sleep(poll_s * rng.uniform(0.02, 1.0))  # at a random phase of the poll loop

            def commit() -> float:
                # What the ranks leave before rank 0 commits: their shards with checksum records
                # (commit() refuses a checkpoint without them) and DCP's .metadata.
                path = layout.checkpoint_dir(final)
                path.mkdir(parents=True)
                for rank in range(2):
                    (path / f"__{rank}_0.distcp").write_bytes(b"bench")
                    write_rank_sums(path, rank, [f"__{rank}_0.distcp"])
                (path / ".metadata").write_bytes(b"bench")
                committed_at = CheckpointCatalog(layout).commit(final, world_size=2).committed_at
                (root / "state").write_text("succeeded")  # the job ends after its last commit
                return committed_at

            committed = await asyncio.to_thread(commit)
            fired_at, payload = await asyncio.wait_for(fired, timeout=4 * poll_s + 30)
            return fired_at - committed, payload
        finally:
            task.cancel()

    latencies = []
    for i in range(trials):
        root = work / "watch" / f"trial-{i}"
        shutil.rmtree(root, ignore_errors=True)
        latency, payload = asyncio.run(trial(root))
        if payload.get("outcome") != "success" or payload.get("step") != final:
            raise RuntimeError(f"the trigger fired {payload}, expected success at step {final}")
        latencies.append(latency)
    return {
        "poll_interval_s": poll_s,
        "trials": trials,
        "commit_to_trigger_event_s": summarize(latencies),
        "note": "TrainingProgressTrigger run with asyncio as the triggerer runs it; the final checkpoint is "
        "committed with CheckpointCatalog at a random phase of its poll loop; latency = the "
        "TriggerEvent - the commit marker's committed_at. The poll interval bounds it (the "
        "sensor's default is 5 s).",
    }
