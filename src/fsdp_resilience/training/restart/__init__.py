"""The restart layers inside a job, built on NVIDIA Resiliency Extension (NVRx).

Two layers, chosen by ``RunConfig.restart_mode``:

- **in-process** (``inprocess.Wrapper``): an exception or a Python-level hang in any rank is
  recovered inside the same processes; every rank re-enters the training function, which builds
  a fresh process group and reloads the newest committed checkpoint. Cheap (seconds).
- **in-job** (``ft_launcher``): a dead, frozen or silent rank (SIGKILL, OOM, SIGSTOP, node loss)
  is detected by the launcher's rank monitors (heartbeats and sections) and the whole worker group
  is respawned in the same pods, up to ``--max-restarts``.

``layered`` stacks them: ft_launcher outside, the Wrapper inside. Anything the Wrapper cannot
handle (a rank gone, the in-process budget spent) leaves the process with a non-zero exit, which
ft_launcher turns into an in-job restart. Worker-side pieces live here; the launcher command is
built in ``fsdp_resilience.training.launch.command``.

Tested with nvidia-resiliency-ext 0.4.1 and 0.7.0 (the GPU image's; ``make test-nvrx07``) on CPU;
differences are feature-detected where noted.

The parts:

- ``rank_monitor``: the worker's link to ft_launcher (heartbeats, sections, derived timeouts);
- ``wrapper``: the in-process ``inprocess.Wrapper`` and its abort / finalize steps;
- ``process_group``: each attempt's default process group and the store it outlives;
- ``gloo_transport``: breaking an attempt's gloo connections when it fails;
- ``fault_kinds``: which faults are the platform's, and the user-error abort.
"""
