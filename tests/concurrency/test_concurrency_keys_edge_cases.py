"""Concurrency keys under attack: real worker processes, real PostgreSQL,
the database's truth sampled from a second connection.

Found by a bug hunt (breaker) on issue 12, part 3: concurrency keys."""

from __future__ import annotations

import datetime as dt
import threading

import pytest
from django.db import DatabaseError, connection, connections, transaction
from django.utils import timezone

from tasks.models import ConcurrencyKey, Task, TaskStatus
from tests.concurrency.test_concurrency_keys import Sampler, all_finished
from tests.helpers import wait_until
from tests.helpers.api import Api
from tests.helpers.task_paths import NOOP
from tests.helpers.workers import Workers
from tests.testapp.models import Effect

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

FAST = ["--ttl", "1", "--recovery-interval", "0.2", "--poll-interval", "0.2"]
SPAN = "tests.testapp.handlers.span"


def test_a_deferred_task_of_a_key_sorting_after_a_thousand_busy_keys_still_runs(workers: Workers) -> None:
    """The recovery sweep admits for the first SWEEP_KEYS (1000) keys with waiting tasks by name and
    used to start from the first key every round: with 1000 full keys sorting before it, a key's
    deferred task (or one an admission skipped) was never admitted, however long the workers ran."""
    # 1000 keys, each full (one admitted task parked on a queue nobody serves) with one task waiting.
    for i in range(1000):
        Task.objects.bulk_enqueue(NOOP, [{}, {}], queue="parked", concurrency_key=f"a-{i:04d}", concurrency_limit=1)
    assert Task.objects.filter(status=TaskStatus.BLOCKED).count() == 1000
    # A key with room whose only task is deferred briefly: only the sweep can admit it when it is due.
    due = timezone.now() + dt.timedelta(seconds=0.5)
    late = Task.objects.enqueue(SPAN, concurrency_key="zz-late", concurrency_limit=1, run_after=due)
    assert Task.objects.get(pk=late.id).status == TaskStatus.BLOCKED
    workers.start("sweeper", *FAST, "--concurrency", "2")
    wait_until(lambda: all_finished([late.id]), 30, 0.1, what="the deferred keyed task to run")
    assert Task.objects.get(pk=late.id).status == TaskStatus.SUCCESSFUL
    # The busy keys never went over their limit of one while the sweep went round them.
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT max(n) FROM (SELECT count(*) AS n FROM tasks_task WHERE status IN ('READY', 'RUNNING')"
            " AND concurrency_key LIKE 'a-%%' GROUP BY concurrency_key) AS s"
        )
        assert cursor.fetchone()[0] == 1


def test_inserting_a_keyed_task_straight_into_running_is_refused() -> None:
    """Every path obeys the gate: an UPDATE of a keyed task to RUNNING is refused, and so must an
    INSERT of one (a fixture load, a restore, an operator's INSERT), or the key goes over its limit."""
    first = Task.objects.enqueue(NOOP, concurrency_key="direct", concurrency_limit=1)
    assert Task.objects.get(pk=first.id).status == TaskStatus.READY
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT string_agg(quote_ident(column_name), ', ') FROM information_schema.columns"
            " WHERE table_name = 'tasks_task' AND column_name NOT IN ('id', 'status', 'dedup_key')"
        )
        (columns,) = cursor.fetchone()
    with (
        pytest.raises(DatabaseError, match="runs only once admitted"),
        transaction.atomic(),
        connection.cursor() as cursor,
    ):
        cursor.execute(
            f"INSERT INTO tasks_task ({columns}, status) SELECT {columns}, 'RUNNING' FROM tasks_task WHERE id = %s",
            [first.id],
        )
    assert Task.objects.filter(concurrency_key="direct", status__in=["READY", "RUNNING"]).count() == 1


