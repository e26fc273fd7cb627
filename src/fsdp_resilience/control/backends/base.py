"""One interface for running training jobs, whatever runs them.

Shaped like the Kubeflow Trainer SDK's backends: the DAGs talk to a ``TrainingBackend`` and never
to Kubernetes or local processes directly, so the local backend (one machine, process groups) and
the EKS backend (an Indexed Job per launch) are interchangeable by configuration alone.

Everything a backend returns is a small dataclass with ``to_dict``/``from_dict`` that survives
JSON, because it travels through Airflow XCom and deferrable-trigger kwargs.

Torch-free: the control plane imports this module; only ``fsdp_resilience.training.contract`` is shared with the
data plane.
"""

from __future__ import annotations

import abc
import dataclasses
import getpass
import hashlib
import importlib
import os
import re
import socket
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from fsdp_resilience.training.contract import RunConfig

# --------------------------------------------------------------------------------------------
# Job and node states (the failure rules are the contract's: contract.FINAL_FAILURES and co.)
# --------------------------------------------------------------------------------------------

JobState = Literal["pending", "running", "succeeded", "failed"]
JOB_STATES: tuple[str, ...] = ("pending", "running", "succeeded", "failed")
#: A node that vanished without its launcher reporting (no ``final`` event): the machine, the pod
#: or the process group died under it. Its job fails with ``restarts_exhausted``: the restart
#: layers inside the job went with the node, and a relaunch on another node may succeed.
LOST = "lost"
#: Per node: the job states, plus ``lost``.
NODE_STATES: tuple[str, ...] = (*JOB_STATES, LOST)

# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


class BackendError(RuntimeError):
    """A backend could not do what was asked; the message says why and what to do."""


class InsufficientCapacityError(BackendError):
    """Not enough healthy, free nodes for the job right now."""


class JobNotFoundError(BackendError):
    """No job is known for this handle (wrong backend, state dir or cluster?)."""


class JobConflictError(BackendError):
    """Another launch of the same run is still active; two launches would share one run dir."""


# --------------------------------------------------------------------------------------------
# Job names
# --------------------------------------------------------------------------------------------

#: Kubernetes names an Indexed Job's pods' hostnames ``<job>-<index>``, and a hostname is a
#: DNS-1123 label of at most 63 characters. 52 (the CronJob limit) leaves room for the index.
JOB_NAME_MAX = 52
#: Put before a name that would start with a digit: a Service (and so the rendezvous DNS name) must
#: be a DNS-1035 label, which starts with a letter.
JOB_NAME_LETTER_PREFIX = "r-"
_DNS_UNSAFE = re.compile(r"[^a-z0-9-]+")


def job_name_for(run_id: str, launch_id: str, max_len: int = JOB_NAME_MAX) -> str:
    """The job's name: deterministic per (run, launch), a DNS-1035 label (lowercase letters, digits
    and '-', starting with a letter, ending with a letter or digit), at most ``max_len``.

    Readable (``<run_id>-<launch_id>``, cut to fit) with a short hash of the exact pair, so two
    launches whose readable parts coincide after cutting or cleaning never share a name. A run id
    that starts with a digit (``7b-llama``) gets ``r-`` in front: the EKS backend names the Job's
    Service and NetworkPolicy the same, and a Service name must start with a letter. Names that
    already started with a letter are what they always were.
    """
    if not run_id or not launch_id:
        raise ValueError(f"a job needs a run_id and a launch_id, got run_id={run_id!r} launch_id={launch_id!r}")
    if max_len < len(JOB_NAME_LETTER_PREFIX) + 8 + 2:
        raise ValueError(f"max_len={max_len} leaves no room for a readable part and the hash")
    digest = hashlib.sha256(f"{run_id}\0{launch_id}".encode()).hexdigest()[:8]
    readable = _DNS_UNSAFE.sub("-", f"{run_id}-{launch_id}".lower())
    readable = re.sub(r"-{2,}", "-", readable).strip("-")
    prefix = "" if readable[:1].isalpha() else JOB_NAME_LETTER_PREFIX
    readable = readable[: max_len - len(prefix) - len(digest) - 1].strip("-")
    return f"{prefix}{readable}-{digest}" if readable else f"{prefix}{digest}"


