"""The worker's link to ft_launcher's rank monitor: heartbeats, sections, workload control, and
the timeouts derived from what this worker measured."""

from __future__ import annotations

import json
import os
from typing import Callable

from nvidia_resiliency_ext.fault_tolerance import (
    RankMonitorClient,
    RankMonitorClientError,
    WorkloadAction,
    WorkloadControlRequest,
)

from fsdp_resilience.training.contract import (
    DERIVED_SECTIONS,
    DerivedTimeouts,
    Event,
    EventLog,
    RestartTimeouts,
    RunConfig,
    atomic_write_text,
)

FT_SOCKET_ENV = "FT_RANK_MONITOR_IPC_SOCKET"  # set by ft_launcher for each worker

#: Heartbeats an attempt sends before it derives ft_launcher's timeouts (with two saves among them).
WARM_HEARTBEATS = 5


class RankMonitor:
    """The worker's link to ft_launcher: heartbeats, sections, workload control, and the timeouts
    derived from what this worker measured.

    A no-op when the worker was not started by ft_launcher (``restart_mode`` inprocess/none).
    Started at every in-process iteration, as NVRx requires a fresh client per attempt.

    Timeouts: ft_launcher starts with the configured ones (``RunConfig.section_timeouts``). In
    each attempt (in-process iteration), NVRx's ``TimeoutsCalc`` in the client measures the
    intervals between heartbeats and how long each section stays open. The start, the restore
    and the first save (it may wait for the checkpoint writer to boot) are one-off costs: the
    measure starts after the first save. At the first heartbeat after the next save, once
    ``WARM_HEARTBEATS`` were sent, every rank derives the same tighter heartbeat, ``step`` and
    ``checkpoint`` timeouts from it (``derive_when_warm``), so a frozen rank is found in seconds.
    They apply while training steps and saves run; entering ``setup`` (a restore) or
    ``final_checkpoint`` (waiting for the last write), which were not measured, puts the
    configured timeouts back. A rank monitor keeps what it was last sent across worker restarts,
    so every attempt begins by sending it the configured timeouts.

    Monitoring must never be what kills training: an in-process interrupt can cut an exchange with
    the rank monitor short, leaving the server's view of our sections out of step. On any error the
    client reconnects and keeps sending heartbeats (the launcher's hang detection), and stops
    reporting sections until the next attempt.
    """

    def __init__(self, cfg: RunConfig, timeouts: RestartTimeouts) -> None:
        self.cfg = cfg
        self.timeouts = timeouts
        self.client: RankMonitorClient | None = None
        self.section: str | None = None
        self.sections_ok = True
        self.applied: str | None = None  # "configured" | "derived": what the rank monitor holds
        self._new_attempt()

    def _new_attempt(self) -> None:
        # The derivation's schedule: the same on every rank, as the derivation is a collective.
        self.heartbeats = 0
        self.saves = 0
        self.heartbeats_at_save = 0  # heartbeats sent before the latest save began
        self.measured_from_save: int | None = None  # saves done when the measure (re)started
        self.derived: DerivedTimeouts | None = None

    @property
    def enabled(self) -> bool:
        return FT_SOCKET_ENV in os.environ

    def start(self) -> None:
        if self.enabled and self.client is None:
            self.client = RankMonitorClient()
            self.client.init_workload_monitoring()
            self.sections_ok = True
            self.applied = None  # unknown: an earlier attempt may have left derived timeouts
            self._new_attempt()

    def _call(self, what: str, fn: Callable[[RankMonitorClient], None]) -> None:
        if self.client is None:
            return
        try:
            fn(self.client)
        except RankMonitorClientError as e:
            print(
                f"[restart] rank monitor {what} failed ({e}); reconnecting, sections off until the next attempt",
                flush=True,
            )
            schedule = (self.heartbeats, self.saves, self.heartbeats_at_save, self.measured_from_save, self.derived)
            self.stop()
            self.start()
            # A reconnect on one rank must not move the derivation's schedule.
            (self.heartbeats, self.saves, self.heartbeats_at_save, self.measured_from_save, self.derived) = schedule
            self.sections_ok = False

    def heartbeat(self) -> None:
        self.heartbeats += 1
        self._call("heartbeat", lambda c: c.send_heartbeat())
        if self.client is not None and self.saves >= 1 and self.measured_from_save is None:
            # Start, restore and the first save are behind us: measure the steady state from here.
            calc = self.client.timeouts_calc
            calc.subsequent_max_time = -1.0
            calc.section_to_max_time = dict.fromkeys(calc.section_to_max_time, -1.0)
            self.measured_from_save = self.saves

    def enter(self, section: str) -> None:
        """Open ``section`` (closing the open one): the launcher times each section separately."""
        if section == "checkpoint":
            self.saves += 1
            self.heartbeats_at_save = self.heartbeats
        self._apply("derived" if section in DERIVED_SECTIONS else "configured")
        if not self.sections_ok:
            return
        previous, self.section = self.section, section
        if previous is not None:
            self._call("end_section", lambda c: c.end_section(previous))
        self._call("start_section", lambda c: c.start_section(section))

    def leave(self) -> None:
        previous, self.section = self.section, None
        if previous is not None and self.sections_ok:
            self._call("end_section", lambda c: c.end_section(previous))

    def derive_when_warm(self, step: int, events: EventLog) -> DerivedTimeouts | None:
        """Derive ft_launcher's timeouts when this attempt is warm (see the class); call it after
        each heartbeat, at the same steps on every rank: it is a collective on the default process
        group. Returns them the one time they are derived.

        NVRx's ``TimeoutsCalc`` takes the longest intervals over all ranks; ``RestartTimeouts.derive``
        turns them into timeouts (``timeout_safety_factor`` x each, above the restart layers' order,
        never above the configured ones). Rank 0 records them: a ``timeouts_derived`` event and
        ``RunDir.derived_timeouts``."""
        if (
            self.client is None
            or self.derived is not None
            or self.heartbeats < WARM_HEARTBEATS
            or self.measured_from_save is None
            or self.saves <= self.measured_from_save
            or self.heartbeats <= self.heartbeats_at_save
        ):
            return None
        calc = self.client.timeouts_calc
        calc.synchronize_all()  # all-reduce (max) over ranks: every rank derives the same values
        if calc.subsequent_max_time <= 0:  # every rank reconnected meanwhile: nothing measured
            return None
        measured = {name: calc.section_to_max_time.get(name, -1.0) for name in DERIVED_SECTIONS}
        self.derived = self.timeouts.derive(
            self.cfg.restart_mode, calc.safety_factor, calc.subsequent_max_time, measured
        )
        self._apply("derived")
        if int(os.environ.get("RANK", "0")) == 0:
            events.emit(Event.TIMEOUTS_DERIVED, step=step, **self.derived.to_dict())
            try:
                atomic_write_text(
                    self.cfg.layout.derived_timeouts,
                    json.dumps({"step": step, **self.derived.to_dict()}, indent=2, sort_keys=True) + "\n",
                )
            except OSError as e:  # the events log has it; a full run dir is found by the next save
                print(f"[restart] could not write {self.cfg.layout.derived_timeouts}: {e}", flush=True)
        return self.derived

    def _apply(self, which: str) -> None:
        """Send the rank monitor the configured or the derived timeouts, unless it holds them (or
        none are derived yet). ``initial`` and ``setup`` are never derived."""
        if which == "derived" and self.derived is None:
            which = "configured"
        if self.client is None or self.applied == which:
            return
        sections = self.cfg.section_timeouts()
        heartbeat = self.cfg.heartbeat_timeout_s
        if which == "derived":
            sections.update(self.derived.sections)
            heartbeat = self.derived.heartbeat_s
        # load_state_dict is NVRx's public way to hand timeouts to the rank monitor (it restores
        # calculated ones); it sends them at once.
        state = {
            "heartbeat": {
                "initial": self.cfg.initial_heartbeat_timeout_s,
                "subsequent": heartbeat,
                "were_calculated": which == "derived",
            },
            "section": {
                "section": sections,
                "out_of_section": self.cfg.initial_heartbeat_timeout_s,
                "calculated_sections": list(DERIVED_SECTIONS) if which == "derived" else [],
                "is_out_of_section_calculated": False,
            },
        }
        sent = []
        self._call(
            "timeouts update", lambda c: (c.load_state_dict({c.CURRENT_TIMEOUTS_STATE_KEY: state}), sent.append(which))
        )
        if sent:
            self.applied = which

    def shutdown_workload(self, reason: str) -> None:
        """Ask ft_launcher not to restart anyone: used for user errors, which would only repeat."""
        client = self.client or (RankMonitorClient() if self.enabled else None)
        if client is None:
            return
        try:
            if client.rank_info is None:  # the request carries our rank
                client.init_workload_monitoring()
            client.send_workload_control_request(WorkloadControlRequest(WorkloadAction.ShutdownWorkload, reason))
        except Exception as e:  # the marker file still stops relaunches; don't mask the user error
            print(f"[restart] could not ask ft_launcher to shut down: {e}", flush=True)

    def stop(self) -> None:
        client, self.client, self.section = self.client, None, None
        if client is not None:
            try:
                client.shutdown_workload_monitoring()
            except Exception:
                pass
