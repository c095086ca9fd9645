"""Concurrency keys at scale (issue 20): the sweep keeps no position and reads only the keys there
is work for, a locked key defers only its own admission, a deduplicated enqueue changes nothing,
and a statement over thousands of keys admits for each of them (tasks/lifecycle/concurrency.py)."""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import OperationalError, connection, connections, transaction

from tasks.lifecycle import concurrency
from tasks.models import ConcurrencyKey, ConcurrencyWake, Task, TaskStatus
from tests.helpers import child_env, wait_until
from tests.helpers.task_paths import NOOP
from tests.helpers.zygote import run_python

pytestmark = pytest.mark.django_db(transaction=True)

ROOT = Path(__file__).resolve().parents[2]

# One statement: ``per_key`` tasks for each of ``keys`` keys named prefix-00000.., limit ``limit``,
# enqueued READY (the insert trigger makes them wait; the statement's admission decides).
KEYED_BULK_SQL = """
INSERT INTO tasks_task (queue, priority, task_path, args, kwargs, status, run_after, enqueued_at, attempts,
    max_attempts, errors, worker_ids, renewals, transitions, failures, crashes, shared_crashes, unstarted_returns,
    attempt_started, attempt_isolated, concurrency_key, concurrency_limit)
SELECT %(queue)s, 0, %(path)s, '[]', '{}', 'READY', clock_timestamp() + make_interval(secs => %(delay)s),
       clock_timestamp(), 0, 3, '[]', '[]', 0, 0, 0, 0, 0, 0, false, false,
       %(prefix)s || lpad(k::text, 5, '0'), %(limit)s
FROM generate_series(1, %(keys)s) AS k, generate_series(1, %(per_key)s) AS r
"""


def bulk_keyed(
    prefix: str, keys: int, *, per_key: int = 1, limit: int = 1, delay: float = 0, queue: str = "default"
) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            KEYED_BULK_SQL,
            {
                "prefix": prefix,
                "keys": keys,
                "per_key": per_key,
                "limit": limit,
                "delay": delay,
                "path": NOOP,
                "queue": queue,
            },
        )


def keyed(key: str, limit: int = 1, **kwargs: Any) -> int:
    return Task.objects.enqueue(NOOP, concurrency_key=key, concurrency_limit=limit, **kwargs).id


def status(task_id: int) -> str:
    return Task.objects.get(pk=task_id).status


def due_now(task_id: int) -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT run_after <= clock_timestamp() FROM tasks_task WHERE id = %s", [task_id])
        return bool(cursor.fetchone()[0])


def test_a_deferred_task_of_a_key_after_a_thousand_full_ones_is_admitted_by_recovery_from_cron() -> None:
    """`recover_tasks --once` (from cron: a new process each time) used to start its sweep from the
    first key: with more than 1,000 keys waiting before it, a key's deferred task stayed BLOCKED for
    ever. Every run now reads the keys due, wherever they sort."""
    bulk_keyed("a-", 1100, per_key=2, queue="parked")  # 1,100 full keys, one task waiting in each
    assert Task.objects.filter(status=TaskStatus.BLOCKED).count() == 1100
    late = keyed("zz-late", run_after=dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=0.5))
    assert status(late) == TaskStatus.BLOCKED
    wait_until(lambda: due_now(late), 10, 0.05, what="the deferred task to come due")
    runs = 0
    while status(late) == TaskStatus.BLOCKED and runs < 2:
        run_python(["manage.py", "recover_tasks", "--once"], cwd=ROOT, env=child_env(), check=True)
        runs += 1
    assert status(late) == TaskStatus.READY
    assert runs == 1  # within one round
    # The full keys stayed at their limit of one.
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT max(n) FROM (SELECT count(*) AS n FROM tasks_task WHERE status IN ('READY', 'RUNNING')"
            " AND concurrency_key LIKE 'a-%%' GROUP BY concurrency_key) AS s"
        )
        assert cursor.fetchone()[0] == 1