def test_opposite_order_batches_over_many_keys_neither_deadlock_nor_overfill(workers: Workers) -> None:
    """Many keys of limit 2, tasks of all keys interleaved in opposite orders, six worker threads in
    three processes finishing batches touching several keys at once, while this test cancels and
    requeues tasks of the same keys in opposite key orders: no deadlock error, no key above its limit
    on the database's truth, everything drains."""
    keys = [f"k{i}" for i in range(6)]
    ids: list[int] = []
    for round_ in range(15):
        order = keys if round_ % 2 == 0 else list(reversed(keys))
        for key in order:
            ids += Task.objects.bulk_enqueue(SPAN, [{"seconds": 0.005}] * 2, concurrency_key=key, concurrency_limit=2)
    unkeyed = Task.objects.bulk_enqueue(SPAN, [{"seconds": 0.005}] * 30)
    errors: list[BaseException] = []
    stop = threading.Event()

    def operator(reverse: bool) -> None:
        try:
            while not stop.is_set():
                blocked = list(
                    Task.objects.filter(status=TaskStatus.BLOCKED, pk__in=ids)
                    .order_by("-concurrency_key" if reverse else "concurrency_key")
                    .values_list("id", flat=True)[:6]
                )
                if not blocked:
                    return
                with connection.cursor() as cursor:
                    # One statement over several keys: cancel, then requeue (through the gate) again.
                    cursor.execute(
                        "UPDATE tasks_task SET status = 'CANCELLED' WHERE id = ANY(%s) AND status = 'BLOCKED'",
                        [blocked],
                    )
                    cursor.execute(
                        "UPDATE tasks_task SET status = 'READY' WHERE id = ANY(%s) AND status = 'CANCELLED'", [blocked]
                    )
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections["default"].close()

    samplers = [Sampler(key) for key in keys]
    for sampler in samplers:
        sampler.start()
    try:
        for i in range(3):
            workers.start(f"w{i}", *FAST, "--concurrency", "2", "--batch-size", "4")
        operators = [threading.Thread(target=operator, args=(r,)) for r in (False, True)]
        for thread in operators:
            thread.start()
        wait_until(lambda: all_finished(ids + unkeyed), 180, 0.2, what="every key's backlog to drain")
    finally:
        stop.set()
        for sampler in samplers:
            sampler.stopped.set()
            sampler.join(10)
    for thread in operators:
        thread.join(30)
    assert not errors, errors
    assert all(s.max_admitted <= 2 for s in samplers), [(s.key, s.max_admitted) for s in samplers]
    assert Task.objects.filter(pk__in=ids + unkeyed, status=TaskStatus.SUCCESSFUL).count() == len(ids) + 30
    assert Effect.objects.filter(task_id__in=ids, phase="ended").count() == len(ids)


@pytest.mark.parametrize(
    "fields",
    [
        '"concurrency_key": "k", "concurrency_limit": 1e400',
        '"concurrency_key": "k", "concurrency_limit": -1e400',
        '"concurrency_key": "k", "concurrency_limit": NaN',
        '"concurrency_key": "k", "concurrency_limit": 2.0',
        '"concurrency_key": "k", "concurrency_limit": 99999999999999999999999999999999999999',
        '"concurrency_key": "k", "concurrency_limit": false',
        '"concurrency_key": "k", "concurrency_limit": null',
        '"concurrency_key": null, "concurrency_limit": 2',
        '"concurrency_key": "\\udfff\\ud800", "concurrency_limit": 2',
        '"concurrency_key": "' + "\u00e9" * 256 + '", "concurrency_limit": 2',
        '"concurrency_key": {"k": 1}, "concurrency_limit": 2',
        '"concurrency_key": true, "concurrency_limit": 2',
        '"concurrency_key": "k", "concurrency_limit": {"n": 2}',
    ],
)
def test_hostile_concurrency_fields_get_400_and_store_nothing(task_api: Api, fields: str) -> None:
    status, body = task_api.enqueue(raw='{"task_path": "' + NOOP + '", ' + fields + "}")
    assert status == 400, body
    assert body["error"], body
    assert not Task.objects.exists() and not ConcurrencyKey.objects.exists()
