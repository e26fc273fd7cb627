"""Where a training worker sits, from the variables torchrun / ft_launcher (and the node's
launcher) set. No torch: cheap to import and to test."""

from __future__ import annotations

import os
from dataclasses import dataclass

from fsdp_resilience.training import faults


@dataclass(frozen=True)
class WorkerEnv:
    """Where this worker sits, from the variables torchrun / ft_launcher set."""

    rank: int
    local_rank: int
    world_size: int
    #: The node as launched (fsdp_resilience.training.launch's node rank), not rendezvous's join order.
    node_rank: int
    #: This node agent's TORCHELASTIC_RESTART_COUNT: 0 on the first launch. NVRx 0.7 sets it to the
    #: job's rendezvous round (the same on every node, kept by a node that joins late); 0.4.1 to the
    #: restarts of this node's agent, so a replacement node that joins a running job starts at 0
    #: while the others count on. The trainer agrees on the job's round (the largest count of any
    #: rank: ``Trainer.attempt``), which both versions then give alike.
    attempt: int

    @classmethod
    def from_environ(cls) -> "WorkerEnv":
        env = os.environ
        return cls(
            rank=int(env.get("RANK", 0)),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            world_size=int(env.get("WORLD_SIZE", 1)),
            node_rank=int(env.get(faults.NODE_RANK_ENV, env.get("GROUP_RANK", 0))),
            attempt=int(env.get("TORCHELASTIC_RESTART_COUNT", 0)),
        )
