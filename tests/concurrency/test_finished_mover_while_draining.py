"""The mover (tasks/maintenance/archive.py, ARCHIVE_AFTER "0s") moving tasks as real workers finish
them: retries, snoozes, an operator's cancels, concurrency keys, rate keys, dedup keys, and an
operator's delete of finished tasks racing the batches for the same rows. Every task runs exactly
once (its effect recorded once), ends final, and its row ends in exactly one of the two tables (or
deleted by the operator), whole: every column as it was when it became final."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection
from django.db.models import Count

from tasks.maintenance.archive import Archiver
from tasks.models import Task
from tests.db.test_finished_mover import roll_up_hours
from tests.db.test_finished_partitions import drop_partitions
from tests.helpers import stop_process, wait_until
from tests.testapp.models import Effect

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.one_stack]

RECORD = "tests.testapp.handlers.record"

# Rows final (not yet aged) go three hours back, to an hour the history has counted: the mover's next
# batch may take them. The row as it then stands is what must arrive in tasks_finished.
AGE_FINAL_SQL = """
UPDATE tasks_task AS t SET finished_at = t.finished_at - interval '3 hours'
WHERE t.id = ANY(%s) AND t.status IN ('SUCCESSFUL', 'FAILED', 'CANCELLED')
  AND t.finished_at > statement_timestamp() - interval '1 hour'
RETURNING t.id, to_jsonb(t)
"""
FOUND_SQL = """
SELECT id, 'tasks_task', to_jsonb(t) FROM tasks_task AS t WHERE id = ANY(%(ids)s)
UNION ALL SELECT id, 'tasks_finished', to_jsonb(f) FROM tasks_finished AS f WHERE id = ANY(%(ids)s)
"""


@pytest.fixture(autouse=True)
def mover_on(settings: Any) -> Iterator[None]:
    drop_partitions()
    settings.LEASING_TASKS = {"ARCHIVE_AFTER": "0s"}
    yield
    drop_partitions()


def as_dict(value: Any) -> dict[str, Any]:
    return json.loads(value) if isinstance(value, str) else value


def test_tasks_moved_while_workers_drain_run_once_and_arrive_whole(processes: Any) -> None:
    roll_up_hours()  # every past hour counted, 6 minutes ago
    plain = Task.objects.bulk_enqueue(RECORD, [{}] * 200)
    retried = [
        Task.objects.enqueue("tests.testapp.handlers.fail_until", kwargs={"succeed_on": 2}).id for _ in range(30)
    ]
    snoozed = [
        Task.objects.enqueue("tests.testapp.handlers.composed", kwargs={"snooze_first": True}).id for _ in range(30)
    ]
    keyed = [Task.objects.enqueue(RECORD, concurrency_key="k", concurrency_limit=2).id for _ in range(40)]
    rated = [Task.objects.enqueue(RECORD, rate_key="r", rate_limit="100/s").id for _ in range(40)]
    deduped = [Task.objects.enqueue(RECORD, dedup_key=f"d{i}").id for i in range(40)]
    cancelled = Task.objects.bulk_enqueue(RECORD, [{}] * 40, run_after=None, queue="later")
    assert Task.objects.filter(pk__in=cancelled).cancel() == 40  # an operator's, before any worker
    ids = [*plain, *retried, *snoozed, *keyed, *rated, *deduped, *cancelled]
    final: dict[int, dict[str, Any]] = {}
    deleted: set[int] = set()
    moved = [0]
    stop = threading.Event()
    errors: list[BaseException] = []

    def mover() -> None:
        archiver = Archiver(interval=0.0)
        try:
            while not stop.is_set():
                with connection.cursor() as cursor:
                    cursor.execute(AGE_FINAL_SQL, [ids])
                    final.update({task_id: as_dict(row) for task_id, row in cursor.fetchall()})
                moved[0] += archiver.run_for(1.0)
        except BaseException as exc:  # reported by the test's thread
            errors.append(exc)
        finally:
            connection.close()

    def operator() -> None:
        """Deletes finished tasks, 10 at a time, among those the mover may be taking."""
        try:
            while not stop.is_set():
                batch = sorted(set(final) - deleted)[:10]
                if batch:
                    Task.objects.filter(pk__in=batch).delete_finished()  # those the mover did not take
                    with connection.cursor() as cursor:
                        cursor.execute(FOUND_SQL, {"ids": batch})
                        deleted.update(set(batch) - {row[0] for row in cursor.fetchall()})
                stop.wait(0.05)  # a pacing of the operator, not a synchronisation
        except BaseException as exc:
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=mover), threading.Thread(target=operator)]
    for thread in threads:
        thread.start()
    # The workers' own recovery leaders must not move rows (their default ARCHIVE_AFTER, 10 minutes,
    # takes the rows aged three hours): the test's mover is the only one, so its count is every move.
    # A clean-clone run on a loaded machine counted 48 rows moved against the test mover's 30.
    quiet = json.dumps({"ARCHIVE_AFTER": None})
    workers = [
        processes("run_worker", "--worker-id", f"w{i}", "--concurrency", "4", "-v", "0", LEASING_TEST_TASKS=quiet)
        for i in range(2)
    ]
    try:
        wait_until(lambda: len(final) == len(ids) or errors, 60, interval=0.2, what="every task final and aged")
        assert errors == [], errors
        wait_until(lambda: moved[0] > 0, 20, what="the mover to move")
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
        for proc in workers:
            stop_process(proc)
    assert errors == []
    tail = Archiver(interval=0.0).run_for(30.0)  # whatever the last pass left
    with connection.cursor() as cursor:
        cursor.execute(FOUND_SQL, {"ids": ids})
        found = cursor.fetchall()
    where: dict[int, list[str]] = {}
    for task_id, table, row in found:
        where.setdefault(task_id, []).append(table)
        assert as_dict(row) == final[task_id], task_id  # whole: every column as when it became final
    assert all(len(tables) == 1 for tables in where.values()), where  # never in both
    absent = set(ids) - set(where)
    assert absent <= deleted  # a row is gone only by the operator's delete (never lost by the move)
    in_finished = [task_id for task_id, tables in where.items() if tables == ["tasks_finished"]]
    assert len(in_finished) == moved[0] + tail > 0  # every move counted once; the deletes took the rest
    assert {final[i]["status"] for i in ids} == {"SUCCESSFUL", "CANCELLED"}
    assert {final[i]["status"] for i in cancelled} == {"CANCELLED"}
    assert {final[i]["attempts"] for i in retried} == {2}
    ran = [i for i in ids if i not in set(cancelled)]
    per_task = Effect.objects.filter(task_id__in=ran, phase="done").values("task_id").annotate(n=Count("id"))
    assert {row["task_id"] for row in per_task} == set(ran) - set(retried)  # fail_until records no effect
    assert {row["n"] for row in per_task} == {1}  # exactly once each
    assert not Effect.objects.filter(task_id__in=cancelled).exists()
