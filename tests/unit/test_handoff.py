"""What a worker hands to its executors each round (tasks/worker/handoff.py), without threads or a
database: each kind's slots plus what its executors start within two round trips, never more than
the prefetch; a claim's rows named at once up to that room, the rest waiting; a start of its own
(a suspect's) handed over at once, never named."""

from __future__ import annotations

import datetime as dt

from tasks.models import ClaimedTask
from tasks.runtime import Execution
from tasks.worker.handoff import AHEAD_ROUNDS, HandOff
from tasks.worker.ledger import Census, Ledger
from tasks.worker.sizing import Capacity

NOW = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)


def task(task_id: int, *, suspect: bool = False) -> ClaimedTask:
    return ClaimedTask(task_id, 1000 + task_id, "p", [], {}, 0, 3, None, NOW, None, "default", 0, NOW, suspect=suspect)


def attempts(ledger: Ledger, tasks: list[ClaimedTask]) -> list[Execution]:
    executions = [Execution(t, "w", 30.0, 0.0) for t in tasks]
    ledger.add(executions)
    return executions


def test_room_is_the_slots_plus_two_round_trips_of_work_at_most_the_prefetch() -> None:
    handoff = HandOff(Ledger(), queues=["default"])
    handoff.timed(0.005)
    capacity = Capacity(slots=8, prefetch=128)
    idle = Census()
    # No task has run yet: the free slots only.
    assert handoff.room(idle, capacity, duration=None, async_duration=None)[False] == 8
    # 10 ms tasks: in two rounds of 5 ms, 8 executors start 8 more.
    assert AHEAD_ROUNDS == 2
    assert handoff.room(idle, capacity, duration=0.010, async_duration=None)[False] == 8 + 8
    # Tasks longer than two round trips: the free slots only (a kill charges nothing that had not begun).
    assert handoff.room(idle, capacity, duration=1.0, async_duration=None)[False] == 8
    # No-op tasks: what the prefetch allows.
    assert handoff.room(idle, capacity, duration=1e-5, async_duration=None)[False] == 8 + 128
    # What the executors hold counts against it.
    busy = Census(in_hand=5, running=3, unstarted=2)
    assert handoff.room(busy, capacity, duration=1.0, async_duration=None)[False] == 3


def test_a_claim_is_named_up_to_the_room_and_the_rest_waits_for_a_later_round() -> None:
    ledger = Ledger()
    handoff = HandOff(ledger, queues=["default"])
    plan = handoff.plan({False: 2, True: 0}, claim=4, async_share=0.0, has_loop=False)
    assert (plan.release, plan.names) == (2, [])
    claimed = [task(1), task(2, suspect=True), task(3), task(4)]
    now = handoff.hand(plan, claimed, attempts(ledger, claimed))
    # The suspect goes at once (its start is its own statement); of the rest the first two are named.
    assert [e.id for e in now] == [1, 2, 3]
    assert handoff.waiting == 1
    # The next round names the one that waited, with the names not yet known to be on their rows.
    plan = handoff.plan({False: 1, True: 0}, claim=0, async_share=0.0, has_loop=False)
    assert [e.id for e in plan.releasing] == [4]
    assert plan.names == [1001, 1003, 1004]
    handoff.on_row([(1, 1001)])
    handoff.refused([(3, 1003)])  # its outcome was refused: its name stays a while
    ledger.remove([(1, 1001), (3, 1003)])
    assert handoff.hand(plan, [], []) == plan.releasing
    plan = handoff.plan({False: 1, True: 0}, claim=1, async_share=0.0, has_loop=False)
    assert sorted(plan.names or []) == [1003, 1004]
    # An attempt handed back leaves the ledger with no outcome: its name goes at the next look.
    ledger.remove([(4, 1004)])
    handoff._pruned_at = 0.0
    plan = handoff.plan({False: 1, True: 0}, claim=1, async_share=0.0, has_loop=False)
    assert plan.names == [1003]


def test_a_round_that_hands_nothing_writes_no_names_and_an_unsent_one_hands_nothing() -> None:
    ledger = Ledger()
    handoff = HandOff(ledger, queues=["default"])
    assert handoff.plan({False: 0, True: 0}, claim=4, async_share=0.0, has_loop=False).names is None
    claimed = [task(1), task(2)]
    handoff.hand(
        handoff.plan({False: 0, True: 0}, claim=2, async_share=0.0, has_loop=False), claimed, attempts(ledger, claimed)
    )
    assert handoff.waiting == 2
    plan = handoff.plan({False: 5, True: 0}, claim=0, async_share=0.0, has_loop=False)
    assert len(plan.releasing) == 2
    handoff.not_sent(plan)
    assert handoff.waiting == 2
    assert handoff.can_release({False: 1, True: 0}) and not handoff.can_release({False: 0, True: 9})
    assert [e.id for e in handoff.take_waiting()] == [1, 2]
