"""The training worker: one process per rank, started by ft_launcher or torchrun.

    python -m fsdp_resilience.training.train --config RUN.json

(normally started via ``python -m fsdp_resilience.training.launch``)

One attempt of ``Trainer.run`` = build a process group, shard the model, restore the newest
committed checkpoint that verifies, train to ``cfg.steps`` with asynchronous checkpoints. The
in-process restart layer calls ``run`` again in the same process after a fault; the in-job layer
starts a new process.

Faults no restart can fix stop every layer: the first rank to see one writes the run's stop marker
(``contract.declare_stop``), asks ft_launcher to shut the workload down, and leaves with a
BaseException the in-process Wrapper does not retry:

- a user error: the same exception at the same step on two attempts
  (``restart.fault_kinds.UserErrorAbort``);
- a storage error: the run dir is full or read-only (``StopTraining``, exit 74);
- non-finite state: the loss or gradient norm became NaN/inf again after
  ``cfg.max_nonfinite_rollbacks`` rollbacks (``StopTraining``, exit 65).

Non-finite state is found without a host sync per step: each rank keeps a flag on its device and
the ranks compare flags on logging steps and always before a checkpoint save, so a non-finite
step's state is never saved. Each detection rolls the run back, in place, to the newest verified
checkpoint (the process group stays; no restart budget is spent).

RNG: each rank's torch generator (dropout) starts from ``rank_seed(cfg.seed, rank)`` and its state is
saved per rank in every checkpoint, so a resume replays bitwise; see ``rng.rank_seed``.

The parts:

- ``cli``: the command line (``main``): refuse a stopped run, run the Trainer under the restart
  layers, turn how it ended into the exit code;
- ``loop``: ``Trainer``: one attempt (``run``), its restore, and the training loop (``_train``);
- ``fault_handling``: what the Trainer does on a fault, on non-finite state, on a drill, and how
  it reports the restart it recovers from;
- ``startup``: the device, the job's restart round, a restore's longer collective timeout;
- ``env``: where this worker sits (rank, world size, node, attempt), from the environment;
- ``rng``: each rank's RNG seed and its state in checkpoints.
"""
