"""What the fsdp_training DAG's tasks hand each other, typed: the run (``Run``: validate_config's
result), a launch (``Launch``: launch_training's and relaunch's), and what a watch saw of a launch
(``Outcome``: the watch sensors'). XCom stores JSON-able dicts: a task returns ``x.to_dict()`` and
reads another's with ``Run.from_dict(...)`` (``Launch``, ``Outcome``), which says by name which
keys are missing or unknown. No Airflow here: the ladder, the bench and the tests use them as is.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, TypeVar

T = TypeVar("T", bound="TaskData")


class TaskDataError(ValueError):
    """A task's XCom is not the task data it should be (missing or unknown keys, not a dict)."""


class TaskData:
    """``to_dict``/``from_dict`` for the dataclasses below."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls: type[T], data: Mapping[str, Any]) -> T:
        """The task data from its ``to_dict()`` (an XCom), or ``TaskDataError`` naming what does not fit."""
        if not isinstance(data, Mapping):
            raise TaskDataError(
                f"{cls.__name__} comes from a dict (a task's XCom), got {type(data).__name__}: {data!r}"
            )
        fields = dataclasses.fields(cls)  # type: ignore[arg-type]
        known = {f.name for f in fields}
        required = {
            f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        }
        missing, unknown = sorted(required - set(data)), sorted(set(data) - known)
        if missing or unknown:
            problems = [
                f"missing {', '.join(missing)}" if missing else "",
                f"unknown {', '.join(unknown)}" if unknown else "",
            ]
            raise TaskDataError(
                f"not {cls.__name__} task data: {'; '.join(p for p in problems if p)} (keys: "
                f"{', '.join(sorted(known))}); was the XCom written by another version of the "
                "DAG? Clear the task and its upstream to run them again"
            )
        return cls(**data)

    @classmethod
    def of(cls: type[T], value: T | Mapping[str, Any]) -> T:
        """``value`` itself when it is already this task data, else ``from_dict(value)``: operators
        take either (a DAG hands them an XCom's dict, a test or the bench the dataclass)."""
        return value if isinstance(value, cls) else cls.from_dict(value)


@dataclass(frozen=True)
class Run(TaskData):
    """A training run as validate_config accepted it: the run config (``RunConfig.to_dict()``),
    the backend it trains on (``TrainingBackend.to_config()``), how many node replacements the
    ladder may do, and the Airflow DAG run it belongs to (None outside Airflow: the bench)."""

    config: dict[str, Any]
    backend: dict[str, Any]
    max_node_replacements: int
    airflow_run_id: str | None = None


@dataclass(frozen=True)
class Launch(TaskData):
    """A submitted launch of a run: what the watch and the spare pool keeper need to follow it."""

    backend: dict[str, Any]
    handle: dict[str, Any]  # the launch's JobHandle.to_dict()
    run_dir: str
    final_step: int
    stall_timeout_s: float
    launched_at: float
    #: The run dir's S3 export, when the triggerer reads checkpoints there instead of on FSx.
    checkpoints_s3: str | None = None
    aws_conn_id: str | None = None

    @property
    def launch_id(self) -> str:
        return self.handle["launch_id"]


@dataclass(frozen=True)
class Outcome(TaskData):
    """What a watch saw of a launch: ``outcome`` is None while the launch is still healthy and
    running (a poke that is not done yet), else success, failed or no_progress (the watch's XCom)."""

    outcome: str | None
    failure_class: str | None
    message: str
    step: int  # newest committed step (0: none yet)
    checkpoint_id: str | None
    launch_id: str
    handle: dict[str, Any]  # the launch's JobHandle, so the escalation ladder can act on it
    job_state: str
    last_progress_at: float
    nodes: list[dict[str, Any]] = field(default_factory=list)
