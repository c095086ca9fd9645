"""The page queries (tasks/web/queries.py, tasks/web/listings.py) list exactly what the plain ORM
filter would, newest first, page after page: across statuses, lookups (a queue, a search), scan
windows that end short, and the admin's capped count and offset pages."""

from __future__ import annotations

import datetime as dt
import random
from typing import Any

import pytest
from django.db.models import Q, QuerySet
from django.utils import timezone

from tasks.models import FAILED_BEFORE, NEVER_FAILED, Task, TaskStatus
from tasks.web import queries
from tasks.web.listings import ALL_STATUSES, Listing, ListingPaginator, state_listing
from tasks.web.queries import Count, search_lookups

pytestmark = pytest.mark.django_db

QUEUES = ["default", "default", "default", "mail", "rare"]
PATHS = ["app.a", "app.a", "app.b", "app.c"]
HOLDERS = [None, "w-1", "w-2", "app.b"]  # a holder named like a task path: one row, two lookups


@pytest.fixture
def tasks() -> list[Task]:
    rng = random.Random(11)
    now = timezone.now()
    rows = []
    for n in range(400):
        status = rng.choice(TaskStatus.values)
        rows.append(
            Task(
                task_path=rng.choice(PATHS),
                queue=rng.choice(QUEUES),
                status=status,
                holder=rng.choice(HOLDERS),
                dedup_key=f"key-{n % 50}" if n % 3 == 0 else None,
                failures=rng.choice([0, 0, 1]),
                expires_at=now + dt.timedelta(seconds=rng.choice([-5, 30])) if status == "RUNNING" else None,
                finished_at=now if status in ("SUCCESSFUL", "FAILED", "CANCELLED") else None,
            )
        )
    # Unique among unfinished tasks: keep one unfinished row per dedup key.
    seen: set[str] = set()
    for row in rows:
        if row.dedup_key and row.status in ("BLOCKED", "READY", "RUNNING"):
            if row.dedup_key in seen:
                row.dedup_key = None
            seen.add(row.dedup_key or "")
    return Task.objects.bulk_create(rows)


def every_page(listing: Listing, limit: int, window: int | None = None) -> tuple[list[int], int]:
    """Concatenate every page's ids; returns them and how many pages ended at a scan window."""
    ids: list[int] = []
    before = None
    short = 0
    for _ in range(1000):
        page = listing.page(limit=limit, before=before, window=window)
        assert len(page.tasks) <= limit
        ids += [task.pk for task in page.tasks]
        short += page.scanned_to is not None
        if page.next_before is None:
            return ids, short
        assert before is None or page.next_before < before  # always moves on
        before = page.next_before
    raise AssertionError("the pages never ended")


def expected(queryset: QuerySet[Task]) -> list[int]:
    return list(queryset.order_by("-pk").values_list("pk", flat=True))


@pytest.mark.parametrize("limit", [1, 7, 50])
@pytest.mark.parametrize(
    ("statuses", "lookups"),
    [
        (ALL_STATUSES, None),
        (ALL_STATUSES, [Q(queue="mail")]),
        (("FAILED",), [Q(queue="rare")]),
        (ALL_STATUSES, search_lookups("app.b")),
        (("READY", "RUNNING"), search_lookups("key-3")),
        (ALL_STATUSES, search_lookups("w-1")),
    ],
)
def test_pages_list_exactly_what_the_filter_selects(
    tasks: list[Task], statuses: tuple[str, ...], lookups: list[Q] | None, limit: int
) -> None:
    listing = Listing(Task.objects.all(), statuses, lookups=lookups)
    naive = Task.objects.filter(status__in=statuses)
    if lookups:
        naive = naive.filter(queries.any_of(lookups))
    ids, short = every_page(listing, limit)
    assert ids == expected(naive)
    assert short == 0  # no residual: every page is full until the last