# --------------------------------------------------------------------------------------------
# What backends return (JSON-safe: XCom and trigger kwargs)
# --------------------------------------------------------------------------------------------


class _Serializable:
    """``to_dict``/``from_dict`` for flat dataclasses of JSON values."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls, data: dict[str, Any]):
        if not isinstance(data, dict):
            raise TypeError(f"{cls.__name__}.from_dict needs a dict, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        return cls(**{k: v for k, v in data.items() if k in names})  # unknown keys: a newer writer


@dataclass(frozen=True)
class JobHandle(_Serializable):
    """How to find a submitted job again, from any process."""

    backend: str
    run_id: str
    launch_id: str
    job_name: str
    #: Backend-specific coordinates (local: state dir, run dir; EKS: namespace, cluster).
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class NodeStatus(_Serializable):
    """One node (pod, local slot) of a job."""

    index: int
    node_id: str | None
    state: str  # one of NODE_STATES
    #: A ``fsdp_resilience.training.contract.FailureClass`` value once the node ended.
    failure_class: str | None = None
    exit_code: int | None = None
    message: str = ""

    @property
    def key(self) -> str:
        """Which node of the job this is: its index and machine. On EKS a pod the Job recreates
        for a lost index keeps the index on another machine, and is another node."""
        return node_key(self.index, self.node_id)


def node_key(index: int, node_id: str | None) -> str:
    """``NodeStatus.key`` from its parts (as events record them)."""
    return f"{int(index)}@{node_id}"


@dataclass(frozen=True)
class JobStatus(_Serializable):
    """A job's state: ``failed`` as soon as any node failed (or was lost), ``succeeded`` when every
    node did. With spares (``spare_nodes``), a lost node, or a spare dropped before it trained,
    fails the job only when too few nodes are left to train (``job_can_train``); ``succeeded``
    then means every other node did. ``failure_class`` is a ``fsdp_resilience.training.contract.FailureClass``
    value once the job is done (``success`` when it succeeded), None while it runs."""

    state: JobState
    failure_class: str | None = None
    #: node index -> the node's exit code in the run contract (None: lost, no code known).
    exit_codes: dict[int, int | None] = field(default_factory=dict)
    message: str = ""
    nodes: list[NodeStatus] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.state in ("succeeded", "failed")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["exit_codes"] = {str(k): v for k, v in self.exit_codes.items()}  # JSON keys are strings
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "JobStatus":
        return cls(
            state=data["state"],
            failure_class=data.get("failure_class"),
            exit_codes={int(k): v for k, v in (data.get("exit_codes") or {}).items()},
            message=data.get("message", ""),
            nodes=[NodeStatus.from_dict(n) for n in data.get("nodes") or []],
        )


@dataclass(frozen=True)
class Diagnosis(_Serializable):
    """Why a job failed, and which node(s) to blame. ``replaceable`` only when replacing those
    nodes and relaunching can help and at least one node is blamed: restarts exhausted, no progress
    or a lost node; or any fault the code, data or storage reported on a node that says it is
    unhealthy (a monitoring agent's condition, an NVRx health check) — never a user error on
    nodes healthy by every signal. ``signals``: blamed node -> the evidence against it."""

    failure_class: str | None
    bad_node_ids: list[str] = field(default_factory=list)
    replaceable: bool = False
    evidence: list[str] = field(default_factory=list)
    signals: dict[str, list[str]] = field(default_factory=dict)


@dataclass(frozen=True)
class Replacement(_Serializable):
    """What ``replace_nodes`` did: nodes taken out of service (and, where the platform does it,
    replaced by new ones), nodes it refused to touch, and why."""

    replaced: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    reason: str = ""


@dataclass(frozen=True)
class Capacity(_Serializable):
    """The node pool: how many nodes there are, how many are healthy, which are quarantined."""

    total: int
    healthy: int
    quarantined: list[str] = field(default_factory=list)
    healthy_node_ids: list[str] = field(default_factory=list)
    #: The platform adds nodes when a job's pods wait for them (Karpenter): a launch need not wait
    #: for ``healthy`` to reach its node count first.
    provisions_on_demand: bool = False

    def fits(self, nodes: int) -> bool:
        """Whether a job of ``nodes`` nodes can be launched now."""
        return self.provisions_on_demand or self.healthy >= nodes


@dataclass(frozen=True)
class ServiceReturn(_Serializable):
    """What ``return_nodes`` did: nodes back in service, nodes that were not quarantined (left as
    they are), nodes that no longer exist (EKS: replaced by their Auto Scaling group or Karpenter;
    nothing to return). ``fsdp_resilience.control.quarantine.format_return`` says it in words."""

    returned: list[str] = field(default_factory=list)
    not_quarantined: list[str] = field(default_factory=list)
    gone: list[str] = field(default_factory=list)


def require_reason(reason: str | None) -> str:
    """The reason a node returns to service, stripped; refused when empty, because the record is
    what the next person to see the node relies on."""
    text = reason.strip() if isinstance(reason, str) else ""
    if not text:
        raise BackendError(
            f"returning nodes to service needs a reason, got {reason!r}: say what was checked or "
            "fixed, e.g. --reason 'GPU reseated, dcgmi diag -r 3 passed'"
        )
    return text


def current_operator() -> str:
    """Who is returning nodes, for the record when the caller does not say: user@host."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # a container user with no passwd entry and no $USER
        user = f"uid {os.getuid()}"
    return f"{user}@{socket.gethostname()}"


# --------------------------------------------------------------------------------------------
# The backend interface and its registry
# --------------------------------------------------------------------------------------------


class TrainingBackend(abc.ABC):
    """Runs training jobs: one ``fsdp_resilience.training.launch`` per node, all nodes of a launch in one job.

    Every method may be called from any process (an Airflow worker, the triggerer, a test): the
    backend keeps no state in memory that another process would need.
    """

    #: The registry name ("local", "eks").
    name: ClassVar[str]

    @abc.abstractmethod
    def submit(self, cfg: RunConfig, launch_id: str, *, airflow_run_id: str | None = None) -> JobHandle:
        """Start ``cfg.launch_nodes`` nodes of the run as one job (``nodes`` that train and
        ``spare_nodes`` that wait as hot spares), tagged with ``launch_id`` (and the Airflow DAG
        run that asked, where the platform can show it).

        Idempotent: submitting the same (run_id, launch_id) again returns the existing job and
        starts nothing (an Airflow task retried after a crash must not start a second copy).
        Raises InsufficientCapacityError when there are not enough healthy nodes.
        """

    @abc.abstractmethod
    def status(self, handle: JobHandle) -> JobStatus:
        """The job's state now. Cheap enough to poll every few seconds.

        With spares, losing a node does not fail the job while enough nodes are left to train
        (``job_can_train``): the job stays ``running`` and the lost node shows as ``lost`` in
        ``nodes`` (a spare takes its place in the next in-job restart)."""

    async def status_async(self, handle: JobHandle) -> JobStatus:
        """``status`` for the triggerer's event loop. Backends with an async client override it;
        the default runs ``status`` in a thread."""
        import asyncio

        return await asyncio.to_thread(self.status, handle)

    def change_paths(self, handle: JobHandle) -> list[str]:
        """Files this backend rewrites when the job's state changes in a way the run's events log
        does not show (a node lost without its ``final`` event). The watch stats them between its
        polls and checks at once when one changes. Default: none (state behind an API)."""
        return []

    def event_feed(self, run_dir: str) -> Any:
        """Where the control plane reads a run's events log as it grows (the run report in the
        Airflow UI): an ``EventFeed``. Both backends write the run dir to a file system the control
        plane mounts (a local folder; FSx on EKS), or export it to S3 (``FSDP_CHECKPOINTS_S3``):
        the default reads it there (``report.event_feed.event_feed_for``)."""
        from fsdp_resilience.control.report.event_feed import event_feed_for

        return event_feed_for(run_dir)

    def add_spare(self, handle: JobHandle, reason: str) -> NodeStatus:
        """Give a running job one more spare node, after a spare took a lost node's place
        (``cfg.spare_nodes``): the job's pool is whole again. The new node's launcher joins the
        rendezvous as a standby (fsdp_resilience.training.launch: a node that starts once the launch's training
        nodes train waits as a spare). Quarantining the lost node is ``replace_nodes``' job.
        Returns the new node's status. Raises InsufficientCapacityError when no healthy node is
        free, BackendError when the job is not running."""
        raise BackendError(f"the {self.name} backend cannot add a spare node to a running job")

    @abc.abstractmethod
    def logs(self, handle: JobHandle, node: int | None = None, tail: int = 200) -> str:
        """The last ``tail`` lines of one node's log, or of every node's (``node=None``)."""

    @abc.abstractmethod
    def cancel(self, handle: JobHandle) -> None:
        """Stop every process of the job (graceful first). Safe to call on a finished job."""

    @abc.abstractmethod
    def diagnose(self, handle: JobHandle) -> Diagnosis:
        """Why a failed job failed, and which node(s) to replace, with the evidence."""

    @abc.abstractmethod
    def replace_nodes(self, node_ids: list[str], reason: str) -> Replacement:
        """Take ``node_ids`` out of service (and replace them where the platform can), refusing
        more than ``max_unhealthy_share`` of the pool at once."""

    @abc.abstractmethod
    def capacity(self) -> Capacity:
        """The node pool now. Cheap: the DAG polls it while waiting for capacity."""

    def check_launch(self, cfg: RunConfig) -> Any:
        """Raise BackendError for what would make ``submit`` refuse ``cfg`` before anything starts
        (a missing training environment, an image outside the allowlist, ...). validate_config
        calls it, so bad input fails before anything expensive starts. The default checks nothing."""
        return None

    def check_capacity(self, cfg: RunConfig) -> Capacity:
        """Raise InsufficientCapacityError when the pool can never hold ``cfg`` as it is (more
        nodes than it has); a pool that is only busy, or whose bad nodes are being replaced, is
        waited for. Returns the capacity it saw."""
        capacity = self.capacity()
        if not capacity.provisions_on_demand and cfg.nodes > capacity.total:
            raise InsufficientCapacityError(
                f"run {cfg.run_id} needs {cfg.nodes} node(s) but the {self.name} backend's pool has {capacity.total}: "
                "lower nodes, or grow the pool"
            )
        return capacity

    # -- quarantine: the way back -----------------------------------------------------------------
    def quarantined_nodes(self) -> list[dict[str, Any]]:
        """The nodes ``replace_nodes`` took out of service that are still out: one dict each with
        ``node_id``, ``reason``, ``since`` (epoch seconds, None when unknown) and what else the
        platform knows (EKS: ``ready``, ``instance_id``). Oldest first."""
        raise BackendError(f"the {self.name} backend keeps no quarantine it could list")

    def return_nodes(
        self, node_ids: list[str], reason: str, *, by: str | None = None, quarantined_before: float | None = None
    ) -> ServiceReturn:
        """Return quarantined nodes to service, recording ``reason`` (required), who (``by``,
        default user@host) and when. Only nodes this project quarantined are touched; with
        ``quarantined_before``, only those quarantined before that time (epoch seconds)."""
        raise BackendError(f"the {self.name} backend keeps no quarantine to return nodes from")

    def return_expired(self, cooldown_s: float, now: float | None = None) -> list[str]:
        """Return the nodes quarantined for longer than ``cooldown_s`` (FSDP_QUARANTINE_COOLDOWN_S),
        with the reason "automatic return after cool-down of Ns". Returns those changed."""
        if isinstance(cooldown_s, bool) or not isinstance(cooldown_s, (int, float)) or not cooldown_s > 0:
            raise BackendError(
                f"cooldown_s={cooldown_s!r}: the cool-down must be a positive number of seconds "
                "(0 means automatic return is off)"
            )
        now = time.time() if now is None else float(now)
        cutoff = now - cooldown_s
        expired = [
            q["node_id"] for q in self.quarantined_nodes() if q.get("since") is not None and q["since"] <= cutoff
        ]
        if not expired:
            return []
        # quarantined_before: a node quarantined again since the list was read keeps its new quarantine.
        return self.return_nodes(
            expired,
            f"automatic return after cool-down of {cooldown_s:g}s",
            by="cool-down (FSDP_QUARANTINE_COOLDOWN_S)",
            quarantined_before=cutoff,
        ).returned

    @abc.abstractmethod
    def run_evaluation(
        self, cfg: RunConfig, checkpoint_id: str | None = None, timeout_s: float = 3600.0
    ) -> dict[str, Any]:
        """Evaluate checkpoint ``checkpoint_id`` of the run (None: the newest committed one) where
        its training ran (the training environment: a local process, a pod) and return the result
        (``<run_dir>/eval.json``). Blocks until done; raises BackendError with the evaluation's
        output when it fails."""

    @abc.abstractmethod
    def to_config(self) -> dict[str, Any]:
        """JSON-safe settings that rebuild this backend, ``name`` included:
        ``get_backend(**b.to_config())``. This is how a deferred task hands its backend to the
        triggerer."""

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "TrainingBackend":
        """A backend from settings such as ``{"name": "local", "state_dir": "..."}`` (what
        ``to_config`` returns; the same as ``get_backend(**config)``).

        On the base class ``name`` picks the implementation; on an implementation it may be left
        out. ``backend`` is accepted for ``name``.
        """
        config = dict(config)
        name = config.pop("name", None) or config.pop("backend", None)
        if cls is TrainingBackend:
            if not name:
                raise BackendError(
                    f'backend config {config} does not say which backend: add "name": one of {available_backends()}'
                )
            return get_backend(name, **config)
        if name and name != cls.name:
            raise BackendError(f"{cls.__name__} cannot be built from a {name!r} backend config")
        return cls(**config)

    def _check_handle(self, handle: JobHandle) -> None:
        if handle.backend != self.name:
            raise BackendError(
                f"job {handle.job_name} belongs to the {handle.backend!r} backend, "
                f"not {self.name!r}; use get_backend({handle.backend!r})"
            )


#: name -> "module:Class". Implementations are imported on first use, so a missing optional
#: dependency of one backend (the Kubernetes client) never breaks another.
_BACKENDS: dict[str, str] = {
    "local": "fsdp_resilience.control.backends.local:LocalProcessBackend",
    "eks": "fsdp_resilience.control.backends.eks:EksBackend",
}


def register_backend(name: str, target: str | type[TrainingBackend]) -> None:
    """Make ``get_backend(name)`` build ``target`` (a class, or "module:Class")."""
    if isinstance(target, type):
        target = f"{target.__module__}:{target.__qualname__}"
    _BACKENDS[name] = target


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def backend_class(name: str) -> type[TrainingBackend]:
    try:
        target = _BACKENDS[name]
    except KeyError:
        raise BackendError(f"unknown training backend {name!r}; use one of {available_backends()}") from None
    module_name, _, class_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise BackendError(
            f"the {name!r} training backend is not available here ({module_name} could not be "
            f"imported: {e}); install it or use one of {available_backends()}"
        ) from e
    return getattr(module, class_name)


def get_backend(name: str, **kwargs: Any) -> TrainingBackend:
    """The backend called ``name``, built with ``kwargs``: ``get_backend("local", state_dir=...)``,
    or ``get_backend(**config)`` with a config that holds ``name``."""
    return backend_class(name)(**kwargs)
