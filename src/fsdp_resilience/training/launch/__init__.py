"""The one command a training pod (or a local process group) runs:

    python -m fsdp_resilience.training.launch --config RUN.json [--node-rank N] [--rdzv-host HOST] [--dry-run]

It validates the run, takes this node's launch lock, checks that the run dir takes writes, builds
the NVRx launcher command for this node, runs it, watches it, and exits with the run contract's
exit code after writing a ``final`` event:

  restart_mode  launcher                                   what restarts what
  layered       ft_launcher + inprocess.Wrapper in workers exceptions/hangs in-process; dead,
                                                           frozen or silent ranks by ft_launcher
  injob         ft_launcher                                any rank failure -> worker group respawn
  inprocess     torchrun --max-restarts 0 + Wrapper        exceptions/hangs in-process only
  none          torchrun --max-restarts 0                  nothing

Exit codes (src/fsdp_resilience/training/contract/failures.py: ExitCode, FailureClass):

  0   success             trained every step; the final checkpoint is committed
  2   (config error)      bad config, arguments, dataset, or a run/dataset dir that is a file or
                          sits under one: one line on stderr, nothing started, no event
  65  non_finite          a rank declared non-finite training state (control/STOP.json)
  73  already_running     another fsdp_resilience.training.launch of this run holds this node's launch lock
                          (control/launch-node<N>.lock): one line, no event, nothing changed
  74  storage_error       the run dir is full or read-only: at start (one line, no event), or as
                          the reason a launch failed (a rank's STOP.json, or a probe after it)
  75  restarts_exhausted  ft_launcher gave up after max_restarts (or a rank failed without
                          in-job restarts): suspect the machine
  78  user_error          a rank declared a user error (the same error at the same step twice)
  93  no_progress         no new committed checkpoint within stall_timeout_s, or NVRx 0.7's
                          progress tracking stopped ft_launcher
  1   unknown             anything else: killed from outside, or the workers never started
                          (ft_launcher failed before any rank began training: read its log)

Processes: one launch per run per node (an exclusive ``flock`` on the node's lock file, held until
every process of the launch is gone). Between this process and ft_launcher sits a small guard
(``supervise``): a child subreaper that outlives every rank, NVRx helper and daemon of the launch
(they are reparented to it, whatever sessions they start), kills them all when ft_launcher exits,
and kills them at once when this process dies, even by SIGKILL (its parent-death signal).

The run config comes from --config (a JSON file), else from TRAINING_RUN_CONFIG (the JSON
itself: how an EKS pod gets it, with no file to ship).

Where this node sits comes from the flags, else the environment:
  node rank      --node-rank, JOB_COMPLETION_INDEX (a Kubernetes Indexed Job), NODE_RANK, 0
  rendezvous     --rdzv-host, TRAINING_RDZV_HOST (e.g. the headless Service name of pod 0),
                 MASTER_ADDR, 127.0.0.1 on a single node

This package does not import torch: it starts in milliseconds and rejects bad input before any
expensive work starts. Its parts:

- ``cli``: the command line (``main``): validate, lock, check storage, prepare, run;
- ``config``: where the run config, the node rank and the rendezvous host come from;
- ``command``: the ft_launcher / torchrun command and ft_launcher's YAML;
- ``lock``: one launch per run per node; ``storage``: whether the run dir takes writes;
- ``guard``: the subreaper between this process and ft_launcher (nothing outlives a launch);
- ``node``: ``NodeLauncher``, which runs and watches one node's launcher;
- ``outcome``: what a launch's end means (``FailureClass``, the ``final`` record's message);
- ``event_tail``: reading the events log incrementally.
"""