@pytest.mark.parametrize("window", [3, 10, 2000])
@pytest.mark.parametrize(
    ("state", "queue", "search"),
    [
        ("pending", None, ""),
        ("retrying", "mail", ""),
        ("retrying", None, "app.a"),
        ("succeeded", "default", "w-2"),
        ("stuck", "rare", ""),
        ("running", None, "app.b"),
    ],
)
def test_windows_end_pages_short_but_the_pages_still_list_everything(
    tasks: list[Task], state: str, queue: str | None, search: str, window: int
) -> None:
    listing = state_listing(state, queue=queue, search=search)
    naive = queries.STATES[state].queryset()
    if queue:
        naive = naive.filter(queue=queue)
    if search:
        naive = naive.filter(queries.any_of(search_lookups(search)))
    ids, _ = every_page(listing, 5, window=window)
    assert ids == expected(naive)


def test_a_short_page_says_how_far_it_looked(tasks: list[Task]) -> None:
    # Newest first: 30 waiting tasks that failed before, above 3 that never did.
    Task.objects.all().delete()
    pending = Task.objects.bulk_create(Task(task_path="app.a", queue="mail") for _ in range(3))
    retrying = Task.objects.bulk_create(Task(task_path="app.a", queue="mail", failures=1) for _ in range(30))
    listing = state_listing("pending", queue="mail")
    first = listing.page(limit=5, window=10)
    assert first.tasks == []
    assert first.scanned_to == retrying[-11].pk + 1  # ten rows checked, none pending; more below
    assert first.next_before == first.scanned_to
    ids, short = every_page(listing, 5, window=10)
    assert ids == sorted((task.pk for task in pending), reverse=True)
    assert short == 3


def test_admin_paginator_counts_up_to_the_cap_and_pages_by_offset(tasks: list[Task]) -> None:
    listing = Listing(Task.objects.all(), lookups=search_lookups("app.b"))
    naive = expected(Task.objects.filter(queries.any_of(search_lookups("app.b"))))
    assert listing.count() == Count(len(naive), capped=False)
    assert listing.count(cap=10) == Count(10, capped=True)
    # Each lookup alone within the cap, together past it (or exactly at it: a row of both counts once).
    by_path, by_holder = Task.objects.filter(task_path="app.b").count(), Task.objects.filter(holder="app.b").count()
    both = Task.objects.filter(task_path="app.b", holder="app.b").count()
    assert both and by_path + by_holder - both == len(naive) > max(by_path, by_holder)
    assert listing.count(cap=max(by_path, by_holder)) == Count(max(by_path, by_holder), capped=True)
    assert listing.count(cap=len(naive)) == Count(len(naive), capped=False)
    assert listing.count(cap=len(naive) - 1) == Count(len(naive) - 1, capped=True)
    # Capped, the count kept no ids: the pages read their own; within the cap, it kept them all.
    assert listing.counted is None and listing.ids(5, 9) == naive[5:14]
    assert listing.count() == Count(len(naive), capped=False) and listing.counted == naive
    assert listing.ids(5, 9) == naive[5:14] and listing.ids(len(naive) - 2, 9) == naive[-2:]
    paginator = ListingPaginator(listing, 13)
    pages = [[task.pk for task in paginator.page(n).object_list] for n in paginator.page_range]
    assert [pk for page in pages for pk in page] == naive
    assert paginator.capped is False


def test_search_is_exact_on_indexed_columns(tasks: list[Task]) -> None:
    one = tasks[0]

    def fields(term: str) -> list[Any]:
        return [child for q in search_lookups(term) for child in q.children]

    assert fields(f" {one.pk} ") == [
        ("pk", one.pk),
        *[(name, str(one.pk)) for name in ("dedup_key", "holder", "task_path")],
    ]
    assert "pk" not in {name for name, _ in fields("²")}  # not an ASCII digit: no id lookup
    assert "pk" not in {name for name, _ in fields("9" * 20)}  # beyond bigint
    assert search_lookups("bad\x00term") == []
    assert search_lookups("   ") == []
    listing = Listing(Task.objects.all(), lookups=search_lookups("app"))  # a prefix of every path
    assert listing.page(limit=10).tasks == []


