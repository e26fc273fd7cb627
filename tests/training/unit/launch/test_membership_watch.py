"""How long a training node waits for a lost node's replacement (launch.membership_watch), with
the run dir's real files: the membership record, the launchers' beats and the control plane's
announcement (contract.replacements). Time is passed in (from now on), so nothing here sleeps."""

from __future__ import annotations

import json
import time

from fsdp_resilience.training.contract import EventLog, RunDir, read_events
from fsdp_resilience.training.contract.replacements import (
    LAUNCHER_STALE_S,
    announce_keeper_watching,
    announce_no_replacement,
    announce_replacement,
    beat_launcher,
    read_membership_deadline,
)
from fsdp_resilience.training.launch.membership_watch import WORKERS_DOWN_S, MembershipWatch

LAUNCH = "3"


class Workers:
    alive = True

    def __call__(self) -> bool:
        return self.alive


def setup(tmp_path, members=((0, "slot-0"), (2, "slot-2"))):
    layout = RunDir(tmp_path / "run")
    layout.create()
    layout.membership.write_text(json.dumps({"launch_id": LAUNCH, "attempt": 1, "members": list(members)}))
    workers = Workers()
    watch = MembershipWatch(
        layout, EventLog(layout.events, node_rank=0), LAUNCH, 0, standby=False, workers_alive=workers
    )
    return layout, watch, workers


def waiting(layout):
    return read_events(layout.events, "waiting_for_nodes")


def lose_the_workers(watch, workers, t0):
    assert watch.poll(t0) is None  # training
    workers.alive = False
    assert watch.poll(t0 + 1) is None  # an in-job restart's rendezvous, so far


def test_a_loss_no_spare_covers_ends_the_launch_with_the_lost_node_named(tmp_path):
    layout, watch, workers = setup(tmp_path)
    t0 = time.time()
    beat_launcher(layout.control, 2, launch_id=LAUNCH, standby=True)  # the promoted spare, alive so far
    lose_the_workers(watch, workers, t0)
    # node 2 stops beating: lost
    reason = watch.poll(t0 + 2 + LAUNCHER_STALE_S + WORKERS_DOWN_S)
    assert reason is not None and "slot-2 (node 2) lost and no spare left" in reason, reason
    (record,) = waiting(layout)
    assert record["missing"] == 1 and record["nodes"] == ["slot-2"] and record["missing_node_ranks"] == [2]
    assert record["until"] is None and "no replacement announced" in record["why"]


def test_every_node_present_is_a_slow_round_not_a_loss(tmp_path):
    layout, watch, workers = setup(tmp_path)
    t0 = time.time()
    lose_the_workers(watch, workers, t0)
    beat_launcher(layout.control, 2, launch_id=LAUNCH, standby=False)
    assert watch.poll(t0 + 1 + WORKERS_DOWN_S) is None
    assert waiting(layout) == []


def test_a_parked_spare_covers_the_loss(tmp_path):
    layout, watch, workers = setup(tmp_path)
    t0 = time.time()
    lose_the_workers(watch, workers, t0)
    beat_launcher(layout.control, 3, launch_id=LAUNCH, standby=True)  # parked, not in the membership
    assert watch.poll(t0 + 1 + WORKERS_DOWN_S) is None
    assert waiting(layout) == []


def test_an_announced_replacement_is_waited_for_until_its_deadline(tmp_path):
    layout, watch, workers = setup(tmp_path)
    t0 = time.time()
    lose_the_workers(watch, workers, t0)
    announce_replacement(layout.control, LAUNCH, until=t0 + 60, why="the pool keeper started slot-4", nodes=["slot-4"])
    assert watch.poll(t0 + 10) is None
    assert watch.poll(t0 + 20) is None  # said once
    (record,) = waiting(layout)
    assert record["until"] == t0 + 60 and "slot-4" in record["why"]
    reason = watch.poll(t0 + 61)
    assert reason is not None and "its deadline passed" in reason
    assert [r["until"] for r in waiting(layout)] == [t0 + 60, None]


def test_a_replacement_that_came_is_not_waited_for_again(tmp_path):
    """The keeper announced a spare (node 3) for an earlier loss; it came (its launcher beat after
    the announcement), took a place and is gone too: that announcement is spent."""
    layout, watch, workers = setup(tmp_path, members=((0, "slot-0"), (3, "slot-3")))
    t0 = time.time()
    announce_replacement(layout.control, LAUNCH, until=t0 + 300, why="the pool keeper added node 3", node_ranks=[3])
    beat_launcher(layout.control, 3, launch_id=LAUNCH, standby=True)
    lose_the_workers(watch, workers, t0)
    reason = watch.poll(t0 + 2 + LAUNCHER_STALE_S + WORKERS_DOWN_S)
    assert reason is not None and "slot-3 (node 3) lost" in reason and "(it came)" in reason, reason


