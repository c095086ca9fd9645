"""Every statement that picks rows with ``LIMIT n FOR UPDATE SKIP LOCKED`` and then changes them
changes at most n rows, whatever plan the statistics lead to.

A pick written as ``UPDATE t … FROM (SELECT id … LIMIT n FOR UPDATE SKIP LOCKED) AS picked WHERE
t.id = picked.id`` may be planned as a nested loop with the table outside and the pick inside, run
again for each outer row. Each new run skips the rows this statement has already changed and locks
the next n: the statement changed every row of the queue. That plan comes from statistics saying
the table is empty (an ANALYZE of an emptied table, with its pages not yet truncated), which CI hit
once: a claim of 5 took all 50 tasks of the queue, and an admission would have admitted every waiting
task of a key past its limit. Here the statistics are set so, inside the test's transaction."""

from __future__ import annotations

import datetime as dt

import pytest
from django.db import connection

from tasks.maintenance.retention import PruneCursor, prune_batch
from tasks.models import Task
from tests.helpers.task_paths import NOOP

pytestmark = pytest.mark.django_db


@pytest.fixture
def empty_looking_table() -> None:
    """tasks_task's statistics as an ANALYZE leaves them on an emptied table that kept its pages."""
    with connection.cursor() as cursor:
        cursor.execute("UPDATE pg_class SET reltuples = 0, relpages = 1000 WHERE relname = 'tasks_task'")


def statuses(ids: list[int]) -> dict[str, int]:
    rows = Task.objects.filter(pk__in=ids).values_list("status", flat=True)
    return {status: list(rows).count(status) for status in set(rows)}


@pytest.mark.parametrize("queues", [["mail"], ["mail", "other"]], ids=["one queue", "several queues"])
def test_a_claim_takes_at_most_its_limit(empty_looking_table: None, queues: list[str]) -> None:
    ids = Task.objects.bulk_enqueue(NOOP, [{}] * 50, queue="mail")
    assert len(Task.objects.claim("w1", limit=5, queues=queues)) == 5
    assert statuses(ids) == {"RUNNING": 5, "READY": 45}


def test_a_fair_claim_takes_at_most_its_limit(empty_looking_table: None, settings) -> None:
    """The fair pick (tasks/lifecycle/statements.py, ``_PICK_FAIR``) locks in a MATERIALIZED CTE and
    its fill reads that CTE's ids once: its every form claims at most its limit."""
    settings.LEASING_TASKS = {"FAIR_QUEUES": ["mail"]}
    ids = [i for key in "abc" for i in Task.objects.bulk_enqueue(NOOP, [{}] * 20, queue="mail", fair_key=key)]
    ids += Task.objects.bulk_enqueue(NOOP, [{}] * 10, queue="mail")  # the shared key ""
    [first] = Task.objects.claim("w1", limit=1, queues=["mail"])
    assert len(Task.objects.claim("w1", limit=5, queues=["mail"], fair_after="a")) == 5
    for starts in ([], [(first.id, first.token, None)]):
        _accepted, _marked, claimed = Task.objects.finish_start_claim("w1", [], starts, limit=3, queues=["mail"])
        assert len(claimed) == 3
    assert statuses(ids) == {"RUNNING": 12, "READY": 58}


def test_the_workers_round_claims_at_most_its_limit(empty_looking_table: None) -> None:
    ids = Task.objects.bulk_enqueue(NOOP, [{}] * 50, queue="mail")
    [first] = Task.objects.claim("w1", limit=1, queues=["mail"])
    for starts in ([], [(first.id, first.token, None)]):  # the finish-and-claim and finish-start-claim forms
        _accepted, _marked, claimed = Task.objects.finish_start_claim("w1", [], starts, limit=3, queues=["mail"])
        assert len(claimed) == 3
    assert statuses(ids) == {"RUNNING": 7, "READY": 43}


def test_an_admission_admits_at_most_the_free_slots(empty_looking_table: None) -> None:
    ids = Task.objects.bulk_enqueue(NOOP, [{}] * 50, concurrency_key="smtp", concurrency_limit=2)
    assert statuses(ids) == {"READY": 2, "BLOCKED": 48}


def test_recovery_takes_at_most_its_batch(empty_looking_table: None) -> None:
    ids = Task.objects.bulk_enqueue(NOOP, [{}] * 50, queue="mail")
    Task.objects.claim("w1", limit=50, queues=["mail"], ttl=60)
    Task.objects.filter(pk__in=ids).update(expires_at=dt.datetime(2000, 1, 1, tzinfo=dt.timezone.utc))
    assert len(Task.objects.recover_expired(limit=5)) == 5
    assert statuses(ids) == {"RUNNING": 45, "READY": 5}


def test_a_prune_batch_deletes_at_most_its_limit(empty_looking_table: None) -> None:
    ids = Task.objects.bulk_enqueue(NOOP, [{}] * 50, queue="mail")
    Task.objects.filter(pk__in=ids).update(
        status="SUCCESSFUL", finished_at=dt.datetime(2000, 1, 1, tzinfo=dt.timezone.utc)
    )
    prune_batch(PruneCursor("SUCCESSFUL", dt.timedelta(days=1)), limit=5)
    assert Task.objects.filter(pk__in=ids).count() == 45


def test_a_semaphore_acquire_takes_one_slot(empty_looking_table: None) -> None:
    """A guard: the slot pick is a CTE, which PostgreSQL already ran once (its clock_timestamp() kept
    it from being folded into the UPDATE); it is MATERIALIZED now, so that stays so on purpose."""
    from leasing.models import Lease

    with connection.cursor() as cursor:
        cursor.execute("UPDATE pg_class SET reltuples = 0, relpages = 1000 WHERE relname = 'leasing_lease'")
    for holder in ("a", "b", "c"):  # three slots, then all expired
        assert Lease.objects.acquire_slot("pool", holder, ttl=60, limit=3) is not None
    Lease.objects.filter(resource__startswith="pool#").update(
        expires_at=dt.datetime(2000, 1, 1, tzinfo=dt.timezone.utc)
    )
    assert Lease.objects.acquire_slot("pool", "d", ttl=60, limit=3) is not None
    assert Lease.objects.filter(resource__startswith="pool#", holder="d").count() == 1
