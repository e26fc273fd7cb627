"""The restart layers' timeouts: how they must be ordered on each collective backend, and how
ft_launcher's are derived from what the warm steps measured."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from fsdp_resilience.training.contract.failures import ConfigError

#: The collective timeout on gloo when the run config leaves it unset.
DEFAULT_GLOO_COLLECTIVE_TIMEOUT_S = 30.0
#: How far a derived heartbeat / section timeout stays above the pauses it must outlast (see
#: ``RestartTimeouts.derived_floor_s``): room for the Wrapper's tear-down (about 1 s measured on
#: gloo) and for scheduling noise on a loaded machine.
DERIVED_TIMEOUT_MARGIN_S = 2.0
#: ft_launcher's sections whose timeouts are derived from the warm steps: what those steps measure.
#: ``setup`` (start, process group, restore) and ``final_checkpoint`` (waiting for the last write)
#: are not measured by them and keep the configured timeouts.
DERIVED_SECTIONS = ("step", "checkpoint")
#: On NCCL, how far the collective timeout is set above the Wrapper's hard timeout when unset.
NCCL_TIMEOUT_MARGIN_S = 60.0


@dataclass(frozen=True)
class RestartTimeouts:
    """The timeouts of the restart layers on one collective backend, and the order they must keep.

    - ``soft_s`` (``hang_timeout_s``): the in-process Wrapper interrupts a rank that made no
      progress this long and restarts in place; ``hard_s`` (2x soft): it kills the rank.
    - ``heartbeat_s``: ft_launcher restarts the worker group when a rank is silent this long.
    - ``collective_s``: the process groups' timeout.

    gloo: nothing aborts a blocked gloo receive. A rank that raises shuts its connections down, so
    its peers learn at once; but a hung rank cannot, and its peers learn of it only when their
    collective times out. Heartbeats pause that long during an in-process restart, so
    ``heartbeat_s`` must exceed ``collective_s``.

    NCCL: with ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` (torch's default) the watchdog kills a rank whose
    collective timed out. NVRx's in-process guide requires the NCCL timeout to exceed the Wrapper's
    hard timeout; otherwise the watchdog kills the healthy ranks waiting on a hung one before the
    Wrapper can recover it, and no hang is ever recovered in-process.
    """

    backend: str
    collective_s: float
    soft_s: float
    hard_s: float
    heartbeat_s: float
    initial_heartbeat_s: float

    def check(self, restart_mode: str) -> None:
        in_process = restart_mode in ("layered", "inprocess")
        monitored = restart_mode in ("layered", "injob")
        where = f"on {self.backend} ({'CPU' if self.backend == 'gloo' else 'CUDA'})"
        if self.backend == "nccl" and in_process and self.collective_s <= self.hard_s:
            raise ConfigError(
                f"collective_timeout_s={self.collective_s} must exceed the in-process hard timeout "
                f"(2 x hang_timeout_s = {self.hard_s}) {where}: otherwise the NCCL watchdog kills the "
                "healthy ranks before a hang can be recovered in-process. Raise it, or leave it unset "
                f"to get {self.hard_s + NCCL_TIMEOUT_MARGIN_S}"
            )
        if self.backend == "gloo" and monitored and self.heartbeat_s <= self.collective_s + 1:
            # An in-process restart pauses heartbeats for about one collective timeout; a shorter
            # heartbeat timeout makes ft_launcher kill ranks that were recovering by themselves.
            raise ConfigError(
                f"heartbeat_timeout_s={self.heartbeat_s} must exceed collective_timeout_s + 1 "
                f"= {self.collective_s + 1} {where}, so in-process restarts are not cut short"
            )
        if restart_mode == "layered" and self.soft_s >= self.heartbeat_s:
            # Otherwise ft_launcher kills a hung rank before the Wrapper can recover it in place.
            raise ConfigError(
                f"hang_timeout_s={self.soft_s} must be below heartbeat_timeout_s={self.heartbeat_s} "
                "in layered mode, so hangs are recovered in-process first"
            )

    def derived_floor_s(self, restart_mode: str, longest_interval_s: float) -> float:
        """The shortest heartbeat (and ``step`` / ``checkpoint`` section) timeout that keeps this
        class's order, given the longest interval seen between two heartbeats:

        - gloo, monitored: an in-process restart pauses heartbeats for a collective timeout plus
          the step it cut short, so the timeout must outlast that pause, or ft_launcher kills ranks
          that were recovering by themselves;
        - layered: above the Wrapper's soft timeout, so it acts on hangs first.

        Plus ``DERIVED_TIMEOUT_MARGIN_S``."""
        floor = longest_interval_s
        if self.backend == "gloo" and restart_mode in ("layered", "injob"):
            floor = max(floor, self.collective_s + longest_interval_s)
        if restart_mode == "layered":
            floor = max(floor, self.soft_s)
        return floor + DERIVED_TIMEOUT_MARGIN_S

    def derive(
        self, restart_mode: str, safety_factor: float, heartbeat_interval_s: float, section_s: dict[str, float]
    ) -> "DerivedTimeouts":
        """ft_launcher's timeouts from what the warm steps measured (the longest interval between
        heartbeats, and the longest time each of ``DERIVED_SECTIONS`` was open, over all ranks):
        ``safety_factor`` x the measure, never below ``derived_floor_s`` and never above the
        configured timeout (the ceiling: a run never gets a longer timeout than it asked for).
        A section not measured (``section_s`` lacks it, or it is <= 0) keeps its configured timeout."""
        floor = self.derived_floor_s(restart_mode, heartbeat_interval_s)

        def bounded(measured: float) -> float:
            return round(min(self.heartbeat_s, max(floor, safety_factor * measured)), 3)

        sections = {
            name: bounded(section_s[name]) if section_s.get(name, 0) > 0 else self.heartbeat_s
            for name in DERIVED_SECTIONS
        }
        return DerivedTimeouts(
            heartbeat_s=bounded(heartbeat_interval_s),
            sections=sections,
            initial_heartbeat_s=self.initial_heartbeat_s,
            floor_s=round(floor, 3),
            ceiling_s=self.heartbeat_s,
            safety_factor=safety_factor,
            measured_heartbeat_interval_s=round(heartbeat_interval_s, 4),
            measured_section_s={k: round(v, 4) for k, v in section_s.items() if v > 0},
        )


@dataclass(frozen=True)
class DerivedTimeouts:
    """ft_launcher's heartbeat and section timeouts as derived in a run, and what from: recorded in
    the events log (``timeouts_derived``) and the run dir (``RunDir.derived_timeouts``).

    ``initial_heartbeat_s`` (before the first heartbeat of an attempt: start and restore) is never
    derived: it keeps the configured value."""

    heartbeat_s: float
    sections: dict[str, float]
    initial_heartbeat_s: float
    floor_s: float
    ceiling_s: float
    safety_factor: float
    measured_heartbeat_interval_s: float
    measured_section_s: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
