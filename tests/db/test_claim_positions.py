"""Claims that resume where the last ones stopped (tasks/lifecycle/statements.py, "Resuming where
the last claims stopped"): the claim order is kept, a higher priority is taken at once, lower levels
are reached, a row behind a position waits for the next scan from the start, and beside an old
snapshot a resumed claim reads a few blocks where a scan from the start reads every claimed row."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from django.db import connection, transaction

from tasks.lifecycle.values import ClaimedTask, ClaimPosition
from tasks.models import Task
from tasks.worker import positions
from tasks.worker.process import Worker
from tests.helpers import wait_until, worker_in_thread
from tests.helpers.plans import recorded
from tests.helpers.task_paths import NOOP

pytestmark = pytest.mark.django_db


class Claimer:
    """Claims as the dispatcher does: the first from the start, the rest from the positions."""

    def __init__(self, *queues: str, name: str = "positions") -> None:
        self.queues, self.name = list(queues), name
        self.positions: dict[tuple[str, int], ClaimPosition] = {}

    def claim(self, limit: int, *, from_start: bool = False) -> list[ClaimedTask]:
        after = [] if from_start else list(self.positions.values())
        claimed = Task.objects.claim(self.name, limit=limit, queues=self.queues, after=after)
        if from_start:
            self.positions = {}
        self.positions.update(ClaimPosition.last_per_level(claimed))
        return claimed


def ids(claimed: list[ClaimedTask]) -> list[int]:
    return [c.id for c in claimed]


def test_resumed_claims_take_the_queue_in_its_order() -> None:
    queued = [Task.objects.enqueue(NOOP, queue="order").id for _ in range(10)]
    claimer = Claimer("order")
    assert ids(claimer.claim(3, from_start=True)) == queued[:3]
    assert ids(claimer.claim(3)) == queued[3:6]
    assert ids(claimer.claim(10)) == queued[6:]
    assert claimer.claim(5) == []
    later = Task.objects.enqueue(NOOP, queue="order").id
    assert ids(claimer.claim(5)) == [later]  # appended after the position


def test_a_higher_priority_is_taken_at_once_and_lower_levels_after() -> None:
    low = [Task.objects.enqueue(NOOP, queue="levels", priority=0).id for _ in range(4)]
    mid = [Task.objects.enqueue(NOOP, queue="levels", priority=5).id for _ in range(3)]
    claimer = Claimer("levels")
    assert ids(claimer.claim(2, from_start=True)) == mid[:2]
    urgent = Task.objects.enqueue(NOOP, queue="levels", priority=9).id
    top = Task.objects.enqueue(NOOP, queue="levels", priority=50).id
    assert ids(claimer.claim(3)) == [top, urgent, mid[2]]
    assert ids(claimer.claim(2)) == low[:2]  # down to the next level, past the positioned ones
    between = Task.objects.enqueue(NOOP, queue="levels", priority=3).id  # between two positioned levels
    assert ids(claimer.claim(5)) == [between, *low[2:]]
    assert claimer.positions.keys() == {("levels", p) for p in (50, 9, 5, 3, 0)}


def test_a_row_behind_a_position_waits_for_the_next_scan_from_the_start() -> None:
    queued = [Task.objects.enqueue(NOOP, queue="behind").id for _ in range(6)]
    claimer = Claimer("behind")
    first = claimer.claim(3, from_start=True)
    handed = Task.objects.hand_back("positions", [(first[0].id, first[0].token)])
    assert handed == {(first[0].id, first[0].token)}  # READY again, keeping its place (behind the position)
    assert ids(claimer.claim(2)) == queued[3:5]
    assert ids(claimer.claim(2, from_start=True)) == [queued[0], queued[5]]


def test_several_queues_resume_each_after_its_own_positions() -> None:
    a = [Task.objects.enqueue(NOOP, queue="many-a").id for _ in range(6)]
    b = [Task.objects.enqueue(NOOP, queue="many-b", priority=p).id for p in (0, 0, 0, 4, 4)]
    claimer = Claimer("many-a", "many-b")
    first = claimer.claim(4, from_start=True)
    assert ids(first) == [b[3], b[4], a[0], a[1]]  # the best 4 of both queues
    assert claimer.positions.keys() == {("many-a", 0), ("many-b", 4)}
    assert ids(claimer.claim(3)) == a[2:5]  # many-a after its position; many-b's level 0 from its front
    urgent = Task.objects.enqueue(NOOP, queue="many-a", priority=9).id  # above every position: at once
    assert Task.objects.hand_back("positions", [(a[1], first[3].token)])  # READY behind many-a's position
    assert ids(claimer.claim(10)) == [urgent, a[5], *b[:3]]
    assert ids(claimer.claim(10, from_start=True)) == [a[1]]  # the next scan from the start takes it


def test_a_position_in_one_queue_does_not_hold_back_another() -> None:
    a = Task.objects.enqueue(NOOP, queue="pos-a").id
    b = Task.objects.enqueue(NOOP, queue="pos-b").id
    later_a = Task.objects.get(pk=a)
    stale = [ClaimPosition("pos-a", 0, later_a.run_after, a)]  # passes over a, and would pass over b if shared
    assert ids(Task.objects.claim("positions", limit=5, queues=["pos-a", "pos-b"], after=stale)) == [b]
    assert ids(Task.objects.claim("positions", limit=5, queues=["pos-a", "pos-b"])) == [a]


def _claim_index_blocks(sql: str, params: Any) -> int:
    """The blocks the statement's scans of the claim index touch (their heap visits included), run
    again under EXPLAIN (ANALYZE, BUFFERS) and rolled back. The rest of a claim (the update of the
    claimed rows and their index entries) costs the same either way."""
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sql, params)
        plan = cursor.fetchone()[0][0]["Plan"]
        transaction.set_rollback(True)

    def nodes(node: dict[str, Any]) -> list[dict[str, Any]]:
        return [node, *(n for child in node.get("Plans", []) for n in nodes(child))]

    scans = [n for n in nodes(plan) if n.get("Index Name") == "tasks_task_claim_idx"]
    assert scans, ("the claim reads its index", [n.get("Index Name") for n in nodes(plan) if "Index Name" in n])
    return sum(int(n["Shared Hit Blocks"] + n["Shared Read Blocks"]) for n in scans)


@pytest.mark.django_db(transaction=True)  # claims commit, as a worker's do, beside the other session's snapshot
@pytest.mark.parametrize(
    ("queues", "priorities"),
    [(1, (0,)), (1, (7, 3)), (2, (0,)), (2, (7, 3))],
    ids=["one level", "two levels", "two queues", "two queues of two levels"],
)
def test_beside_an_old_snapshot_a_resumed_claim_reads_few_blocks(
    old_snapshot: None, queues: int, priorities: tuple[int]
) -> None:
    names = [f"snapshot-{queues}-{len(priorities)}-{i}" for i in range(queues)]
    for queue in names:
        for priority in priorities:
            Task.objects.bulk_enqueue(NOOP, [{}] * (10_000 // queues), queue=queue, priority=priority)
    with connection.cursor() as cursor:  # statistics of this table, not of an empty one an earlier test left
        cursor.execute("ANALYZE tasks_task")
    claimer = Claimer(*names)
    claimer.claim(500, from_start=True)
    while Task.objects.filter(queue__in=names, status="READY").count() > 1000:
        assert claimer.claim(500)
    # Nearly all of the queue is claimed now (committed), every claimed row's entry still in the claim
    # index: the other session's snapshot may see those rows READY.
    with recorded() as statements:
        claimer.claim(10)
        claimer.claim(10, from_start=True)
    (resumed, resumed_params), (from_start, start_params) = statements
    resumed_blocks = _claim_index_blocks(resumed, resumed_params)
    start_blocks = _claim_index_blocks(from_start, start_params)
    assert start_blocks > 300  # the case shows the cost: a scan from the start visits the claimed rows
    # a few blocks per level (a multi-queue claim scans each level twice: its shares, then its locks)
    assert resumed_blocks < 20 * queues * len(priorities), (resumed_blocks, start_blocks)


@pytest.mark.django_db(transaction=True)
def test_a_worker_takes_a_row_behind_its_position_at_once_not_at_its_next_poll_or_scan(monkeypatch) -> None:
    """A worker polls every 60 s here and its periodic scan from the start is an hour away. A row
    enqueued behind its position (an earlier run_after) is taken at once: after a short claim the
    next one scans from the start."""
    monkeypatch.setattr(positions, "RESCAN_INTERVAL", 3600.0)
    worker = Worker(queues=["rescan"], concurrency=1, poll_interval=60, install_signal_handlers=False, worker_id="rs")
    with worker_in_thread(worker):
        first = Task.objects.enqueue(NOOP, queue="rescan").id
        wait_until(lambda: Task.objects.filter(pk=first, status="SUCCESSFUL").exists(), 20, what="the first task")
        placed = Task.objects.get(pk=first).run_after
        behind = Task.objects.enqueue(NOOP, queue="rescan", run_after=placed - dt.timedelta(hours=1)).id
        wait_until(lambda: Task.objects.filter(pk=behind, status="SUCCESSFUL").exists(), 20, what="the row behind")


@pytest.mark.django_db(transaction=True)
def test_keyed_tasks_admitted_behind_the_positions_do_not_wait_for_the_next_scan(monkeypatch) -> None:
    """A keyed task admitted when its key's slot frees keeps its place: behind the worker's
    positions. Positions are used only while claims come back full, so a keyed queue that keeps up
    is drained at once even with the periodic scan from the start an hour away (with positions
    kept after short claims, every admitted task waited for that scan: 2,100 -> 150 tasks/s)."""
    monkeypatch.setattr(positions, "RESCAN_INTERVAL", 3600.0)
    # Grouped by key: the first claim takes each key's first task, its position passes the rest of
    # the first keys' tasks (BLOCKED), which are admitted behind it one by one.
    ids = [
        Task.objects.enqueue(NOOP, queue="keyed-behind", concurrency_key=f"k{key}", concurrency_limit=1).id
        for key in range(4)
        for _ in range(5)
    ]
    worker = Worker(
        queues=["keyed-behind"], concurrency=2, poll_interval=60, install_signal_handlers=False, worker_id="kb"
    )
    with worker_in_thread(worker):
        wait_until(
            lambda: Task.objects.filter(pk__in=ids, status="SUCCESSFUL").count() == len(ids), 30, what="the keyed drain"
        )
