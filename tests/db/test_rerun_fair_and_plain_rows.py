"""Requeue and bulk retry of keyless and keyed rows in fair and plain queues (RERUN_SET's
``fair_key``): a keyless row of a fair queue gets the shared key "", a tenant's key is kept, a plain
queue's NULL stays NULL, in one UPDATE that spans both kinds of queue, and the row is claimed again.

Found by breaker 34 (the bug hunt on the shared fair cursor)."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection

from tasks.maintenance.bulk import BulkRunner
from tasks.models import BulkOperation, Task
from tests.helpers.task_paths import NOOP

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fair_queues")]


def finished_rows() -> dict[str, int]:
    """One finished row of each kind: keyless and keyed, in the fair queue and in a plain one."""
    rows = {
        "fair-keyless": Task.objects.bulk_enqueue(NOOP, [{}], queue="fair")[0],
        "fair-keyed": Task.objects.bulk_enqueue(NOOP, [{}], queue="fair", fair_key="tenant")[0],
        "plain-keyless": Task.objects.bulk_enqueue(NOOP, [{}], queue="plain34")[0],
        "plain-keyed": Task.objects.bulk_enqueue(NOOP, [{}], queue="plain34", fair_key="tenant")[0],
    }
    with connection.cursor() as cursor:  # the fair queue's keyless row is from before it was fair
        cursor.execute("UPDATE tasks_task SET fair_key = NULL WHERE id = %s", [rows["fair-keyless"]])
        cursor.execute(
            "UPDATE tasks_task SET status = 'FAILED', finished_at = clock_timestamp() WHERE id = ANY(%s)",
            [list(rows.values())],
        )
    return rows


def keys(rows: dict[str, int]) -> dict[str, tuple[str, str | None]]:
    found = {pk: (status, key) for pk, status, key in Task.objects.values_list("pk", "status", "fair_key")}
    return {name: found[pk] for name, pk in rows.items()}


def expected(rows: dict[str, int]) -> dict[str, tuple[str, str | None]]:
    plain_keyed = Task.objects.get(pk=rows["plain-keyed"]).fair_key  # whatever an enqueue stored
    return {
        "fair-keyless": ("READY", ""),
        "fair-keyed": ("READY", "tenant"),
        "plain-keyless": ("READY", None),
        "plain-keyed": ("READY", plain_keyed),
    }


def test_one_requeue_over_fair_and_plain_rows() -> None:
    rows = finished_rows()
    want = expected(rows)
    assert Task.objects.filter(pk__in=rows.values()).requeue() == 4
    assert keys(rows) == want


def test_one_bulk_retry_over_fair_and_plain_rows() -> None:
    rows = finished_rows()
    want = expected(rows)
    operation = BulkOperation.objects.request("retry", {"task_path": NOOP})
    BulkRunner(batch_size=3, span=10).run_until_idle()
    operation.refresh_from_db()
    assert (operation.status, operation.changed, operation.error) == ("DONE", 4, ""), operation.__dict__
    assert keys(rows) == want


def test_a_requeued_keyless_row_is_claimed_by_a_fair_claim() -> None:
    rows = finished_rows()
    Task.objects.filter(pk__in=[rows["fair-keyless"], rows["fair-keyed"]]).requeue()
    claimed = Task.objects.claim("w", limit=5, queues=["fair"])
    assert sorted(c.id for c in claimed) == sorted([rows["fair-keyless"], rows["fair-keyed"]])


@pytest.mark.parametrize("kind", ["requeue", "retry"])
def test_no_fair_queue_at_all_leaves_every_key_as_it_was(settings: Any, kind: str) -> None:
    """FAIR_QUEUES empty (the default): the fragment's array parameter is empty, no key changes."""
    rows = finished_rows()
    before = {name: key for name, (_status, key) in keys(rows).items()}
    settings.LEASING_TASKS = {**settings.LEASING_TASKS, "FAIR_QUEUES": []}
    if kind == "requeue":
        assert Task.objects.filter(pk__in=rows.values()).requeue() == 4
    else:
        BulkOperation.objects.request("retry", {"task_path": NOOP})
        BulkRunner(batch_size=3, span=10).run_until_idle()
    assert keys(rows) == {name: ("READY", key) for name, key in before.items()}