def test_the_keepers_standing_notice_is_waited_for_said_once_and_lapses_when_not_renewed(tmp_path):
    layout, watch, workers = setup(tmp_path)
    t0 = time.time()
    lose_the_workers(watch, workers, t0)
    announce_keeper_watching(layout.control, LAUNCH, until=t0 + 60, why="the pool keeper watches")
    assert watch.poll(t0 + 10) is None
    announce_keeper_watching(layout.control, LAUNCH, until=t0 + 70, why="the pool keeper watches")  # renewed
    assert watch.poll(t0 + 65) is None
    (record,) = waiting(layout)  # a renewal is not news
    assert record["until"] == t0 + 60 and "the pool keeper watches" in record["why"]
    reason = watch.poll(t0 + 71)  # the keeper stopped renewing it
    assert reason is not None and "its deadline passed" in reason
    assert [r["until"] for r in waiting(layout)] == [t0 + 60, None]


def test_none_coming_ends_it_at_once_and_another_launchs_word_is_not_taken(tmp_path):
    layout, watch, workers = setup(tmp_path)
    t0 = time.time()
    lose_the_workers(watch, workers, t0)
    announce_replacement(layout.control, "2", until=t0 + 600, why="an earlier launch's spare")
    assert read_membership_deadline(layout.control, LAUNCH) is None
    announce_no_replacement(layout.control, LAUNCH, why="max_node_replacements (2) used up")
    reason = watch.poll(t0 + 10)
    assert reason is not None and "max_node_replacements (2) used up" in reason


def test_a_node_that_never_trained_decides_nothing(tmp_path):
    layout, watch, workers = setup(tmp_path)
    workers.alive = False
    assert watch.poll(time.time()) is None and watch.poll(time.time() + 100) is None
    assert waiting(layout) == []


def test_a_fault_after_a_gone_nodes_last_beat_decides_while_the_workers_still_wait(tmp_path):
    """The survivors' in-process layer holds their ranks for its heartbeat timeout after a peer is
    gone; a fault logged after the gone node's last beat is enough to decide on."""
    layout, watch, workers = setup(tmp_path)
    t0 = time.time()
    beat_launcher(layout.control, 2, launch_id=LAUNCH, standby=False)
    assert watch.poll(t0) is None  # training
    rank0 = EventLog(layout.events, launch_id=LAUNCH, rank=0)
    rank0.emit("fault_detected", ts=t0 + 1, kind="RuntimeError", step=8)
    assert watch.poll(t0 + 2) is None  # node 2 may still beat: a rank's fault, so far
    reason = watch.poll(t0 + 1 + LAUNCHER_STALE_S + 0.5)  # its workers alive all along
    assert reason is not None and "slot-2 (node 2) lost" in reason, reason


def test_a_fault_training_got_past_decides_nothing(tmp_path):
    layout, watch, workers = setup(tmp_path)
    t0 = time.time()
    beat_launcher(layout.control, 2, launch_id=LAUNCH, standby=False)
    assert watch.poll(t0) is None
    rank0 = EventLog(layout.events, launch_id=LAUNCH, rank=0)
    rank0.emit("fault_detected", ts=t0 + 1, kind="InjectedFault", step=4)
    rank0.emit("step", ts=t0 + 2, step=5)  # recovered in-process
    assert watch.poll(t0 + 30) is None and waiting(layout) == []


def test_none_coming_leaves_a_spare_still_on_its_way_announced(tmp_path):
    """The keeper added node 3 for one loss, then could not refill for the next (budget spent): its
    "none" must not cancel node 3, which has not come yet; once node 3 beats, "none" is written."""
    layout, watch, workers = setup(tmp_path)
    t0 = time.time()
    announce_replacement(layout.control, LAUNCH, until=t0 + 300, why="the pool keeper added node 3", node_ranks=[3])
    assert not announce_no_replacement(layout.control, LAUNCH, why="max_node_replacements=1 spent")
    assert read_membership_deadline(layout.control, LAUNCH).coming
    lose_the_workers(watch, workers, t0)
    assert watch.poll(t0 + 2 + LAUNCHER_STALE_S + WORKERS_DOWN_S) is None  # waits for node 3
    beat_launcher(layout.control, 3, launch_id=LAUNCH, standby=True)
    assert announce_no_replacement(layout.control, LAUNCH, why="max_node_replacements=1 spent")
    assert not read_membership_deadline(layout.control, LAUNCH).coming
