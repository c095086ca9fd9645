"""The admin changelist's pages served from its count's ids: every page, with orphans, out-of-range
pages, the lease filter, ordering, searches that two lookups find, and rows changing between the
count and the page."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from django.contrib.admin.templatetags.admin_list import result_headers
from django.contrib.admin.views.main import ALL_VAR, ORDER_VAR, PAGE_VAR
from django.test import Client

from tasks.admin.tasks import TaskAdmin
from tasks.models import Task
from tests.db.test_finished_lists_walk import a_mixed_history, both_tables, days, expected, walk_admin  # noqa: F401
from tests.helpers.task_paths import NOOP

pytestmark = pytest.mark.django_db(transaction=True)
UTC = dt.timezone.utc


def listed(staff: Client, query: dict[str, str]) -> Any:
    response = staff.get("/admin/tasks/task/", query)
    return response


@pytest.mark.parametrize("orphans", [0, 2, 4])
def test_pages_with_orphans_list_every_row_once(staff: Client, monkeypatch: pytest.MonkeyPatch, orphans: int) -> None:
    monkeypatch.setattr(TaskAdmin, "list_per_page", 5)
    monkeypatch.setattr(TaskAdmin, "list_max_show_all", 500)
    a_mixed_history()
    rows = both_tables()
    original = TaskAdmin.get_paginator

    def with_orphans(self: Any, request: Any, queryset: Any, per_page: int, o: int = 0, a: bool = True) -> Any:
        return original(self, request, queryset, per_page, orphans, a)

    monkeypatch.setattr(TaskAdmin, "get_paginator", with_orphans)
    for query, match in [({}, lambda r: True), ({"status__exact": "FAILED"}, lambda r: r["status"] == "FAILED")]:
        want = expected(rows, match)
        pages, everything = walk_admin(staff, query)
        assert pages == want and everything == want, (query, orphans)


def test_out_of_range_pages_are_refused_not_500(staff: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(TaskAdmin, "list_per_page", 5)
    a_mixed_history()
    for page in ("999", "-1", "abc", "0", "1e3", ""):
        response = listed(staff, {PAGE_VAR: page})
        assert response.status_code in (200, 302), (page, response.status_code)


def test_stuck_lease_filter_pages(staff: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(TaskAdmin, "list_per_page", 2)
    now = dt.datetime.now(UTC)
    stuck = []
    for _ in range(5):
        t = Task.objects.enqueue(NOOP).id
        Task.objects.filter(pk=t).update(status="RUNNING", holder="w", token=1, expires_at=now - dt.timedelta(hours=1))
        stuck.append(t)
    live = Task.objects.enqueue(NOOP).id
    Task.objects.filter(pk=live).update(status="RUNNING", holder="w", token=1, expires_at=now + dt.timedelta(hours=1))
    pages, everything = walk_admin(staff, {"lease": "stuck"})
    assert pages == sorted(stuck, reverse=True) == everything


@pytest.mark.parametrize("order", ["1", "-1", "2", "-2", "1.2"])
def test_the_list_is_newest_first_and_offers_no_other_order(
    staff: Client, monkeypatch: pytest.MonkeyPatch, order: str
) -> None:
    """No column header offers a sort (the pages are read newest first from the indexes); an order
    asked in the URL is ignored or sent back to the plain list."""
    monkeypatch.setattr(TaskAdmin, "list_per_page", 5)
    for i in range(7):
        Task.objects.enqueue(NOOP if i % 2 else "tests.helpers.task_paths.echo")
    response = staff.get("/admin/tasks/task/", {ORDER_VAR: order}, follow=True)
    assert response.status_code == 200
    assert not [header for header in result_headers(response.context["cl"]) if header["sortable"]]
    shown = [t.pk for t in response.context["cl"].result_list]
    every = staff.get("/admin/tasks/task/", {ORDER_VAR: order, ALL_VAR: ""}, follow=True)
    everything = [t.pk for t in every.context["cl"].result_list]
    want = list(Task.objects.order_by("-pk").values_list("pk", flat=True))
    assert shown == want[:5] and everything in (want, want[:5])  # "show all", or sent back to page 1


def test_select_all_requeue_requeues_every_counted_task(staff: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """ "Select all N" (a count within the cap, both tables): the requeue takes all N, not only the
    ticked page's moved ones."""
    from tests.db.test_finished_lists import ended, move

    monkeypatch.setattr(TaskAdmin, "list_per_page", 5)
    failed = [ended("FAILED") for _ in range(12)]
    move(*failed[:8])
    page = listed(staff, {"status__exact": "FAILED"})
    cl = page.context["cl"]
    assert cl.result_count == 12
    ticked = [str(t.pk) for t in cl.result_list]
    response = staff.post(
        "/admin/tasks/task/?status__exact=FAILED",
        {"action": "requeue", "select_across": "1", "index": "0", "_selected_action": ticked},
        follow=True,
    )
    statuses = sorted(Task.objects.filter(pk__in=failed).values_list("status", flat=True))
    assert statuses == ["READY"] * 12, (statuses, [m.message for m in response.context["messages"]])


def test_select_all_past_the_cap_is_refused_and_changes_nothing(staff: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """More tasks than the count enumerates (the cap, patched down to 10): "select all" requeue and
    delete are refused, naming the background actions; no task changes, none is restored."""
    from tasks.web import listings
    from tests.db.test_finished_lists import ended, move, where

    monkeypatch.setattr(listings, "COUNT_CAP", 10)
    monkeypatch.setattr(TaskAdmin, "list_per_page", 5)
    failed = [ended("FAILED") for _ in range(12)]
    move(*failed[:8])
    ticked = [str(pk) for pk in sorted(failed, reverse=True)[:5]]
    for action in ("requeue", "delete_selected"):
        response = staff.post(
            "/admin/tasks/task/?status__exact=FAILED",
            {"action": action, "select_across": "1", "index": "0", "_selected_action": ticked},
            follow=True,
        )
        said = [str(m.message) for m in response.context["messages"]]
        assert any("more than 10 tasks selected" in m and "ALL matching" in m for m in said), (action, said)
    assert sorted(Task.objects.filter(pk__in=failed).values_list("status", flat=True)) == ["FAILED"] * 4
    assert [where(pk) for pk in failed[:8]] == ["tasks_finished"] * 8


def test_rows_changing_between_the_count_and_the_page_give_no_duplicate_nor_a_stranger() -> None:
    import psycopg
    from django.db import connection

    from tasks.web.listings import ALL_STATUSES, Listing, ListingPaginator
    from tests.db.test_finished_lists import ended, move

    ids = [ended("FAILED") for _ in range(12)]
    move(*ids[:6])
    paginator = ListingPaginator(Listing(Task.objects.filter(status="FAILED"), ALL_STATUSES), 5)
    assert paginator.count == 12
    other = psycopg.connect(**connection.get_connection_params(), autocommit=True)
    try:
        other.execute("DELETE FROM tasks_task WHERE id = %s", [ids[9]])  # page 1, hot
        other.execute("DELETE FROM tasks_finished WHERE id = %s", [ids[4]])  # page 2, moved
        other.execute("UPDATE tasks_task SET status = 'SUCCESSFUL' WHERE id = %s", [ids[6]])  # page 2
    finally:
        other.close()
    seen = [t.pk for n in (1, 2, 3) for t in paginator.page(n).object_list]
    assert len(seen) == len(set(seen))
    assert set(seen) <= set(ids) - {ids[9], ids[4], ids[6]}
    assert all(t.status == "FAILED" for n in (1, 2, 3) for t in paginator.page(n).object_list)