def sweep_blocks() -> int:
    """Buffers one sweep statement reads (its function's statements are counted in its node)."""
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) SELECT * FROM tasks_concurrency_sweep(500)")
        plan = cursor.fetchone()[0][0]["Plan"]
        transaction.set_rollback(True)
    return int(plan["Shared Hit Blocks"] + plan["Shared Read Blocks"])


def test_a_sweep_reads_the_keys_due_not_the_keys_waiting() -> None:
    """4,000 keys with waiting tasks (2,000 full, 2,000 deferred for an hour): a sweep with nothing
    due reads a handful of blocks, as it does with none; one due key costs a few more. (A sweep that
    read every key waiting read about 40 more blocks at this size, 190 at 20,000 keys: the bound
    catches it at either size; 4,000 keys take a fifth of the CPU.)"""
    # Plans the functions' statements (an admission, a sweep): their catalog reads are not the sweep's.
    keyed("warm-up")
    sweep_blocks()
    empty = sweep_blocks()
    bulk_keyed("full-", 2_000, per_key=2)
    bulk_keyed("later-", 2_000, delay=3600)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE tasks_task; ANALYZE tasks_concurrencykey")
    sweep_blocks()
    idle = sweep_blocks()
    late = keyed("m-late", run_after=dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=0.3))
    wait_until(lambda: due_now(late), 10, 0.05, what="the deferred task to come due")
    one_due = sweep_blocks()
    assert idle <= empty + 5, (empty, idle)
    # The admission itself, an UPDATE through every index: 123 blocks alone, 188 once within the full
    # suite (the session's caches and earlier tests' dead entries). The filter this guards against
    # adds about 190 to both sweeps (docs/explanation/benchmarks.md); the idle bound above is the sharp one.
    assert one_due <= empty + 230, (empty, one_due)
    assert concurrency.admit_waiting() == 1
    assert status(late) == TaskStatus.READY


def test_every_key_of_a_bulk_statement_is_admitted_for() -> None:
    """One statement over 3,000 keys (an insert, then a cancel of every admitted task) admits for each
    key once, set-based (the per-row notes of 0009 were quadratic in keys)."""
    bulk_keyed("bulk-", 3000, per_key=3)
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FILTER (WHERE status = 'READY'), count(*) FILTER (WHERE status = 'BLOCKED')"
            " FROM tasks_task WHERE concurrency_key LIKE 'bulk-%%'"
        )
        assert cursor.fetchone() == (3000, 6000)
    assert Task.objects.filter(concurrency_key__startswith="bulk-", status=TaskStatus.READY).cancel() == 3000
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FILTER (WHERE status = 'READY'), count(*) FILTER (WHERE status = 'BLOCKED'),"
            " count(*) FILTER (WHERE status = 'CANCELLED') FROM tasks_task WHERE concurrency_key LIKE 'bulk-%%'"
        )
        assert cursor.fetchone() == (3000, 3000, 3000)
    # A cancel of everything left frees every slot and admits nothing more (nothing waits).
    assert Task.objects.filter(concurrency_key__startswith="bulk-").cancel() == 6000
    assert not Task.objects.filter(concurrency_key__startswith="bulk-", status__in=["READY", "BLOCKED"]).exists()


def test_an_admission_reads_its_key_not_the_table_whatever_the_statistics_say() -> None:
    """PL/pgSQL keeps a generic plan of each statement after five calls, planned from the statistics of
    the moment: with statistics taken while the table was empty (a new deployment), each admission
    still reads its own key's index entries, not the table."""
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE tasks_task")  # empty: the statistics of a new deployment
    bulk_keyed("stale-", 3000, per_key=3)
    blocks = []
    with connection.cursor() as cursor:
        # The session's first call compiles the function and reads the catalog (885 blocks once, on a
        # connection new to it): those reads are not the admission's. One untimed call first.
        with transaction.atomic():
            cursor.execute("SELECT tasks_concurrency_admit(%s, NULL, NULL)", ["stale-warm-up"])
        for n in range(1, 12):  # past the five custom plans PL/pgSQL makes before a generic one
            with transaction.atomic():
                cursor.execute(
                    "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) SELECT tasks_concurrency_admit(%s, NULL, NULL)",
                    [f"stale-{n:05d}"],
                )
                plan = cursor.fetchone()[0][0]["Plan"]
                blocks.append(plan["Shared Hit Blocks"] + plan["Shared Read Blocks"])
    assert max(blocks) < 100, blocks


