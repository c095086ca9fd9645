"""Fair queues (LEASING_TASKS["FAIR_QUEUES"]): a claim takes turns between the keys (tenants) of the
queue instead of draining the oldest key first (tasks/lifecycle/statements.py, ``_PICK_FAIR``)."""

from __future__ import annotations

import datetime as dt
from collections import Counter

import pytest
from django.db import connection, connections, transaction

from tasks.lifecycle.values import ClaimedTask, fair_after_claim
from tasks.models import Task

pytestmark = pytest.mark.django_db

NOOP = "tests.testapp.handlers.noop"


@pytest.fixture(autouse=True)
def fair_queues(settings) -> None:
    settings.LEASING_TASKS = {**getattr(settings, "LEASING_TASKS", {}), "FAIR_QUEUES": ["fair"]}


class Claimer:
    """Claims as the dispatcher does: each claim's turns start after the last key the one before served."""

    def __init__(self, name: str = "w", queue: str = "fair") -> None:
        self.name, self.queue = name, queue
        self.after: str | None = None

    def claim(self, limit: int) -> list[ClaimedTask]:
        claimed = Task.objects.claim(self.name, limit=limit, queues=[self.queue], fair_after=self.after)
        self.after = fair_after_claim(claimed, self.after)
        return claimed


def keys(claimed: list[ClaimedTask]) -> Counter[str]:
    return Counter(c.fair_key or "(none)" for c in claimed)


def test_a_claim_interleaves_the_keys_instead_of_draining_the_oldest_first() -> None:
    Task.objects.bulk_enqueue(NOOP, [{}] * 200, queue="fair", fair_key="big")
    small = Task.objects.bulk_enqueue(NOOP, [{}] * 10, queue="fair", fair_key="small")
    claimed = Claimer().claim(10)
    assert keys(claimed) == {"big": 5, "small": 5}
    # each key's own tasks in their order
    assert sorted(c.id for c in claimed if c.fair_key == "small") == small[:5]


def test_the_turns_rotate_over_many_keys() -> None:
    for k in range(30):
        Task.objects.bulk_enqueue(NOOP, [{}] * 3, queue="fair", fair_key=f"tenant-{k:02}")
    claimer = Claimer()
    served: list[str] = []
    for _ in range(3):
        claimed = claimer.claim(10)
        assert len(claimed) == 10 and len(keys(claimed)) == 10  # one each, ten keys per claim
        served += sorted(keys(claimed))
    assert served == [f"tenant-{k:02}" for k in range(30)]  # every key once before any twice
    claimed = claimer.claim(10)
    assert sorted(keys(claimed)) == [f"tenant-{k:02}" for k in range(10)]  # wrapped around


def test_a_lone_key_fills_the_claim_and_rows_without_a_key_are_taken() -> None:
    ids = Task.objects.bulk_enqueue(NOOP, [{}] * 20, queue="fair", fair_key="only")
    assert [c.id for c in Claimer().claim(8)] == ids[:8]
    Task.objects.filter(pk__in=ids).delete()
    # rows of the queue from before it was fair (no key): the fill takes them in the plain order
    Task.objects.bulk_enqueue(NOOP, [{}] * 3, queue="fair", fair_key="k")
    with connection.cursor() as cursor:
        cursor.execute("UPDATE tasks_task SET fair_key = NULL WHERE id = (SELECT max(id) FROM tasks_task)")
    assert len(Claimer().claim(10)) == 3


def test_a_task_of_a_fair_queue_without_a_key_gets_the_shared_key() -> None:
    task = Task.objects.enqueue(NOOP, queue="fair")
    plain = Task.objects.enqueue(NOOP, queue="plain")
    assert Task.objects.get(pk=task.id).fair_key == ""
    assert Task.objects.get(pk=plain.id).fair_key is None


def test_priorities_order_a_keys_own_tasks_not_the_turns() -> None:
    low = Task.objects.bulk_enqueue(NOOP, [{}] * 4, queue="fair", fair_key="a", priority=0)
    high = Task.objects.bulk_enqueue(NOOP, [{}] * 4, queue="fair", fair_key="a", priority=9)
    other = Task.objects.bulk_enqueue(NOOP, [{}] * 4, queue="fair", fair_key="b", priority=-5)
    claimed = Claimer().claim(4)
    assert sorted(c.id for c in claimed) == sorted(high[:2] + other[:2])
    # three each: a gives its last high ones, then its low ones; b has two left; the fill takes the
    # next in the plain order (low[2]: priority 0 before b's -5, which the claim already took)
    claimed = Task.objects.claim("w", limit=6, queues=["fair"])
    assert sorted(c.id for c in claimed) == sorted(high[2:] + low[:1] + other[2:] + low[1:2])


def test_deferred_rows_are_not_taken_early() -> None:
    later = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
    Task.objects.bulk_enqueue(NOOP, [{}] * 5, queue="fair", fair_key="a", run_after=later)
    Task.objects.bulk_enqueue(NOOP, [{}] * 5, queue="fair", fair_key="b", run_after=later, priority=5)
    due = Task.objects.bulk_enqueue(NOOP, [{}] * 2, queue="fair", fair_key="b")
    assert sorted(c.id for c in Claimer().claim(10)) == due


def test_a_paused_fair_queue_gives_nothing() -> None:
    from tasks.models import QueueControl

    Task.objects.bulk_enqueue(NOOP, [{}] * 5, queue="fair", fair_key="a")
    QueueControl.objects.create(name="fair", paused=True)
    assert Claimer().claim(10) == []


@pytest.mark.django_db(transaction=True)
def test_two_claimers_on_separate_connections_skip_each_others_rows() -> None:
    Task.objects.bulk_enqueue(NOOP, [{}] * 20, queue="fair", fair_key="a")
    Task.objects.bulk_enqueue(NOOP, [{}] * 20, queue="fair", fair_key="b")
    other = connections.create_connection("default")
    try:
        with transaction.atomic():
            mine = Claimer("w1").claim(6)  # locked until this transaction commits
            with other.cursor() as cursor:
                from tasks.lifecycle import statements as sql

                params = {
                    "worker": "w2",
                    "ttl": 30.0,
                    "limit": 6,
                    "start": False,
                    "isolate_after": 2,
                    **sql.claim_params(["fair"], busy=False, isolate_after=2),
                }
                cursor.execute(sql.FAIR_CLAIM_SQL, params)
                theirs = [row[0] for row in cursor.fetchall()]
            other.commit()
    finally:
        other.close()
    assert len(mine) == 6 and len(theirs) == 6
    assert not {c.id for c in mine} & set(theirs)
