"""The run configuration: ``RunConfig`` (validated, JSON round-trip, clear errors on bad values)
and the fault drills it can carry (``FaultDrill``).

Each field has its docstring under it (what it is, its unit, its valid range); the reference
generator (``fsdp_resilience.training.contract.reference``) reads them from this file's source.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsdp_resilience.training.contract.failures import ConfigError
from fsdp_resilience.training.contract.rundir import RunDir
from fsdp_resilience.training.contract.timeouts import (
    DEFAULT_GLOO_COLLECTIVE_TIMEOUT_S,
    NCCL_TIMEOUT_MARGIN_S,
    RestartTimeouts,
)

#: The restart layers a run may use, and what restarts what in each (``python -m
#: fsdp_resilience.training.launch`` builds the launcher command from it).
RESTART_MODE_LAYERS = {
    "layered": "ft_launcher + inprocess.Wrapper in the workers: exceptions and hangs are restarted in-process; "
    "dead, frozen or silent ranks by ft_launcher (in-job restart of the worker group)",
    "injob": "ft_launcher: any rank failure -> the worker group is respawned (in-job restart)",
    "inprocess": "torchrun --max-restarts 0 + inprocess.Wrapper: exceptions and hangs in-process only; "
    "a dead rank ends the launch",
    "none": "torchrun --max-restarts 0: nothing restarts inside the launch (the control plane's ladder may relaunch)",
}
RESTART_MODES = tuple(RESTART_MODE_LAYERS)
DEVICES = ("auto", "cpu", "cuda")
#: Model presets; the shapes live in src/fsdp_resilience/training/model.py (which needs torch).
MODEL_PRESETS = ("tiny", "tiny-dropout", "small", "1b", "8b")
#: The fault drills (``FaultDrill.kind``) and what each does.
FAULT_DRILLS = {
    "exception": "a Python exception in one rank (recovered in-process)",
    "hang": "a Python-level busy hang in one rank (soft timeout)",
    "sigstop": "SIGSTOP of one rank: the process freezes (hard timeout / heartbeat)",
    "sigkill": "SIGKILL of one rank",
    "oom": "exit 137, as the kernel's OOM killer would",
    "node_loss": "every rank of one node dies at once",
    "checkpoint_crash": "the async checkpoint writer dies mid-save",
    "writer_hang": "the async checkpoint writer is SIGSTOPped mid-save (frozen, not dead)",
    "nan": "the loss of one rank becomes NaN (a diverging run, bad data)",
    "user_bug": "raises on every attempt: must end as USER_ERROR, never retried",
}
FAULT_KINDS = tuple(FAULT_DRILLS)
#: ``RunConfig.log_interval`` when unset, per collective backend. On CUDA a logged step syncs the
#: host with the GPU (the loss all-reduce and ``.tolist()``): the CPU stops queueing kernels ahead
#: until the step ends. A pending save's commit round (a gloo all-reduce across nodes) runs at
#: logged steps only. Once in 20 steps pays a twentieth of both.
LOG_INTERVAL_DEFAULT = {"gloo": 1, "nccl": 20}
#: The drills that may fire in the save protocol's round (``FaultDrill.while_saving``): one rank's own faults.
WHILE_SAVING_KINDS = ("exception", "hang", "sigstop", "sigkill", "oom")
_RUN_ID_RE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")

#: Spare nodes a run may ask for, and spares the control plane may add to one launch after
#: promotions (node indices ``launch_nodes`` .. ``node_rank_limit - 1``).
MAX_SPARE_NODES = 8
MAX_SPARE_REFILLS = 16


@dataclass(frozen=True)
class FaultDrill:
    """A deterministic fault: ``kind`` at training step ``step`` in global rank ``rank``.

    ``attempt`` is the launcher restart round it fires in (0 = the first launch; null = every
    round, as a faulty machine would); ``once`` (with ``attempt`` null): it fires the first time
    any round reaches it and never again, whatever the rounds are numbered (with spares on NVRx
    0.4.1 a round that swaps a spare in is a membership change, which keeps the round); ``node``
    (for ``node_loss``, with spares) may be null: the training node that holds the highest global
    rank outside node 0, which hosts the rendezvous store (with spares, which node trains is the
    rendezvous' choice, so an index may be parked when the step comes); ``node`` selects the node
    for ``node_loss`` (rank is ignored there); ``node_id``, when set, limits the drill to processes
    on that node or local slot (``TRAINING_NODE_ID``), so a "bad node" drill stops once the node is replaced. A
    ``user_bug`` fires on every attempt, by definition.
    """

    kind: str
    """What happens: one of ``FAULT_KINDS`` (see ``FAULT_DRILLS``)."""
    step: int
    """The training step it fires at: 1 .. ``steps``."""
    rank: int = 0
    """The global rank it fires in: 0 .. world size - 1 (ignored by ``node_loss``)."""
    attempt: int | None = 0
    """The launcher restart round it fires in: 0 (the first launch) .. 100, or null for every round."""
    node: int | None = 0
    """The node index a ``node_loss`` takes down: 0 .. ``launch_nodes`` - 1; null (``node_loss`` with
    spares and at least 2 nodes only): the training node with the highest global rank outside node 0."""
    node_id: str | None = None
    """When set, only processes on this node or local slot (``TRAINING_NODE_ID``) fire it; null: any node."""
    once: bool = False
    """With ``attempt`` null: fire the first time any round reaches it and never again (not for ``user_bug``)."""
    while_saving: bool = False
    """Fire at the step's save-protocol round (before the checkpointer polls a pending save, or a save
    settles) instead of before the forward, so the peers wait in the save protocol's collective. At the
    step after a checkpoint step the save begun there is still pending. For exception, hang, sigstop,
    sigkill and oom, at a step after the first checkpoint step."""

    def validate(self, cfg: "RunConfig", where: str) -> None:
        if self.kind not in FAULT_KINDS:
            raise ConfigError(f"{where}.kind={self.kind!r} is not a fault kind; use one of {', '.join(FAULT_KINDS)}")
        if not 1 <= self.step <= cfg.steps:
            raise ConfigError(f"{where}.step={self.step} must be between 1 and steps={cfg.steps}")
        if not 0 <= self.rank < cfg.world_size:
            raise ConfigError(f"{where}.rank={self.rank} must be a global rank in [0, {cfg.world_size})")
        if self.node is None:
            if self.kind != "node_loss" or not cfg.spare_nodes or cfg.nodes < 2:
                raise ConfigError(
                    f"{where}.node=null (a training node other than node 0) is for a node_loss in a run "
                    "with spare_nodes and at least 2 nodes; give a node index otherwise"
                )
        elif not 0 <= self.node < cfg.launch_nodes:
            raise ConfigError(
                f"{where}.node={self.node} must be a node index in [0, {cfg.launch_nodes}) "
                f"(nodes {cfg.nodes} + spare_nodes {cfg.spare_nodes})"
            )
        if self.attempt is not None and (
            isinstance(self.attempt, bool) or not isinstance(self.attempt, int) or not 0 <= self.attempt <= 100
        ):
            raise ConfigError(f"{where}.attempt={self.attempt!r} must be between 0 and 100, or null for every attempt")
        if not isinstance(self.once, bool) or (self.once and (self.attempt is not None or self.kind == "user_bug")):
            raise ConfigError(
                f"{where}.once={self.once!r}: once is true or false, and a drill that fires once "
                "takes attempt null (any round) and is not a user_bug (which fires every time)"
            )
        if not isinstance(self.while_saving, bool) or (
            self.while_saving and (self.kind not in WHILE_SAVING_KINDS or self.step <= cfg.checkpoint_interval)
        ):
            raise ConfigError(
                f"{where}.while_saving={self.while_saving!r}: true or false; a drill while saving is one of "
                f"{', '.join(WHILE_SAVING_KINDS)}, at a step after the first checkpoint step "
                f"(checkpoint_interval={cfg.checkpoint_interval}), e.g. step {cfg.checkpoint_interval + 1}"
            )
        if self.node_id is not None and (not isinstance(self.node_id, str) or not self.node_id):
            raise ConfigError(f"{where}.node_id must be a node name or null, got {self.node_id!r}")


def _check_int(name: str, value: Any, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise ConfigError(f"{name}={value} is out of range: it must be between {lo} and {hi}")


def _check_float(name: str, value: Any, lo: float, hi: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    if not lo <= value <= hi:
        raise ConfigError(f"{name}={value} is out of range: it must be between {lo} and {hi}")


def _check_folder_path(name: str, value: str) -> None:
    """A folder path must not be, or sit under, something that is not a folder (a regular file):
    nothing could ever be written there. Parts that do not exist yet are fine (created later; on
    the control plane an FSx path is usually not mounted at all)."""
    path = Path(value)
    for candidate in (path, *path.parents):
        try:
            if candidate.exists():
                if not candidate.is_dir():
                    what = "is" if candidate == path else f"sits under {candidate}, which is"
                    raise ConfigError(f"{name}={value} {what} a file, not a folder; choose a folder path")
                return
        except OSError:  # unreadable or too long: let the first real access report it
            return


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name}={value!r} is not valid; use one of {', '.join(choices)}")


@dataclass(frozen=True)
class RunConfig:
    """Everything a training run needs; both planes build it, one JSON file carries it."""

    run_id: str
    """The run's name: 1-63 lowercase letters, digits or '-', starting and ending with a letter or
    digit (it names Kubernetes objects)."""
    run_dir: str
    """The run's folder (``RunDir``): a local folder, or on EKS a path on FSx for Lustre. Not a file,
    nor under one."""
    dataset_dir: str
    """The dataset folder (``byte-tokens-v1``, see ``read_dataset_index``). Not a file, nor under one."""
    model: str = "tiny"
    """The model preset: one of ``MODEL_PRESETS``."""
    nodes: int = 1
    """Training nodes: 1 .. 1024."""
    spare_nodes: int = 0
    """Hot spares: node launchers started beyond ``nodes`` that wait in the rendezvous without
    training, and take a lost node's place at the next in-job restart (no relaunch). Ranks,
    data order and checkpoints stay those of ``nodes`` nodes. 0 .. ``MAX_SPARE_NODES``; needs
    restart_mode layered or injob."""
    procs_per_node: int = 2
    """Training processes (ranks) per node: 1 .. 64."""
    steps: int = 100
    """Training steps of the whole run: 1 .. 10,000,000."""
    batch_size: int = 8
    """Sequences per rank per step: 1 .. 65,536."""
    seq_len: int = 128
    """Tokens per sequence: 8 .. 131,072."""
    lr: float = 3e-3
    """Learning rate: above 0, at most 10."""
    weight_decay: float = 0.1
    """AdamW weight decay: 0 .. 10."""
    grad_clip: float = 1.0
    """Gradient norm clipping threshold: 0 .. 1e6."""
    seed: int = 1234
    """Seed of the model init, the data order and each rank's RNG: 0 .. 2**31 - 1."""
    checkpoint_interval: int = 10
    """Steps between checkpoints: 1 .. 10,000,000."""
    keep_checkpoints: int = 3
    """Committed checkpoints retention keeps: 1 .. 1000."""
    restart_mode: str = "layered"
    """The restart layers: one of ``RESTART_MODES`` (see ``RESTART_MODE_LAYERS``)."""
    max_restarts: int = 3
    """In-job (ft_launcher) restarts per launch: 0 .. 1000."""
    max_inprocess_restarts: int = 5
    """In-process (Wrapper) restarts per launcher round: 0 .. 1000."""
    collective_timeout_s: float | None = None
    """The process groups' collective timeout, seconds: 0.5 .. 3600. None: derived per backend
    (``timeouts``): 30 s on gloo, where it bounds in-process restart latency; above the Wrapper's
    hard timeout on NCCL."""
    heartbeat_timeout_s: float = 120.0
    """ft_launcher: a rank silent this long (seconds) is restarted: 1 .. 86,400."""
    initial_heartbeat_timeout_s: float = 600.0
    """ft_launcher's heartbeat timeout before a rank's first heartbeat (start, restore), seconds:
    1 .. 86,400."""
    hang_timeout_s: float = 60.0
    """The Wrapper's soft timeout (hard = 2x), seconds: no progress this long -> in-process restart.
    1 .. 86,400; below ``heartbeat_timeout_s`` in layered mode."""
    timeout_safety_factor: float = 5.0
    """ft_launcher's heartbeat and step / checkpoint section timeouts are derived once an attempt
    has run its warm steps and two saves (src/fsdp_resilience/training/restart/rank_monitor.py:
    RankMonitor): this factor x the longest interval seen after the first save, kept above the
    restart layers' order and never above ``heartbeat_timeout_s``, which is what applies until
    then (``RestartTimeouts.derive``). 1 .. 100."""
    stall_timeout_s: float = 1800.0
    """No new committed checkpoint this long (seconds) -> ``no_progress``: 1 .. 30 days."""
    device: str = "auto"
    """Where ranks train: one of ``DEVICES`` (``auto``: CUDA when present, else CPU)."""
    rdzv_port: int = 29400
    """The rendezvous port, on node 0's address: 1024 .. 65,000."""
    log_interval: int | None = None
    """Steps between ``step`` events, and between the rounds that commit a pending save: 1 ..
    1,000,000; null: ``LOG_INTERVAL_DEFAULT`` for the backend (1 on CPU; 20 on CUDA, where each
    logged step waits for the GPU to finish and each round is a collective across nodes)."""
    eval_batches: int = 8
    """Validation batches ``fsdp_resilience.training.evaluate`` averages: 1 .. 100,000."""
    gpu_health_checks: bool = True
    """NVRx's NVML GPU / NVLink / NIC checks before an in-process restart (CUDA only; a rank that
    fails them leaves the job, so ft_launcher restarts it or the ladder replaces the node)."""
    max_nonfinite_rollbacks: int = 2
    """Times a NaN/inf loss or grad norm rolls the run back to the newest verified checkpoint
    before it ends as ``non_finite``: 0 .. 100."""
    faults: tuple[FaultDrill, ...] = field(default_factory=tuple)
    """Fault drills to inject (``FaultDrill``; objects with kind and step in JSON); empty for a real run."""

    def __post_init__(self) -> None:
        # Accept faults as dicts (from JSON) and normalise to FaultDrill tuples.
        faults = []
        for i, f in enumerate(self.faults or ()):
            if isinstance(f, FaultDrill):
                faults.append(f)
            elif isinstance(f, dict):
                unknown = set(f) - {x.name for x in dataclasses.fields(FaultDrill)}
                if unknown:
                    raise ConfigError(f"faults[{i}] has unknown field(s) {sorted(unknown)}")
                try:
                    faults.append(FaultDrill(**f))
                except TypeError as e:
                    raise ConfigError(f"faults[{i}] is incomplete: {e}; it needs kind and step") from None
            else:
                raise ConfigError(f"faults[{i}] must be an object with kind and step, got {f!r}")
        object.__setattr__(self, "faults", tuple(faults))
        self.validate()

    # -- derived ------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node

    @property
    def launch_nodes(self) -> int:
        """Node launchers a launch starts: the training nodes and the spares behind them."""
        return self.nodes + self.spare_nodes

    @property
    def node_rank_limit(self) -> int:
        """Node indices a launcher of this run may hold: the launch's own, then the indices of
        spares added while it runs (each refill takes a new one, so no two live launchers of a
        run ever share an index, nor NVRx 0.7's infrastructure rank that follows it)."""
        return self.launch_nodes + MAX_SPARE_REFILLS

    @property
    def layout(self) -> "RunDir":
        return RunDir(self.run_dir)

    @property
    def collective_backends(self) -> tuple[str, ...]:
        """The collective backends this run may use: its device decides (``auto``: either)."""
        return {"cpu": ("gloo",), "cuda": ("nccl",)}.get(self.device, ("gloo", "nccl"))

    def log_every(self, backend: str) -> int:
        """Steps between logged steps (and a pending save's commit rounds) on ``backend``."""
        return self.log_interval if self.log_interval is not None else LOG_INTERVAL_DEFAULT[backend]

    def timeouts(self, backend: str) -> "RestartTimeouts":
        """Every restart-layer timeout of this run on ``backend`` ("gloo" or "nccl")."""
        if backend not in ("gloo", "nccl"):
            raise ConfigError(f"collective backend {backend!r} is not supported; use gloo or nccl")
        hard = 2 * self.hang_timeout_s
        collective = self.collective_timeout_s
        if collective is None:
            collective = DEFAULT_GLOO_COLLECTIVE_TIMEOUT_S if backend == "gloo" else hard + NCCL_TIMEOUT_MARGIN_S
        return RestartTimeouts(
            backend=backend,
            collective_s=float(collective),
            soft_s=self.hang_timeout_s,
            hard_s=hard,
            heartbeat_s=self.heartbeat_timeout_s,
            initial_heartbeat_s=self.initial_heartbeat_timeout_s,
        )

    def section_timeouts(self) -> dict[str, float]:
        """ft_launcher's section timeouts as configured (the sections RankMonitor reports): what
        applies until timeouts are derived, and, after that, while ``setup`` (start, process
        group, restore) or ``final_checkpoint`` (waiting for the last write) is open."""
        return {
            "setup": self.initial_heartbeat_timeout_s,
            "step": self.heartbeat_timeout_s,
            "checkpoint": self.heartbeat_timeout_s,
            "final_checkpoint": self.initial_heartbeat_timeout_s,
        }

    # -- validation ---------------------------------------------------------------------------
    def validate(self) -> None:
        if not isinstance(self.run_id, str) or not _RUN_ID_RE.match(self.run_id):
            raise ConfigError(
                f"run_id={self.run_id!r} must be 1-63 lowercase letters, digits or '-', "
                "starting and ending with a letter or digit (it names Kubernetes objects)"
            )
        for name in ("run_dir", "dataset_dir"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ConfigError(f"{name} must be a non-empty path, got {value!r}")
        _check_choice("model", self.model, MODEL_PRESETS)
        _check_int("nodes", self.nodes, 1, 1024)
        _check_int("spare_nodes", self.spare_nodes, 0, MAX_SPARE_NODES)
        _check_int("procs_per_node", self.procs_per_node, 1, 64)
        _check_int("steps", self.steps, 1, 10_000_000)
        _check_int("batch_size", self.batch_size, 1, 65_536)
        _check_int("seq_len", self.seq_len, 8, 131_072)
        _check_float("lr", self.lr, 0.0, 10.0)
        if self.lr == 0:
            raise ConfigError("lr must be greater than 0")
        _check_float("weight_decay", self.weight_decay, 0.0, 10.0)
        _check_float("grad_clip", self.grad_clip, 0.0, 1e6)
        _check_int("seed", self.seed, 0, 2**31 - 1)
        _check_int("checkpoint_interval", self.checkpoint_interval, 1, 10_000_000)
        _check_int("keep_checkpoints", self.keep_checkpoints, 1, 1000)
        _check_choice("restart_mode", self.restart_mode, RESTART_MODES)
        if self.spare_nodes and self.restart_mode not in ("layered", "injob"):
            raise ConfigError(
                f"spare_nodes={self.spare_nodes} needs in-job restarts (restart_mode layered or injob; "
                f"it is {self.restart_mode}): a spare takes a lost node's place at an in-job restart"
            )
        _check_int("max_restarts", self.max_restarts, 0, 1000)
        _check_int("max_inprocess_restarts", self.max_inprocess_restarts, 0, 1000)
        if self.collective_timeout_s is not None:
            _check_float("collective_timeout_s", self.collective_timeout_s, 0.5, 3600.0)
        _check_float("heartbeat_timeout_s", self.heartbeat_timeout_s, 1.0, 86_400.0)
        _check_float("initial_heartbeat_timeout_s", self.initial_heartbeat_timeout_s, 1.0, 86_400.0)
        _check_float("hang_timeout_s", self.hang_timeout_s, 1.0, 86_400.0)
        _check_float("timeout_safety_factor", self.timeout_safety_factor, 1.0, 100.0)
        _check_float("stall_timeout_s", self.stall_timeout_s, 1.0, 30 * 86_400.0)
        _check_choice("device", self.device, DEVICES)
        _check_int("rdzv_port", self.rdzv_port, 1024, 65_000)
        if self.log_interval is not None:
            _check_int("log_interval", self.log_interval, 1, 1_000_000)
        _check_int("eval_batches", self.eval_batches, 1, 100_000)
        _check_int("max_nonfinite_rollbacks", self.max_nonfinite_rollbacks, 0, 100)
        if not isinstance(self.gpu_health_checks, bool):
            raise ConfigError(f"gpu_health_checks must be true or false, got {self.gpu_health_checks!r}")
        for backend in self.collective_backends:
            self.timeouts(backend).check(self.restart_mode)
        for name in ("run_dir", "dataset_dir"):
            _check_folder_path(name, getattr(self, name))
        for i, f in enumerate(self.faults):
            f.validate(self, f"faults[{i}]")

    # -- (de)serialisation --------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["faults"] = [dataclasses.asdict(f) for f in self.faults]
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RunConfig":
        if not isinstance(data, dict):
            raise ConfigError(f"a run config must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown run config field(s) {unknown}; known fields: {sorted(known)}")
        missing = sorted(
            f.name
            for f in dataclasses.fields(cls)
            if f.name not in data and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        )
        if missing:
            raise ConfigError(f"run config is missing required field(s) {missing}")
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> "RunConfig":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"run config is not valid JSON: {e}") from None
        return cls.from_dict(data)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "RunConfig":
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ConfigError(f"cannot read run config {path}: {e.strerror}") from None
        return cls.from_json(text)

    def replace(self, **changes: Any) -> "RunConfig":
        return dataclasses.replace(self, **changes)

    def fault_at(
        self, step: int, rank: int, attempt: int, node: int, node_id: str | None = None, loss_target: int | None = None
    ) -> FaultDrill | None:
        """The drill that fires at this step in this rank, launcher attempt and node, if any
        (``loss_target``: the node a ``node_loss`` with node null takes down, see FaultDrill)."""
        for f in self.faults:
            if f.step != step:
                continue
            if f.kind != "user_bug" and f.attempt is not None and f.attempt != attempt:
                continue
            if f.node_id is not None and f.node_id != node_id:
                continue
            if f.kind == "node_loss" and (f.node == node or (f.node is None and node == loss_target)):
                return f
            if f.kind != "node_loss" and f.rank == rank:
                return f
        return None