def test_state_queries_match_their_definitions(tasks: list[Task]) -> None:
    assert set(queries.STATES["pending"].queryset()) == set(Task.objects.filter(NEVER_FAILED, status="READY"))
    assert set(queries.STATES["retrying"].queryset()) == set(Task.objects.filter(FAILED_BEFORE, status="READY"))
    counts = queries.state_counts()
    for name, state in queries.STATES.items():
        assert counts[name] == Count(state.queryset().count(), capped=False), name
    small: dict[str, Any] = queries.state_counts(cap=3)
    assert all(count.value <= 3 for count in small.values())


def test_queue_names_and_stats_come_from_index_jumps(tasks: list[Task]) -> None:
    assert queries.queue_names() == sorted(set(QUEUES))
    assert queries.queue_names(limit=2) == ["default", "mail"]
    Task.objects.filter(status="READY", queue="mail").update(run_after=timezone.now() + dt.timedelta(hours=1))
    stats = {row["queue"]: row for row in queries.queue_stats()}
    assert "mail" not in stats  # nothing runnable there now
    runnable = Task.objects.runnable()
    for name in ("default", "rare"):
        assert stats[name]["depth"] == Count(runnable.filter(queue=name).count(), capped=False)
    capped = {row["queue"]: row["depth"] for row in queries.queue_stats(cap=2)}
    assert capped["default"] == Count(2, capped=True)


def test_a_queue_name_with_nul_finds_nothing_instead_of_failing(tasks: list[Task]) -> None:
    assert state_listing("succeeded", queue="mail\x00").page(limit=5).tasks == []
    assert state_listing("succeeded", queue="mail\x00", search="app.a").page(limit=5).tasks == []


def test_queue_stats_find_the_oldest_waiting_task_across_priorities() -> None:
    import datetime as dt

    from django.utils import timezone

    from tasks.models import Task
    from tasks.web.queries import queue_stats

    now = timezone.now()
    for priority, minutes in ((5, 3), (0, 50), (-3, 7), (9, 1)):
        Task.objects.enqueue(
            "tests.testapp.handlers.noop",
            queue="mail",
            priority=priority,
            run_after=now - dt.timedelta(minutes=minutes),
        )
    Task.objects.enqueue("tests.testapp.handlers.noop", queue="mail", run_after=now + dt.timedelta(hours=1))
    Task.objects.enqueue(
        "tests.testapp.handlers.noop", queue="bulk", priority=2, run_after=now - dt.timedelta(minutes=2)
    )
    stats = {s["queue"]: s for s in queue_stats(cap=3)}
    assert set(stats) == {"mail", "bulk"}
    assert 50 * 60 - 5 <= stats["mail"]["oldest_age"] <= 50 * 60 + 60
    assert (stats["mail"]["depth"].value, stats["mail"]["depth"].capped) == (3, True)  # 4 due, capped at 3
    assert 2 * 60 - 5 <= stats["bulk"]["oldest_age"] <= 2 * 60 + 60
    assert (stats["bulk"]["depth"].value, stats["bulk"]["depth"].capped) == (1, False)


def test_a_task_that_moves_between_the_two_reads_of_a_page_is_left_out() -> None:
    """A page reads its ids, then its rows: a task claimed in between is not shown on the Ready page
    (where it would be a Running row under the Ready tab's Run now button)."""
    waiting = Task.objects.enqueue("tests.testapp.handlers.noop")
    listing = state_listing("pending")
    assert [task.pk for task in listing.page(limit=10).tasks] == [waiting.id]
    (claimed,) = Task.objects.claim("w-moved", limit=1)
    assert claimed.id == waiting.id
    assert listing.rows([waiting.id]) == []
    assert [task.pk for task in state_listing("running").rows([waiting.id])] == [waiting.id]