def test_a_deduplicated_enqueue_changes_nothing() -> None:
    first = Task.objects.enqueue(NOOP, concurrency_key="dedup", concurrency_limit=2, dedup_key="once")
    assert first.created
    again = Task.objects.enqueue(NOOP, concurrency_key="dedup", concurrency_limit=5, dedup_key="once")
    assert not again.created and again.id == first.id
    assert ConcurrencyKey.objects.get(key="dedup").max_running == 2


@pytest.fixture
def held_keys() -> Iterator[tuple[list[str], threading.Event]]:
    """16 keys, each with one task RUNNING, held by 16 application transactions that enqueued one more
    task of their key and stay open until the event is set."""
    keys = [f"held-{n:02d}" for n in range(16)]
    for key in keys:
        keyed(key, limit=1)
    holding = [threading.Event() for _ in keys]
    release = threading.Event()

    def application(key: str, ready: threading.Event) -> None:
        try:
            with transaction.atomic():
                keyed(key, limit=1)
                ready.set()
                release.wait(60)
        finally:
            connections["default"].close()

    threads = [threading.Thread(target=application, args=(k, h)) for k, h in zip(keys, holding, strict=True)]
    for thread in threads:
        thread.start()
    try:
        assert all(h.wait(10) for h in holding)
        yield keys, release
    finally:
        release.set()
        for thread in threads:
            thread.join(30)


def test_keys_held_by_open_transactions_never_make_a_statement_wait(
    held_keys: tuple[list[str], threading.Event],
) -> None:
    """A finishing statement over 16 keys that applications hold used to wait 200 ms for each, one
    after the other (3.2 s), while every other task of the worker waited behind it. The statement now
    runs under a 1 s statement timeout and returns: each held key is noted for later instead."""
    keys, release = held_keys
    claimed = Task.objects.claim("w1", limit=100)
    assert len(claimed) == 16
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET LOCAL statement_timeout = '1s'")
        try:
            done = Task.objects.complete_many("w1", [(c.id, c.token, "null") for c in claimed])
        except OperationalError as exc:  # pragma: no cover - the failure this test exists for
            pytest.fail(f"a finish waited for keys held by other transactions: {exc}")
    assert len(done) == 16
    assert ConcurrencyWake.objects.filter(key__in=keys).values("key").distinct().count() == 16
    release.set()

    def swept() -> bool:
        # The applications commit after the release, each on its thread: until they have, their
        # tasks are not visible at all (neither BLOCKED nor READY), so wait for all 16 admitted.
        concurrency.admit_waiting()
        return Task.objects.filter(concurrency_key__in=keys, status=TaskStatus.READY).count() == 16

    wait_until(swept, 10, 0.05, what="the applications to commit and the sweep to admit their tasks")
    assert not Task.objects.filter(concurrency_key__in=keys, status=TaskStatus.BLOCKED).exists()
    assert not ConcurrencyWake.objects.filter(key__in=keys).exists()


def test_the_limit_of_an_enqueue_that_found_its_key_held_is_applied_after(
    held_keys: tuple[list[str], threading.Event],
) -> None:
    """An enqueue that finds its key held is noted with its limit; the latest enqueue (largest id)
    still sets the key's limit once the key is free."""
    keys, release = held_keys
    key = keys[0]
    raised = keyed(key, limit=3)  # the application holds the key: noted, nothing admitted
    assert status(raised) == TaskStatus.BLOCKED
    assert ConcurrencyKey.objects.get(key=key).max_running == 1
    release.set()

    def swept() -> bool:
        concurrency.admit_waiting()
        return ConcurrencyKey.objects.get(key=key).max_running == 3

    wait_until(swept, 10, 0.05, what="the sweep to apply the held enqueue's limit")
    assert Task.objects.filter(concurrency_key=key, status__in=["READY", "RUNNING"]).count() == 3
