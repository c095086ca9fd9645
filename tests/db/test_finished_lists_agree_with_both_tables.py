"""Every list (the dashboard's every-task page and state pages, the JSON API's listing, the admin's
list, its count and pages) shows exactly the tasks a plain reading of ``tasks_task UNION ALL
tasks_finished`` with the same conditions finds: tasks of every final status in both tables (the
mover's rows among hot ones, ids interleaved) and live ones, every filter and search and their
combinations, walked page by page: no task missing, none twice, newest first, counts equal."""

from __future__ import annotations

import datetime as dt
import itertools
import json
from collections.abc import Callable, Iterable
from io import StringIO
from typing import Any
from urllib.parse import urlencode

import pytest
from django.core.management import call_command
from django.db import connection
from django.test import Client

from tasks.models import Task
from tests.db.test_finished_lists import MOVE_SQL, days  # noqa: F401 (days: the autouse fixture, its partitions)
from tests.db.test_finished_lists_walk import walk_dashboard
from tests.helpers.api import TOKEN, Api
from tests.helpers.task_paths import NOOP

pytestmark = pytest.mark.django_db(transaction=True)  # DDL of partitions

UTC = dt.timezone.utc
ECHO = "tests.testapp.handlers.echo"
ODD_QUEUE = "it's 100%_\\q"
QUEUES = ("alpha", "beta", ODD_QUEUE)
FINAL = ("SUCCESSFUL", "FAILED", "CANCELLED")
LABEL = {
    "SUCCESSFUL": "Successful",
    "FAILED": "Failed",
    "CANCELLED": "Cancelled",
    "READY": "Ready",
    "RUNNING": "Running",
}

BOTH_SQL = """
SELECT id, status, queue, task_path, dedup_key, holder, fair_key, enqueued_at, kwargs, expires_at,
       failures + crashes + shared_crashes, snoozed_at, 'hot' FROM tasks_task
UNION ALL
SELECT id, status, queue, task_path, dedup_key, holder, fair_key, enqueued_at, kwargs, expires_at,
       failures + crashes + shared_crashes, snoozed_at, 'moved' FROM tasks_finished
"""
COLUMNS = (
    "id", "status", "queue", "task_path", "dedup_key", "holder", "fair_key", "enqueued_at", "kwargs",
    "expires_at", "failed", "snoozed_at", "table",
)  # fmt: skip


@pytest.fixture
def api_on(settings: Any, client: Client) -> Api:
    settings.LEASING_API_TOKENS = [TOKEN]
    return Api(client)


