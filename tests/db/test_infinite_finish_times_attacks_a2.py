"""Infinite finish times (a hand edit, a restored dump) on workflow members and workflows: a dependant's
parent_results(), the workflow's pages and the API read them as no date (as FiniteDateTimeField does
for a task's own pages) instead of failing the whole read; the ORM's filters and ordering still see
the stored value, and a requeue of such rows reruns them."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from django.db import connection
from django.test import Client

from tasks.models import Task
from tasks.workflows import chain, parent_results, step
from tests.db.test_workflow_settle_races import run_all
from tests.helpers.api import TOKEN, Api
from tests.helpers.task_paths import NOOP

pytestmark = pytest.mark.django_db


def set_finished_at(task_id: int, value: str) -> None:
    with connection.cursor() as cursor:
        cursor.execute("UPDATE tasks_task SET finished_at = %s::timestamptz WHERE id = %s", [value, task_id])


@pytest.mark.parametrize("value", ["infinity", "-infinity"])
def test_a_workflow_with_an_infinite_member_reads_everywhere(
    staff: Client, client: Client, settings: Any, value: str
) -> None:
    settings.LEASING_API_TOKENS = [TOKEN]
    done = chain(step(NOOP), step(NOOP), pipe=False).enqueue()
    run_all()
    a, b = done.task_ids
    set_finished_at(a, value)
    with connection.cursor() as cursor:
        cursor.execute("UPDATE tasks_workflow SET finished_at = %s::timestamptz WHERE id = %s", [value, done.id])
    (parent,) = parent_results(b)
    assert (parent.id, parent.status, parent.finished_at) == (a, "SUCCESSFUL", None)
    pages = (f"/dashboard/workflows/{done.id}/", "/dashboard/workflows/", f"/admin/tasks/workflow/{done.id}/change/")
    for url in pages:
        assert staff.get(url).status_code == 200, url
    status, body = Api(client).call("GET", f"/api/workflows/{done.id}")
    assert status == 200, body


@pytest.mark.parametrize("value", ["infinity", "-infinity"])
def test_requeue_and_ordering_over_infinite_rows(value: str) -> None:
    ids = [Task.objects.enqueue(NOOP).id for _ in range(3)]
    Task.objects.filter(pk__in=ids).update(status="FAILED", finished_at=dt.datetime(2020, 1, 1, tzinfo=dt.timezone.utc))
    set_finished_at(ids[1], value)
    ordered = list(Task.objects.filter(pk__in=ids).order_by("finished_at", "id").values_list("id", flat=True))
    assert ordered == ([ids[1], ids[0], ids[2]] if value.startswith("-") else [ids[0], ids[2], ids[1]])
    cutoff = dt.datetime(2021, 1, 1, tzinfo=dt.timezone.utc)
    before = set(Task.objects.filter(pk__in=ids, finished_at__lt=cutoff).values_list("id", flat=True))
    assert before == ({*ids} if value.startswith("-") else {ids[0], ids[2]})
    assert Task.objects.filter(pk__in=ids).requeue() == 3
    assert set(Task.objects.filter(pk__in=ids).values_list("status", "finished_at")) == {("READY", None)}


@pytest.mark.django_db(transaction=True)
def test_a_bulk_retry_by_finish_time_takes_the_rows_before_it_and_reruns_them(staff: Client) -> None:
    from tasks.maintenance.bulk import BulkRunner
    from tasks.models import BulkOperation

    early, late, dated = (Task.objects.enqueue(NOOP).id for _ in range(3))
    Task.objects.filter(pk__in=[early, late, dated]).update(
        status="FAILED", finished_at=dt.datetime(2020, 1, 1, tzinfo=dt.timezone.utc)
    )
    set_finished_at(early, "-infinity")
    set_finished_at(late, "infinity")
    operation = BulkOperation.objects.request("retry", {"finished_before": "2021-01-01T00:00:00Z"})
    assert staff.get(f"/dashboard/tasks/bulk/{operation.pk}/").status_code == 200
    assert staff.get("/dashboard/tasks/bulk/").status_code == 200
    assert BulkRunner(batch_size=10, span=25).run_until_idle() == 2
    statuses = dict(Task.objects.filter(pk__in=[early, late, dated]).values_list("id", "status"))
    assert statuses == {early: "READY", late: "FAILED", dated: "READY"}
