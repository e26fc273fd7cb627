"""`make gpu-check`: the training plane on the GPUs of one CUDA machine, checked and measured.

    python -m bench.gpu_check [--only train,checkpoint,...] [--gpus N] [--time-limit S] [--dry-run]

World size = the number of GPUs (NCCL needs one rank per GPU; one GPU is enough). Checks, in this
order, each in its own processes and bounded by its own timeout and by what is left of the whole
command's time limit (TIME_LIMIT_S, 7.5 min), so one that hangs cannot block the rest:

  train         bf16 FSDP2 training with the product command, ``python -m fsdp_resilience.training.launch``
                (``small`` preset, NCCL, layered restarts): step time, tokens/s, final loss, exit 0
  evaluate      ``python -m fsdp_resilience.training.evaluate`` on the ``train`` run's checkpoint: finite loss
  exception     an exception in rank 0, recovered in-process on NCCL (restart latency)
  while_saving  an exception in rank 0 at the save protocol's round while a save is pending,
                recovered in-process (not escalated to an in-job restart)
  hang          a hang in rank 0, recovered in-process on NCCL (restart latency)
  sigkill       rank 0 SIGKILLed, recovered in-job by ft_launcher (restart latency)
  checkpoint    checkpointing.checkpointer.AsyncCheckpointer on CUDA with the ``1b`` preset's state:
                its stall within STALL_TARGET × a pinned-memory memcpy of the same bytes, peak
                /dev/shm use, and no CUDA context in the writer process
  memory        the ``1b`` preset sharded over the GPUs, AdamW as training builds it, a few steps at
                its default seq_len and batch size: peak memory allocated per GPU within
                MEMORY_TOLERANCE of model_sizes.memory_per_gpu for the same GPU count

Prints a PASS or FAIL line per check, writes docs/gpu.md (figures and versions: torch, CUDA, NCCL,
NVRx, GPUs, driver) and bench/results/gpu.json; run dirs and logs stay in runs/gpu-check/. Exit 0
when every check passed.

Without a GPU, or with --dry-run, it checks its own wiring instead, in seconds: every run config
validates, ``fsdp_resilience.training.launch --dry-run`` prints a launcher command for each scenario, the modules
and command lines it uses resolve, and the report writer works (on a temp path: docs/gpu.md is
never touched by a dry run). Then it exits 0.
"""

from bench.gpu_check.checks import CHECKS, WORKERS
from bench.gpu_check.configs import DOC, JSON_OUT, LAUNCH_SCENARIOS

__all__ = ["CHECKS", "DOC", "JSON_OUT", "LAUNCH_SCENARIOS", "WORKERS"]