def a_mixed_history(n: int = 150) -> None:
    """``n`` tasks: every final status in both tables (every other one moved), ready, running with a
    live lease and running with an expired one; queues, paths, dedup keys, workers, concurrency keys,
    arguments and enqueue times varied."""
    now = dt.datetime.now(UTC)
    kinds = ("SUCCESSFUL", "FAILED", "READY", "CANCELLED", "RUNNING", "SUCCESSFUL", "FAILED", "STUCK", "CANCELLED")
    moved: list[int] = []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        task_id = Task.objects.enqueue(
            ECHO if i % 4 == 0 else NOOP, queue=QUEUES[i % 3], kwargs={"customer": i % 4}, dedup_key=f"order-{i}"
        ).id
        changes: dict[str, Any] = {"enqueued_at": now - dt.timedelta(minutes=n - i)}
        if kind in FINAL:
            changes |= {
                "status": kind,
                "finished_at": now,
                "holder": None if kind == "CANCELLED" else f"w-{i % 2}",
                "dedup_key": f"shared-{i % 5}" if i % 2 else f"order-{i}",
                "fair_key": f"ck-{i % 3}",
                "failures": 1 if kind == "FAILED" else 0,
            }
        elif kind in ("RUNNING", "STUCK"):
            changes |= {
                "status": "RUNNING",
                "holder": f"w-{i % 2}",
                "token": i + 1,
                "acquired_at": now,
                "expires_at": now + dt.timedelta(hours=1 if kind == "RUNNING" else -1),
            }
        Task.objects.filter(pk=task_id).update(**changes)
        if kind in FINAL and (i // len(kinds)) % 2 == 0:
            moved.append(task_id)
    with connection.cursor() as cursor:
        cursor.execute(MOVE_SQL, [moved])
        assert len(cursor.fetchall()) == len(moved)
        cursor.execute("SELECT status, count(*) FROM tasks_finished GROUP BY status")
        assert {status for status, _ in cursor.fetchall()} == set(FINAL)


def both_tables() -> list[dict[str, Any]]:
    with connection.cursor() as cursor:
        cursor.execute(BOTH_SQL)
        return [dict(zip(COLUMNS, row, strict=True)) for row in cursor.fetchall()]


def newest_first(ids: Iterable[int]) -> list[int]:
    return sorted(ids, reverse=True)


def searched(term: str) -> Callable[[dict[str, Any]], bool]:
    """The search's exact lookups: an id, a dedup key, a worker, a task path (or the arguments)."""
    if term.startswith("kwargs:"):
        wanted = json.loads(term.removeprefix("kwargs:"))
        return lambda row: all(
            (json.loads(row["kwargs"]) if isinstance(row["kwargs"], str) else row["kwargs"]).get(k) == v
            for k, v in wanted.items()
        )
    return lambda row: (
        (term.isdigit() and row["id"] == int(term)) or term in (row["dedup_key"], row["holder"], row["task_path"])
    )


def walk_api(api: Api, query: str) -> list[int]:
    status, reply = api.call("GET", "/api/tasks?limit=7" + query)
    assert status == 200, (query, reply)
    seen = [task["id"] for task in reply["tasks"]]
    while reply["next"]:
        status, reply = api.call("GET", "/api/tasks" + reply["next"])
        assert status == 200, (query, reply)
        seen += [task["id"] for task in reply["tasks"]]
    return seen


def walk_admin(staff: Client, query: dict[str, str]) -> tuple[int, list[int]]:
    seen: list[int] = []
    count = None
    for page in range(0, 50):
        response = staff.get("/admin/tasks/task/", {**query, "p": str(page + 1)} if page else query)
        assert response.status_code == 200, (query, response.status_code, response.content.decode()[-800:])
        assert response.context is not None and "cl" in response.context, (query, response.headers.get("Location"))
        cl = response.context["cl"]
        count = cl.result_count if count is None else count
        assert cl.result_count == count
        seen += [task.pk for task in cl.result_list]
        if page + 1 >= cl.paginator.num_pages:
            return count, seen
    raise AssertionError("no end to the pages")


def test_the_every_task_page_lists_what_both_tables_hold_for_every_filter(staff: Client) -> None:
    a_mixed_history()
    rows = both_tables()
    middle = sorted(row["enqueued_at"] for row in rows)[len(rows) // 2]
    statuses: list[tuple[str, ...]] = [
        (),
        *[(s,) for s in (*FINAL, "READY", "RUNNING")],
        FINAL,
        ("SUCCESSFUL", "READY"),
    ]
    filters: list[tuple[dict[str, str], Callable[[dict[str, Any]], bool]]] = [
        ({}, lambda row: True),
        ({"queue": "alpha"}, lambda row: row["queue"] == "alpha"),
        ({"queue": ODD_QUEUE}, lambda row: row["queue"] == ODD_QUEUE),
        ({"task_path": ECHO}, lambda row: row["task_path"] == ECHO),
        ({"dedup_key": "shared-3"}, lambda row: row["dedup_key"] == "shared-3"),
        ({"fair_key": "ck-1"}, lambda row: row["fair_key"] == "ck-1"),
        ({"queue": "beta", "task_path": NOOP}, lambda row: row["queue"] == "beta" and row["task_path"] == NOOP),
        ({"queue": "beta", "fair_key": "ck-2"}, lambda row: row["queue"] == "beta" and row["fair_key"] == "ck-2"),
        ({"enqueued_after": middle.isoformat()}, lambda row: row["enqueued_at"] >= middle),
        (
            {"enqueued_before": middle.isoformat(), "queue": "alpha"},
            lambda row: row["enqueued_at"] < middle and row["queue"] == "alpha",
        ),
        ({"q": "w-1"}, searched("w-1")),
        ({"q": "shared-2"}, searched("shared-2")),
        ({"q": ECHO}, searched(ECHO)),
        ({"q": str(rows[len(rows) // 3]["id"])}, searched(str(rows[len(rows) // 3]["id"]))),
        ({"q": "w-0", "queue": "beta"}, lambda row: searched("w-0")(row) and row["queue"] == "beta"),
        (
            {"q": "shared-1", "enqueued_after": middle.isoformat()},
            lambda row: searched("shared-1")(row) and row["enqueued_at"] >= middle,
        ),
        ({"workflow": "999999"}, lambda row: False),
    ]  # fmt: skip
    wrong: list[tuple[object, ...]] = []
    for chosen, (query, keep) in itertools.product(statuses, filters):
        wanted = newest_first(row["id"] for row in rows if (not chosen or row["status"] in chosen) and keep(row))
        full = {**query, **({"status": ",".join(LABEL[s] for s in chosen)} if chosen else {})}
        got = walk_dashboard(staff, "/dashboard/tasks/", full)
        if got != wanted:
            wrong.append(
                (full, sorted(set(wanted) - set(got)), sorted(set(got) - set(wanted)), len(got) - len(set(got)))
            )
    assert not wrong, wrong[:5]


def test_the_state_pages_list_what_both_tables_hold(staff: Client) -> None:
    a_mixed_history()
    rows = both_tables()
    now = dt.datetime.now(UTC)
    states: dict[str, Callable[[dict[str, Any]], bool]] = {
        "succeeded": lambda row: row["status"] == "SUCCESSFUL",
        "failed": lambda row: row["status"] == "FAILED",
        "cancelled": lambda row: row["status"] == "CANCELLED",
        "pending": lambda row: row["status"] == "READY" and not row["failed"] and row["snoozed_at"] is None,
        "retrying": lambda row: row["status"] == "READY" and row["failed"] > 0,
        "running": lambda row: row["status"] == "RUNNING" and row["expires_at"] > now,
        "stuck": lambda row: row["status"] == "RUNNING" and row["expires_at"] <= now,
    }
    filters: list[tuple[dict[str, str], Callable[[dict[str, Any]], bool]]] = [
        ({}, lambda row: True),
        ({"queue": "alpha"}, lambda row: row["queue"] == "alpha"),
        ({"queue": ODD_QUEUE}, lambda row: row["queue"] == ODD_QUEUE),
        ({"q": "w-1"}, searched("w-1")),
        ({"q": "shared-4"}, searched("shared-4")),
        ({"q": NOOP}, searched(NOOP)),
        ({"q": "w-0", "queue": "beta"}, lambda row: searched("w-0")(row) and row["queue"] == "beta"),
    ]
    wrong: list[tuple[object, ...]] = []
    for (state, of_state), (query, keep) in itertools.product(states.items(), filters):
        wanted = newest_first(row["id"] for row in rows if of_state(row) and keep(row))
        got = walk_dashboard(staff, f"/dashboard/tasks/{state}/", query)
        if got != wanted:
            wrong.append((state, query, sorted(set(wanted) - set(got)), sorted(set(got) - set(wanted))))
    assert not wrong, wrong[:5]


def test_the_api_listing_lists_what_both_tables_hold(api_on: Api) -> None:
    a_mixed_history()
    rows = both_tables()
    wrong: list[tuple[object, ...]] = []
    for status, queue in itertools.product((None, *FINAL, "READY", "RUNNING"), (None, *QUEUES)):
        query = (f"&status={status}" if status else "") + ("&" + urlencode({"queue": queue}) if queue else "")
        wanted = newest_first(
            row["id"] for row in rows if (status is None or row["status"] == status) and queue in (None, row["queue"])
        )
        got = walk_api(api_on, query)
        if got != wanted:
            wrong.append((query, sorted(set(wanted) - set(got)), sorted(set(got) - set(wanted))))
    assert not wrong, wrong[:5]


def test_the_admin_list_counts_and_pages_what_both_tables_hold(staff: Client) -> None:
    a_mixed_history()
    rows = both_tables()
    now = dt.datetime.now(UTC)
    statuses: list[str | None] = [None, *FINAL, "READY", "RUNNING"]
    queues: list[str | None] = [None, "alpha", ODD_QUEUE]
    searches: list[str | None] = [None, "w-1", "shared-2", ECHO]
    wrong: list[tuple[object, ...]] = []
    for status, queue, term in itertools.product(statuses, queues, searches):
        query = {
            **({"status__exact": status} if status else {}),
            **({"queue__exact": queue} if queue else {}),
            **({"q": term} if term else {}),
        }
        wanted = newest_first(
            row["id"]
            for row in rows
            if (
                status in (None, row["status"])
                and queue in (None, row["queue"])
                and (term is None or searched(term)(row))
            )
        )
        count, got = walk_admin(staff, query)
        if got != wanted or count != len(wanted):
            wrong.append((query, count, len(wanted), sorted(set(wanted) - set(got)), sorted(set(got) - set(wanted))))
    for lease, keep in (("stuck", lambda row: row["expires_at"] <= now), ("live", lambda row: row["expires_at"] > now)):
        for term in (None, "w-1"):
            query = {"lease": lease, **({"q": term} if term else {})}
            wanted = newest_first(
                row["id"]
                for row in rows
                if row["status"] == "RUNNING" and keep(row) and (term is None or searched(term)(row))
            )
            count, got = walk_admin(staff, query)
            if got != wanted or count != len(wanted):
                wrong.append(
                    (query, count, len(wanted), sorted(set(wanted) - set(got)), sorted(set(got) - set(wanted)))
                )
    # the selected queue's tasks all moved: the filter still applies
    assert not wrong, wrong[:5]


def test_the_argument_search_lists_what_both_tables_hold(staff: Client, api_on: Api) -> None:
    a_mixed_history()
    rows = both_tables()
    out = StringIO()
    call_command("tasks_search_index", "create", stdout=out)
    try:
        wrong: list[tuple[object, ...]] = []
        for term in ('kwargs:{"customer": 2}', 'kwargs:{"customer": 3}'):
            for status in (None, *FINAL, "READY"):
                wanted = newest_first(
                    row["id"] for row in rows if searched(term)(row) and status in (None, row["status"])
                )
                query = {"q": term, **({"status": LABEL[status]} if status else {})}
                got = walk_dashboard(staff, "/dashboard/tasks/", query)
                if got != wanted:
                    wrong.append(("dashboard", query, sorted(set(wanted) - set(got)), sorted(set(got) - set(wanted))))
                admin_query = {"q": term, **({"status__exact": status} if status else {})}
                count, got = walk_admin(staff, admin_query)
                if got != wanted or count != len(wanted):
                    wrong.append(("admin", admin_query, count, len(wanted), sorted(set(wanted) - set(got))))
        assert not wrong, wrong[:5]
    finally:
        call_command("tasks_search_index", "drop", stdout=out)


HOSTILE = (
    "'", '"', "%", "%%", "%s", "%(x)s", "\\", "\\'", "a" * 5000, "☃ünï", "\U0001d54f", "\x00", "a\x00b", " ", "\t\n",
    "SUCCESSFUL' OR '1'='1", "SUCCESSFUL", "successful", "Successful", "SUCCESSFUL ", "-1", "0", "1e3",
    "99999999999999999999", "9223372036854775807", "9223372036854775808", "kwargs:", "kwargs:{", 'kwargs:{"a": "%s"}',
    "kwargs:[]", 'args:["\'"]', "kwargs:null", 'kwargs:{"customer": 1e400}', "2026-13-01T00:00:00", "2026-01-01",
    "\u202e", "\ufeff", "%00", "$1", "?", ":name", "::varchar", "status",
)  # fmt: skip
#: For the parameters that are not a search: a quote, a LIKE wildcard, an escape, a long value, NUL,
#: non-ASCII, numbers past bigint, a bad date, an unclosed JSON, SQL (the whole set goes to the search).
SHARP = ("'", "%", "\\", "a" * 5000, "a\x00b", "\U0001d54f", "-1", "9223372036854775808", "99999999999999999999",
         "2026-13-01T00:00:00", "kwargs:{", "SUCCESSFUL' OR '1'='1")  # fmt: skip


def test_hostile_filters_and_searches_never_fail_a_list_and_change_nothing(staff: Client, api_on: Api) -> None:
    """Every list parameter given each hostile value, beside tasks in both tables; then the searches
    again with the argument search's index (an argument search reads it)."""
    a_mixed_history(30)
    before = both_tables()
    page = staff.get
    surfaces: list[tuple[str, tuple[str, ...], Callable[[str, dict[str, str]], int]]] = [
        (
            "/dashboard/tasks/",
            ("status", "queue", "task_path", "dedup_key", "fair_key", "rate_key", "workflow", "enqueued_after",
             "enqueued_before", "q", "before"),
            lambda url, q: page(url, q).status_code,
        ),
        ("/dashboard/tasks/succeeded/", ("queue", "q", "before"), lambda url, q: page(url, q).status_code),
        ("/dashboard/tasks/stuck/", ("queue", "q", "before"), lambda url, q: page(url, q).status_code),
        ("/api/tasks", ("status", "queue", "workflow_id", "limit", "before"),
         lambda url, q: api_on.client.get(url, q, headers=api_on.headers).status_code),
        ("/admin/tasks/task/", ("q", "status__exact", "status", "status__isnull", "queue__exact", "queue", "lease",
                                "workflow_id", "p", "o"), lambda url, q: page(url, q).status_code),
    ]  # fmt: skip
    failures: list[tuple[object, ...]] = []

    def attack(url: str, name: str, get: Callable[[str, dict[str, str]], int], extra: dict[str, str]) -> None:
        for value in HOSTILE if name == "q" else SHARP:
            query = {name: value, **extra}
            try:
                code = get(url, query)
            except Exception as exc:  # a raise through the test client is a 500 in production
                failures.append((url, name, value[:30], extra, repr(exc)[:300]))
                continue
            if code >= 500:
                failures.append((url, name, value[:30], extra, code))

    for url, params, get in surfaces:
        for name in params:
            attack(url, name, get, {"q": "w-1"} if name != "q" else {})
    call_command("tasks_search_index", "create", stdout=StringIO())
    try:
        for url, params, get in surfaces:
            if "q" in params:
                attack(url, "q", get, {"status__exact": "FAILED"} if url.startswith("/admin") else {"queue": "alpha"})
    finally:
        call_command("tasks_search_index", "drop", stdout=StringIO())
    assert not failures, failures[:10]
    assert both_tables() == before


def test_a_status_partition_read_serves_as_a_subquery() -> None:
    """A status's partition read (``in_finished(queryset, status)``) may be used inside another
    query (``pk__in=…values("pk")``, ``Exists``), whose compiler relabels its tables."""
    from django.db.models import Exists, OuterRef

    from tasks.models.finished import archived, in_finished

    a_mixed_history(30)
    rows = both_tables()
    failed_moved = sorted(row["id"] for row in rows if row["status"] == "FAILED" and row["table"] == "moved")
    failed = in_finished(Task.objects.all(), "FAILED")
    inner = in_finished(Task.objects.filter(pk__in=failed.values("pk")))
    assert sorted(task.pk for task in archived(inner)) == failed_moved
    outer = in_finished(Task.objects.filter(Exists(failed.filter(pk=OuterRef("pk")))))
    assert sorted(task.pk for task in archived(outer)) == failed_moved
