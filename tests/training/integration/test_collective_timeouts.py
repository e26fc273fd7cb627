"""Every process group a training attempt waits on has the run's collective timeout
(fsdp_resilience.training.restart.process_group, parallelize.mesh_groups, the checkpointer's save
protocol group), on a 2-node x 2-rank HSDP mesh of four real gloo processes.

torch gives a group made without an explicit timeout its backend's default (gloo 30 min, NCCL
10 min), and ``init_device_mesh`` passes none: the replicate and shard groups would not keep the
timeout order the run config checked. The restore's longer timeout covers them too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from training.support import REPO, free_port

RANK = textwrap.dedent(
    """
    import json, sys
    import torch, torch.distributed as dist
    from fsdp_resilience.training.checkpointing.checkpointer import AsyncCheckpointer
    from fsdp_resilience.training.parallelize import device_mesh, mesh_groups
    from fsdp_resilience.training.restart.process_group import (
        app_store, check_collective_timeouts, collective_timeout_s, init_process_group, set_collective_timeout,
    )
    from fsdp_resilience.training.train.startup import restore_timeout

    def timeouts(groups):
        return [collective_timeout_s(None)] + [collective_timeout_s(g) for g in groups]

    init_process_group("gloo", 0, 7.0, 120.0, app_store())
    groups = mesh_groups(device_mesh(torch.device("cpu"), 2, 2))
    seen = {"mesh_dims": len(groups), "as_torch_made_them": timeouts(groups)}
    set_collective_timeout(7.0, groups)
    check_collective_timeouts(7.0, groups)
    seen["set"] = timeouts(groups)
    with restore_timeout(7.0, 90.0, groups):
        seen["restoring"] = timeouts(groups)
    seen["after_restore"] = timeouts(groups)
    ckpt = AsyncCheckpointer(sys.argv[1], async_save=False)
    ckpt.rebind(dist.group.WORLD, timeout_s=7.0)
    seen["save_protocol"] = [collective_timeout_s(ckpt._group), str(dist.get_backend(ckpt._group))]
    try:
        check_collective_timeouts(5.0, groups)
    except RuntimeError as e:
        seen["check"] = str(e)
    ckpt.close()
    print("SEEN " + json.dumps(seen), flush=True)
    dist.destroy_process_group()
    """
)


def test_the_mesh_groups_and_the_save_protocol_group_get_the_collective_timeout(tmp_path):
    port = free_port()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "4"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")])
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(tmp_path / "run")],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank % 2)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(4)
    ]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=240)[0])
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-2000:] for o in outputs)
    for out in outputs:
        seen = json.loads(next(line for line in out.splitlines() if line.startswith("SEEN "))[5:])
        assert seen["mesh_dims"] == 2
        # What torch made: the default group has the run's timeout, the mesh's groups gloo's default.
        assert seen["as_torch_made_them"] == [7.0, 1800.0, 1800.0]
        assert seen["set"] == [7.0, 7.0, 7.0]
        assert seen["restoring"] == [90.0, 90.0, 90.0]
        assert seen["after_restore"] == [7.0, 7.0, 7.0]
        assert seen["save_protocol"] == [7.0, "gloo"]
        assert "has a collective timeout of 7s, not the run's 5s" in seen["check"]
