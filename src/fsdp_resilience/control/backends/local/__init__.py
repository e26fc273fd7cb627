"""The embedded default backend: training jobs as process groups on this machine.

A "node" is a local slot (``slot-0`` .. ``slot-N``), a job is one ``python -m fsdp_resilience.training.launch``
per node, and FSx is a local folder. Nothing is kept in memory: the state lives in files under
``state_dir``, so any process (an Airflow worker, the triggerer, a test) can ask about a job that
another process submitted and then left::

    <state_dir>/
      .lock                         flock(2) around every read-modify-write of the files below
      slots.json                    per slot: healthy | quarantined, reason, since (a slot returned to
                                    service: who returned it and the quarantine it ended)
      jobs/<job_name>.json          per node: slot, command, log path, pid, pgid, start time,
                                    exit code, standby (a spare) and why it was added; cancel and
                                    failure-policy marks; train_nodes (the launch's cfg.nodes)
      jobs/<job_name>.supervisor.log

Detaching. ``submit`` starts a small *supervisor* process that forks once and exits, and reaps
that exit at once, so the caller keeps no child (a long-lived triggerer collects no zombies). The
forked supervisor, adopted by init, starts the node launchers, each in its own session, and waits
for them, so no launcher is left a zombie either; it records their exit codes and acts like a
Kubernetes Job controller's failure policy: once the job has failed (the rule of ``judge_job``,
which ``status`` applies too), the other nodes get ``failure_grace_s`` to end by themselves and
are then stopped; so are spares still parked once no node trains any more. Every process of a job carries
``FSDP_RESILIENCE_LOCAL_JOB=<job>/<node>`` in its environment (read from /proc; psutil where there
is none), so ``cancel`` also finds what a launcher started in other sessions (ft_launcher,
workers, checkpoint writers), orphans included.

Job state comes from the run contract, not from the supervisor: a node is done when its launcher
wrote its ``final`` event for this launch (``launch_id``). A node whose launcher is gone without
one, and that nobody stopped, is *lost*: the job fails with ``restarts_exhausted`` (the restart
layers went down with the node) and ``diagnose`` blames that slot.

Hot spares (``spare_nodes``): a job runs ``launch_nodes`` launchers, those with index >= ``nodes``
as standbys (``fsdp_resilience.training.launch`` parks them in the rendezvous). One rule, ``job_can_train``, says
whether the job goes on: a lost node with a spare behind it leaves the job running (the spare takes
its place at the next in-job restart). A standby that ends without ever training (its launcher
left the rendezvous, or we stopped it because its slot was quarantined) is a *dropped* spare: it
fails nothing by itself. ``add_spare`` appends a node to a running job's record; the supervisor
starts it at its next poll. ``replace_nodes`` stops a parked spare on a slot it quarantines, so a
bad slot's spare is never promoted.

Each launch's config is written to ``<run_dir>/launches/<launch_id>.json`` and each node logs to
``<run_dir>/logs/<job_name>-node<i>.log``. To debug the supervisor, run
``python -m fsdp_resilience.control.backends.local.supervisor --state-dir DIR --job NAME --foreground``
on a submitted job record.

The modules: ``backend`` (``LocalProcessBackend``), ``state`` (the files above), ``verdict``
(``judge_job``), ``processes`` (/proc, process groups, liveness, stopping), ``launching`` (starting
the supervisor and waiting for its launchers), ``supervisor`` (run as a module by ``submit``; nothing
here imports it), ``slots`` (quarantine, return to service, capacity) and ``evaluation``
(``run_evaluation``'s subprocess).
"""

from fsdp_resilience.control.backends.local.backend import (
    REPO_ROOT,
    TRAINING_PYTHON_ENV,
    LocalProcessBackend,
)
from fsdp_resilience.control.backends.local.processes import JOB_TAG_ENV, stop_job_processes, tagged_processes
from fsdp_resilience.control.backends.local.state import StateStore
from fsdp_resilience.control.backends.local.verdict import DROPPED_SPARE, judge_job

__all__ = [
    "DROPPED_SPARE",
    "JOB_TAG_ENV",
    "REPO_ROOT",
    "TRAINING_PYTHON_ENV",
    "LocalProcessBackend",
    "StateStore",
    "judge_job",
    "stop_job_processes",
    "tagged_processes",
]
