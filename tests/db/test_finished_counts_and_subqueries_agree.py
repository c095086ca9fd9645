"""The admin's capped count over both tables agrees with a plain count of ``tasks_task UNION ALL
tasks_finished`` for searches whose lookups overlap (a term that is an id, a dedup key, a holder and a
task path at once), at every cap around the true count; and ``in_finished`` (plain and by status)
serves inside another query (``pk__in``, ``Exists``, ``Subquery``), nested, on every supported Django."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from django.db import connection
from django.db.models import Exists, OuterRef, Subquery
from django.test import Client

from leasing.pagination import Count
from tasks.models import Task
from tasks.models.finished import archived, in_finished
from tasks.web import listings
from tasks.web.listings import ALL_STATUSES, Listing
from tasks.web.queries import search_lookups
from tests.db.test_finished_lists import days, move  # noqa: F401 (days: the autouse fixture, its partitions)
from tests.helpers.task_paths import NOOP

pytestmark = pytest.mark.django_db(transaction=True)  # DDL of partitions

UTC = dt.timezone.utc
TERM = "w-%s_9"  # a holder, a dedup key and a task path at once (a '%' and a '_' in it)

BOTH_SQL = """
SELECT id, status, queue, task_path, dedup_key, holder, expires_at, 'hot' FROM tasks_task
UNION ALL
SELECT id, status, queue, task_path, dedup_key, holder, expires_at, 'moved' FROM tasks_finished
"""


def both_tables() -> list[dict[str, Any]]:
    names = ("id", "status", "queue", "task_path", "dedup_key", "holder", "expires_at", "table")
    with connection.cursor() as cursor:
        cursor.execute(BOTH_SQL)
        return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]


def matches(term: str, row: dict[str, Any]) -> bool:
    return (term.isdigit() and row["id"] == int(term)) or term in (row["dedup_key"], row["holder"], row["task_path"])


def overlapping_history() -> int:
    """Tasks of every status in both tables that one term finds through one, two, three or four of
    its lookups; returns the id every lookup finds (its own id is the other tasks' key, worker, path)."""
    now = dt.datetime.now(UTC)
    numeric = Task.objects.enqueue(NOOP, queue="alpha").id
    term = str(numeric)
    moved: list[int] = []
    shapes = [
        # (status, holder, dedup key, task path, moved, lease expired)
        ("SUCCESSFUL", TERM, TERM, TERM, True, False),
        ("SUCCESSFUL", TERM, None, NOOP, False, False),
        ("FAILED", TERM, TERM, NOOP, True, False),
        ("FAILED", None, TERM, TERM, False, False),
        ("CANCELLED", None, None, TERM, True, False),
        ("CANCELLED", None, TERM, NOOP, False, False),
        ("READY", None, TERM, TERM, False, False),
        ("RUNNING", TERM, None, TERM, False, False),
        ("RUNNING", TERM, None, NOOP, False, True),
        ("SUCCESSFUL", term, term, term, True, False),
        ("FAILED", term, None, term, False, False),
        ("CANCELLED", None, term, NOOP, True, False),
        ("READY", None, None, term, False, False),
        ("RUNNING", term, term, NOOP, False, True),
        ("SUCCESSFUL", "other", "other", NOOP, True, False),
        ("READY", None, "other", NOOP, False, False),
    ]
    for i, (status, holder, key, path, to_move, expired) in enumerate(shapes * 2):
        task_id = Task.objects.enqueue(NOOP, queue="alpha" if i % 2 else "beta").id
        changes: dict[str, Any] = {"task_path": path, "dedup_key": key if i < len(shapes) else None}
        if status in ("SUCCESSFUL", "FAILED", "CANCELLED"):
            changes |= {"status": status, "finished_at": now, "holder": holder}
        elif status == "RUNNING":
            changes |= {
                "status": status,
                "holder": holder,
                "token": 10_000 + i,
                "acquired_at": now,
                "expires_at": now + dt.timedelta(hours=-1 if expired else 1),
            }
        Task.objects.filter(pk=task_id).update(**changes)
        if to_move:
            moved.append(task_id)
    # The numeric task: found by its id and by its own key, worker and path; finished and moved.
    Task.objects.filter(pk=numeric).update(
        status="SUCCESSFUL", finished_at=now, holder=term, dedup_key=term, task_path=term
    )
    move(*moved, numeric)
    return numeric


def test_a_search_count_is_exact_below_the_cap_and_capped_exactly_above_it() -> None:
    numeric = overlapping_history()
    rows = both_tables()
    wrong: list[tuple[object, ...]] = []
    for term in (TERM, str(numeric)):
        for status in (None, "SUCCESSFUL", "FAILED", "CANCELLED", "READY", "RUNNING"):
            base = Task.objects.all() if status is None else Task.objects.filter(status=status)
            true = sum(1 for row in rows if matches(term, row) and status in (None, row["status"]))
            assert true or status == "CANCELLED"
            for cap in range(0, true + 3):
                got = Listing(base, ALL_STATUSES, lookups=search_lookups(term)).count(cap=cap)
                if got != Count(min(true, cap), true > cap):
                    wrong.append((term, status, cap, true, got))
    assert not wrong, wrong[:10]


@pytest.mark.parametrize("cap_delta", [-1, 0, 1])
def test_the_admin_count_of_a_search_with_filters_agrees_with_both_tables(
    staff: Client, monkeypatch: pytest.MonkeyPatch, cap_delta: int
) -> None:
    numeric = overlapping_history()
    rows = both_tables()
    now = dt.datetime.now(UTC)
    wrong: list[tuple[object, ...]] = []
    for term in (TERM, str(numeric)):
        for query, keep in [
            ({}, lambda row: True),
            ({"status__exact": "FAILED"}, lambda row: row["status"] == "FAILED"),
            ({"status__exact": "RUNNING"}, lambda row: row["status"] == "RUNNING"),
            ({"queue__exact": "alpha"}, lambda row: row["queue"] == "alpha"),
            ({"status__exact": "SUCCESSFUL", "queue__exact": "beta"},
             lambda row: row["status"] == "SUCCESSFUL" and row["queue"] == "beta"),
            ({"lease": "stuck"}, lambda row: row["status"] == "RUNNING" and row["expires_at"] <= now),
        ]:  # fmt: skip
            true = sum(1 for row in rows if matches(term, row) and keep(row))
            cap = max(true + cap_delta, 0)
            monkeypatch.setattr(listings, "COUNT_CAP", cap)
            response = staff.get("/admin/tasks/task/", {**query, "q": term})
            assert response.status_code == 200, response.content.decode()[-800:]
            cl = response.context["cl"]
            if (cl.result_count, cl.paginator.capped) != (min(true, cap), true > cap):
                wrong.append((term, query, cap, true, cl.result_count, cl.paginator.capped))
    assert not wrong, wrong


def moved_ids(status: str | None = None) -> list[int]:
    return sorted(row["id"] for row in both_tables() if row["table"] == "moved" and status in (None, row["status"]))


@pytest.mark.parametrize("status", [None, "FAILED", "SUCCESSFUL"])
def test_in_finished_serves_inside_another_query(status: str | None) -> None:
    """Plain and by status: as ``pk__in``, ``Exists``, a ``Subquery`` annotation, ordered and as values,
    and nested twice."""
    overlapping_history()
    wanted = moved_ids(status)
    assert wanted
    inner = in_finished(Task.objects.all(), status)
    got: dict[str, Any] = {
        "pk__in of tasks_finished": sorted(
            t.pk for t in archived(in_finished(Task.objects.filter(pk__in=inner.values("pk"))))
        ),
        "pk__in of tasks_task": list(Task.objects.filter(pk__in=inner.values("pk"))),
        "exists": sorted(
            t.pk for t in archived(in_finished(Task.objects.filter(Exists(inner.filter(pk=OuterRef("pk"))))))
        ),
        "subquery annotation": sorted(
            in_finished(Task.objects.all())
            .annotate(same=Subquery(inner.filter(pk=OuterRef("pk")).values("holder")[:1]))
            .filter(same__isnull=False)
            .order_by("-same", "pk")
            .values_list("pk", flat=True)
        ),
        "nested twice": sorted(
            in_finished(
                Task.objects.filter(
                    pk__in=in_finished(Task.objects.filter(pk__in=inner.values("pk")), status).values("pk")
                ),
                status,
            ).values_list("pk", flat=True)
        ),
    }
    with_holder = sorted(row["id"] for row in both_tables() if row["id"] in wanted and row["holder"] is not None)
    assert got == {
        "pk__in of tasks_finished": wanted,
        "pk__in of tasks_task": [],
        "exists": wanted,
        "subquery annotation": with_holder,
        "nested twice": wanted,
    }
