"""Fair claims that resume where the claimer's last ones stopped (tasks/lifecycle/statements.py, the
comment above ``_FAIR_ROWS``: ``mine``, and the fill's positions): each key's turn resumes after the
claimer's last row of that key and level, the fill after its own last rows; the rows taken are the
ones a claim from the front takes, a key's higher priority is taken at once, a row behind a key's
position waits for the next claim from the front, and beside an old snapshot the keys' scans and the
fill read a few blocks where scans from the front read every row claimed since the snapshot."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection, transaction

from tasks.lifecycle import statements as sql
from tasks.lifecycle.values import ClaimedTask, ClaimPosition, FairPositions, claimed_from_row, fair_after_claim
from tasks.models import Task
from tasks.models.task import TaskQuerySet
from tasks.worker.process import Worker
from tests.helpers import wait_until, worker_in_thread
from tests.helpers.task_paths import NOOP

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def fair_and_fair_twin_queues(settings) -> None:
    settings.LEASING_TASKS = {**getattr(settings, "LEASING_TASKS", {}), "FAIR_QUEUES": ["fair", "fair-twin"]}


class Claimer:
    """Claims as the dispatcher does: the turns after the last claim's cursor; a claim from the
    front sends no positions and replaces them, the others resume after them."""

    def __init__(self, queue: str = "fair", *, resume: bool = True) -> None:
        self.queue, self.resume = queue, resume
        self.after: str | None = None
        self.positions: dict[tuple[str, int], ClaimPosition] = {}
        self.keys = FairPositions(40)

    def claim(self, limit: int, *, from_start: bool = False) -> list[ClaimedTask]:
        from_start = from_start or not self.resume
        claimed = Task.objects.claim(
            "w",
            limit=limit,
            queues=[self.queue],
            fair_after=self.after,
            after=[] if from_start else list(self.positions.values()),
            fair_positions=() if from_start else self.keys,  # as the worker sends them
        )
        self.after = fair_after_claim(claimed, self.after)
        if from_start:
            self.positions, self.keys = {}, FairPositions(40)
        self.positions.update(ClaimPosition.last_per_level(claimed))
        self.keys.remember(claimed)
        return claimed


def tags(claimed: list[ClaimedTask]) -> list[str]:
    return sorted(c.kwargs["tag"] for c in claimed)


def test_resumed_fair_claims_take_the_rows_claims_from_the_front_take(settings) -> None:
    """Two queues of the same rows, enqueued side by side: one drained by claims that resume after
    their positions, the other by claims from the front. Three keys (one with two priorities, one
    short, so the turns leave room for the fill) and rows from before the queue was fair (no key:
    the fill's only)."""
    layout = [("a", 0)] * 10 + [("a", 3)] * 3 + [("b", 0)] * 2 + [("c", 0)] * 6
    settings.LEASING_TASKS = {**settings.LEASING_TASKS, "FAIR_QUEUES": []}
    for n in range(3):
        for queue in ("fair", "fair-twin"):
            Task.objects.enqueue(NOOP, queue=queue, kwargs={"tag": f"none-{n}"})
    settings.LEASING_TASKS = {**settings.LEASING_TASKS, "FAIR_QUEUES": ["fair", "fair-twin"]}
    for n, (key, priority) in enumerate(layout):
        for queue in ("fair", "fair-twin"):
            Task.objects.enqueue(NOOP, queue=queue, priority=priority, fair_key=key, kwargs={"tag": f"{key}-{n}"})
    resumed, from_front = Claimer("fair"), Claimer("fair-twin", resume=False)
    seen: list[str] = []
    while True:
        got = resumed.claim(4, from_start=not seen)
        assert tags(got) == tags(from_front.claim(4))
        if not got:
            break
        assert len(got) == 4 or len(seen) + len(got) == len(layout) + 3  # never short while rows are left
        seen += tags(got)
    assert sorted(seen) == sorted(set(seen)) and len(seen) == len(layout) + 3  # each row once
    assert resumed.keys.values(), "the resumed claims kept positions in the keys"


def test_a_keys_higher_priority_is_taken_at_once_and_a_level_between_its_positions() -> None:
    Task.objects.bulk_enqueue(NOOP, [{"tag": f"a{n}"} for n in range(6)], queue="fair", fair_key="a", priority=0)
    Task.objects.bulk_enqueue(NOOP, [{"tag": f"b{n}"} for n in range(6)], queue="fair", fair_key="b")
    claimer = Claimer()
    assert tags(claimer.claim(4, from_start=True)) == ["a0", "a1", "b0", "b1"]
    Task.objects.enqueue(NOOP, queue="fair", fair_key="a", priority=5, kwargs={"tag": "a-urgent"})
    assert tags(claimer.claim(4)) == ["a-urgent", "a2", "b2", "b3"]
    assert {(p.fair_key, p.priority) for p in claimer.keys.values()} == {("a", 0), ("a", 5), ("b", 0)}
    Task.objects.enqueue(NOOP, queue="fair", fair_key="a", priority=2, kwargs={"tag": "a-between"})
    assert tags(claimer.claim(4)) == ["a-between", "a3", "b4", "b5"]  # between two positioned levels


@pytest.mark.parametrize("a", ["a", 'a "\\ \u00e9\u6f22 \U0001f600'], ids=["plain", "quotes, backslash, non-ASCII"])
def test_a_row_behind_a_keys_position_waits_for_the_next_claim_from_the_front(a: str) -> None:
    """(The position is found whatever the key's name: the resumed claim passes over the row.)"""
    Task.objects.bulk_enqueue(NOOP, [{"tag": f"a{n}"} for n in range(6)], queue="fair", fair_key=a)
    Task.objects.bulk_enqueue(NOOP, [{"tag": f"b{n}"} for n in range(6)], queue="fair", fair_key="b")
    claimer = Claimer()
    first = claimer.claim(4, from_start=True)
    assert tags(first) == ["a0", "a1", "b0", "b1"]
    a0 = next(c for c in first if c.kwargs["tag"] == "a0")
    assert Task.objects.hand_back("w", [(a0.id, a0.token)])  # READY again, keeping its place: behind a's position
    assert tags(claimer.claim(4)) == ["a2", "a3", "b2", "b3"]
    assert tags(claimer.claim(4, from_start=True)) == ["a0", "a4", "b4", "b5"]


def test_the_walk_finds_a_key_between_two_positioned_ones_and_passes_over_a_drained_one() -> None:
    """The walk's probe for the next key stops short of the next key the claimer has positions in
    (whose front holds the rows it took): a new key between two such keys still takes its turn, and
    a positioned key with nothing left after its positions takes none."""
    Task.objects.bulk_enqueue(NOOP, [{"tag": f"a{n}"} for n in range(5)], queue="fair", fair_key="a")
    Task.objects.bulk_enqueue(NOOP, [{"tag": f"c{n}"} for n in range(6)], queue="fair", fair_key="c")
    claimer = Claimer()
    assert tags(claimer.claim(4, from_start=True)) == ["a0", "a1", "c0", "c1"]
    Task.objects.bulk_enqueue(NOOP, [{"tag": f"b{n}"} for n in range(3)], queue="fair", fair_key="b")
    assert tags(claimer.claim(4)) == ["a2", "a3", "b0", "c2"]  # the turns go on from c: a 2, b 1, c 1
    assert tags(claimer.claim(4)) == ["a4", "b1", "b2", "c3"]  # from a: b 2, c 1, a 1
    assert {p.fair_key for p in claimer.keys.values()} == {"a", "b", "c"}
    # a and b have nothing left after their positions: c takes every turn
    assert tags(claimer.claim(4)) == ["c4", "c5"]


def test_a_positioned_key_with_a_new_higher_priority_task_takes_its_turn_at_once() -> None:
    """(c's tasks are the oldest: what the fill would take in the plain order.)"""
    Task.objects.bulk_enqueue(NOOP, [{"tag": f"c{n}"} for n in range(9)], queue="fair", fair_key="c")
    Task.objects.bulk_enqueue(NOOP, [{"tag": f"a{n}"} for n in range(2)], queue="fair", fair_key="a")
    Task.objects.bulk_enqueue(NOOP, [{"tag": f"b{n}"} for n in range(9)], queue="fair", fair_key="b")
    claimer = Claimer()
    assert tags(claimer.claim(6, from_start=True)) == ["a0", "a1", "b0", "b1", "c0", "c1"]  # a has nothing left
    Task.objects.enqueue(NOOP, queue="fair", fair_key="a", priority=5, kwargs={"tag": "a-urgent"})
    # turns of 2 each: a gives its 1, the fill the oldest
    assert tags(claimer.claim(6)) == ["a-urgent", "b2", "b3", "c2", "c3", "c4"]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(("keys", "sent"), [(3, True), (400, False)], ids=["3 keys", "400 keys"])
def test_a_worker_sends_its_key_positions_only_when_it_comes_back_to_its_keys(
    settings, monkeypatch: pytest.MonkeyPatch, keys: int, sent: bool
) -> None:
    """A worker of BATCH_SIZE 16 keeps positions in 64 keys: going round 3 keys it comes back to
    them and sends them; going round 400 it never comes back to one before it is pushed out, and
    sends none (they would cost every claim for nothing).

    A worker without an event loop: one with a loop hands back at once what it claimed beyond the
    slots of each kind it has (``Dispatcher._route``), rewinding its fair cursor, and claims those
    keys again, so it does come back to them; how often depends on how busy its executors are when
    a claim lands (beside two busy loops, once in a few dozen drains)."""
    settings.LEASING_TASKS = {**settings.LEASING_TASKS, "FAIR_QUEUES": ["fair-worker"]}
    for key in range(keys):
        Task.objects.bulk_enqueue(NOOP, [{}] * (1200 // keys), queue="fair-worker", fair_key=f"k{key:03}")
    sends: list[bool] = []
    claim = TaskQuerySet.finish_start_claim

    def spy(self: TaskQuerySet, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("limit"):
            sends.append(bool(kwargs.get("fair_positions")))
        return claim(self, *args, **kwargs)

    monkeypatch.setattr(TaskQuerySet, "finish_start_claim", spy)
    worker = Worker(
        queues=["fair-worker"],
        concurrency=4,
        batch_size=16,
        async_concurrency=0,
        install_signal_handlers=False,
        worker_id="fp",
    )
    with worker_in_thread(worker):
        wait_until(
            lambda: not Task.objects.filter(queue="fair-worker").exclude(status="SUCCESSFUL").exists(),
            60,
            what="the drain",
        )
    assert any(sends) is sent, sends
    assert worker.session.stats["claimed"] == 1200  # nothing was handed back and claimed again


QUEUE = "fair-snapshot"


def _claim_params(claimer: Claimer | None, limit: int) -> dict[str, Any]:
    return {
        "worker": "snap",
        "ttl": 600.0,
        "limit": limit,
        "start": False,
        "isolate_after": 2,
        **sql.claim_params(
            [QUEUE],
            busy=False,
            isolate_after=2,
            after=[] if claimer is None else list(claimer.positions.values()),
            fair_after=None if claimer is None else claimer.after,
            fair_positions=[] if claimer is None else claimer.keys.values(),
        ),
    }


def _keys_and_fill_blocks(claimer: Claimer | None) -> int:
    """Blocks a fair claim of 10 reads in its keys' own scans (tasks_task_fair_idx within one key)
    and its fill (tasks_task_claim_idx), heap visits included: the second of two runs under EXPLAIN
    (ANALYZE, BUFFERS), rolled back. The walk's probes for the next key are not counted."""
    for _ in range(2):
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sql.FAIR_CLAIM_SQL, _claim_params(claimer, 10))
            plan = cursor.fetchone()[0][0]["Plan"]
            transaction.set_rollback(True)

    def nodes(node: dict[str, Any]) -> list[dict[str, Any]]:
        return [node, *(n for child in node.get("Plans", []) for n in nodes(child))]

    def counted(node: dict[str, Any]) -> bool:
        name, cond = node.get("Index Name"), node.get("Index Cond", "")
        return name == "tasks_task_claim_idx" or (name == "tasks_task_fair_idx" and "fair_key = " in cond)

    assert plan["Actual Rows"] == 10
    return sum(int(n["Shared Hit Blocks"] + n["Shared Read Blocks"]) for n in nodes(plan) if counted(n))


@pytest.mark.django_db(transaction=True)  # claims commit, as a worker's do, beside the other session's snapshot
def test_beside_an_old_snapshot_the_keys_scans_and_the_fill_resume_after_their_positions(old_snapshot: None) -> None:
    """A noisy tenant and a quiet one (5,000 due rows each) and a key with only deferred rows (where
    such a key takes a turn, the fill takes its room); 9,000 claimed beside the snapshot by claims of
    100 that resume."""
    Task.objects.bulk_enqueue(NOOP, [{}] * 5000, queue=QUEUE, fair_key="noisy")
    Task.objects.bulk_enqueue(NOOP, [{}] * 5000, queue=QUEUE, fair_key="quiet")
    later = Task.objects.enqueue(NOOP, queue=QUEUE, fair_key="deferred").enqueued_at
    assert later is not None
    Task.objects.filter(queue=QUEUE, fair_key="deferred").update(run_after=later.replace(year=later.year + 1))
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE tasks_task")
    fresh = _keys_and_fill_blocks(None)
    claimer = Claimer(QUEUE)
    claimed = 0
    with connection.cursor() as cursor:
        while claimed < 9000:
            cursor.execute(sql.FAIR_CLAIM_SQL, _claim_params(claimer, 100))
            got = [claimed_from_row(row) for row in cursor.fetchall()]
            assert len(got) == 100, claimed  # the fill's positions never make a claim short
            claimed += len(got)
            claimer.after = fair_after_claim(got, claimer.after)
            claimer.positions.update(ClaimPosition.last_per_level(got))
            claimer.keys.remember(got)
    from_front = _keys_and_fill_blocks(None)
    resumed = _keys_and_fill_blocks(claimer)
    assert from_front > 200, (from_front, fresh)  # the case shows the cost: scans from the front step over 9,000
    assert resumed < max(60, 3 * fresh), (resumed, fresh, from_front)
