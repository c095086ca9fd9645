"""Bulk operations against the other features' states: concurrency keys (a retry
must not make more of a key runnable than its limit; a cancel of an admitted task must free its slot),
workflows (a cancelled or discarded step's dependants must not wait forever), dedup keys (a retry
that collides, worked by two runners at once).

Found by breaker 32 (the bug hunt on issue 25's operations: bulk operations, history, tracing, test helpers)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from django.db import connection, connections

from tasks.maintenance.bulk import BulkRunner
from tasks.models import FINISHED, BulkOperation, Task, TaskStatus
from tasks.workflows import chain, step
from tests.testapp import testing_handlers as h

pytestmark = pytest.mark.django_db(transaction=True)

P = h.PATH
KEY: dict[str, Any] = {"concurrency_key": "breaker32-bulk", "concurrency_limit": 1}


def statuses(ids: list[int]) -> list[str]:
    found = dict(Task.objects.filter(pk__in=ids).values_list("pk", "status"))
    return [found.get(pk, "(deleted)") for pk in ids]


def fail(ids: list[int]) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE tasks_task SET status = 'FAILED', finished_at = clock_timestamp() WHERE id = ANY(%s)", [ids]
        )


def test_a_bulk_retry_of_a_keys_failed_tasks_admits_no_more_than_its_limit() -> None:
    ids = [Task.objects.enqueue(P + "record", args=[f"k{i}"], **KEY).id for i in range(5)]
    fail(ids)
    assert statuses(ids) == ["FAILED"] * 5
    BulkOperation.objects.request("retry", {"task_path": P + "record"})
    BulkRunner(batch_size=2, span=3).run_until_idle()
    now = statuses(ids)
    assert now.count("READY") == 1 and now.count("BLOCKED") == 4, now


def test_a_bulk_cancel_of_a_keys_admitted_task_admits_the_next() -> None:
    ids = [Task.objects.enqueue(P + "record", args=[f"k{i}"], **KEY).id for i in range(3)]
    assert statuses(ids) == ["READY", "BLOCKED", "BLOCKED"]
    BulkOperation.objects.request("cancel", {"status": "READY", "task_path": P + "record"})
    BulkRunner().run_until_idle()
    assert statuses(ids) == ["CANCELLED", "READY", "BLOCKED"]


@pytest.mark.parametrize("kind", ["cancel", "discard"])
def test_a_bulk_change_of_a_workflows_first_step_settles_its_dependants(kind: str) -> None:
    flow = chain(step(P + "record", "a"), step(P + "record", "b"), step(P + "record", "c")).enqueue()
    before = statuses(flow.task_ids)
    assert before[0] == "READY" and before[1:] == ["AWAITING", "AWAITING"], before
    operation = BulkOperation.objects.request(kind, {"workflow_id": flow.id, "status": "READY"})
    BulkRunner().run_until_idle()
    operation.refresh_from_db()
    assert operation.changed == 1
    after = statuses(flow.task_ids)
    assert all(s in FINISHED for s in after), after


def test_a_retry_colliding_on_dedup_keys_worked_by_two_runners_at_once() -> None:
    # Failed rows with dedup keys: 0..59 alone; 60..89 each with an unfinished twin (READY, same key);
    # 90..119 in pairs of failed rows sharing a key (only one of a pair can be retried).
    solo = [Task.objects.enqueue(P + "record", args=[f"s{i}"], dedup_key=f"solo-{i}").id for i in range(60)]
    fail(solo)
    twinned = [Task.objects.enqueue(P + "record", args=[f"t{i}"], dedup_key=f"twin-{i}").id for i in range(30)]
    fail(twinned)
    twins = [Task.objects.enqueue(P + "record", args=[f"t{i}"], dedup_key=f"twin-{i}").id for i in range(30)]
    pairs: list[int] = []
    for i in range(15):
        a = Task.objects.enqueue(P + "record", args=[f"p{i}"], dedup_key=f"pair-{i}").id
        fail([a])
        b = Task.objects.enqueue(P + "record", args=[f"p{i}"], dedup_key=f"pair-{i}").id
        fail([b])
        pairs += [a, b]
    operation = BulkOperation.objects.request("retry", {"task_path": P + "record"})
    errors: list[BaseException] = []

    def runner() -> None:
        try:
            BulkRunner(batch_size=8, span=25).run_until_idle()
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=runner) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    operation.refresh_from_db()
    summary: Any = (operation.status, operation.matched, operation.changed, operation.skipped, operation.error)
    assert operation.status == "DONE", summary
    assert statuses(solo) == ["READY"] * 60
    assert statuses(twinned) == ["FAILED"] * 30 and statuses(twins) == ["READY"] * 30
    pair_states = statuses(pairs)
    for i in range(15):
        assert sorted(pair_states[2 * i : 2 * i + 2]) == ["FAILED", "READY"], pair_states
    assert (operation.matched, operation.changed, operation.skipped) == (120, 75, 45), summary
    assert not Task.objects.filter(status=TaskStatus.RUNNING).exists()
