"""Every listing pages through both tables to its end (issue 43): with tasks the mover took to
tasks_finished among those still in tasks_task (three days of them, every finished status, a
workflow whose members stay), each way of listing tasks, followed page by page to its last page,
lists exactly the matching tasks of both tables, each once, newest first, and never answers 500:
the dashboard's every-task page with each filter and the search, its state pages with a queue and a
search, the JSON API's listings with status, queue, workflow_id and before, and the admin's
changelist with its status, queue and workflow filters, its search, page N and "show all".

Pages are a few rows long here (the page sizes patched down) so that every walk crosses the two
tables several times."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.contrib.admin.views.main import ALL_VAR, PAGE_VAR
from django.db import connection
from django.test import Client

from tasks.admin.tasks import TaskAdmin
from tasks.lifecycle import vocabulary
from tasks.maintenance.partitions import create_ahead, create_day
from tasks.models import Task
from tests.db.test_finished_lists import ECHO, move
from tests.db.test_finished_partitions import drop_partitions
from tests.helpers.api import TOKEN, Api
from tests.helpers.task_paths import NOOP

pytestmark = pytest.mark.django_db(transaction=True)  # DDL of partitions

UTC = dt.timezone.utc
FINISHED = ("SUCCESSFUL", "FAILED", "CANCELLED")
COLUMNS = "id, status, queue, task_path, dedup_key, holder, workflow_id, enqueued_at"


@pytest.fixture(autouse=True)
def days() -> Iterator[None]:
    drop_partitions()
    create_ahead(1)
    today = dt.datetime.now(UTC).date()
    for status in FINISHED:
        for back in (1, 2):
            create_day(status, today - dt.timedelta(days=back))
    yield
    drop_partitions()


@pytest.fixture
def small_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tasks.web.dashboard.PAGE_SIZE", 4)
    monkeypatch.setattr(TaskAdmin, "list_per_page", 5)


@pytest.fixture
def api_on(settings: Any, client: Client) -> Api:
    settings.LEASING_API_TOKENS = [TOKEN]
    return Api(client)


def a_mixed_history() -> dict[str, Any]:
    """64 tasks: every finished status over three days, most of the finished ones moved, waiting and
    running ones between them, and a workflow (its finished parent stays in tasks_task)."""
    now = dt.datetime.now(UTC)
    moved: list[int] = []
    kinds = ("SUCCESSFUL", "FAILED", "CANCELLED", "SUCCESSFUL", "FAILED", "CANCELLED", "READY", "RUNNING")
    for i in range(64):
        queue = ("mail", "web", "default")[i % 3]
        path = ECHO if i % 5 == 0 else NOOP
        status = kinds[i % 8]
        holder = f"w-{(i // 3) % 2}"
        task_id = Task.objects.enqueue(path, queue=queue, dedup_key=f"key-{i % 5}" if i % 2 else None).id
        if status == "READY":
            continue
        if status == "RUNNING":
            Task.objects.filter(pk=task_id).update(
                status=status, holder=holder, token=1, expires_at=now + dt.timedelta(hours=1)
            )
            continue
        Task.objects.filter(pk=task_id).update(
            status=status,
            finished_at=now - dt.timedelta(days=(i // 4) % 3, minutes=1),
            holder=holder if status != "CANCELLED" else None,
        )
        if i % 7 != 0:
            moved.append(task_id)
    move(*moved)
    parent = Task.objects.enqueue(NOOP, queue="mail")
    child = Task.objects.enqueue(NOOP, queue="web", depends_on=[parent.id])
    Task.objects.filter(pk=parent.id).update(status="SUCCESSFUL", finished_at=now, holder="w-0")
    workflow = Task.objects.get(pk=child.id).workflow_id
    assert workflow is not None
    return {"moved": moved, "workflow": workflow, "parent": parent.id, "child": child.id}


def both_tables() -> list[dict[str, Any]]:
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {COLUMNS}, false FROM tasks_task UNION ALL SELECT {COLUMNS}, true FROM tasks_finished")
        names = [*COLUMNS.split(", "), "archived"]
        rows = [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]
    ids = [row["id"] for row in rows]
    assert len(ids) == len(set(ids)), "a task in both tables"
    return rows


def matching(**wanted: Any) -> Callable[[dict[str, Any]], bool]:
    """Rows whose columns hold ``wanted`` (a tuple: any of its values)."""

    def match(row: dict[str, Any]) -> bool:
        return all(row[k] in v if isinstance(v, tuple) else row[k] == v for k, v in wanted.items())

    return match


def expected(rows: list[dict[str, Any]], match: Callable[[dict[str, Any]], bool]) -> list[int]:
    found = sorted((row["id"] for row in rows if match(row)), reverse=True)
    assert found, "a walk over nothing proves nothing"
    return found


def walk_dashboard(staff: Client, url: str, query: dict[str, str]) -> list[int]:
    """Every page of a dashboard listing, following its "older" link (``before``) to the end."""
    seen: list[int] = []
    before: int | None = None
    for _ in range(200):
        response = staff.get(url, {**query, **({"before": str(before)} if before else {})})
        assert response.status_code == 200, (url, query, response.content.decode()[-800:])
        seen += [task.pk for task in response.context["tasks"]]
        before = response.context["next_before"]
        if before is None:
            return seen
    raise AssertionError(f"{url} {query}: no last page")


def walk_api(api: Api, url: str) -> list[int]:
    seen: list[int] = []
    status, reply = api.call("GET", url)
    for _ in range(200):
        assert status == 200, (url, reply)
        seen += [task["id"] for task in reply["tasks"]]
        if not reply["next"]:
            return seen
        status, reply = api.call("GET", url.split("?")[0] + reply["next"])
    raise AssertionError(f"{url}: no last page")


def walk_admin(staff: Client, query: dict[str, str]) -> tuple[list[int], list[int]]:
    """The admin changelist's pages 1..N, and its "show all" page."""
    first = staff.get("/admin/tasks/task/", query)
    assert first.status_code == 200, (query, first.content.decode()[-800:])
    pages = first.context["cl"].paginator.num_pages
    seen = [task.pk for task in first.context["cl"].result_list]
    for number in range(2, pages + 1):
        response = staff.get("/admin/tasks/task/", {**query, PAGE_VAR: str(number)})
        assert response.status_code == 200, (query, number, response.content.decode()[-800:])
        seen += [task.pk for task in response.context["cl"].result_list]
    everything = staff.get("/admin/tasks/task/", {**query, ALL_VAR: ""})
    assert everything.status_code == 200, (query, everything.content.decode()[-800:])
    return seen, [task.pk for task in everything.context["cl"].result_list]


@pytest.mark.usefixtures("small_pages")
def test_the_dashboard_pages_list_both_tables_to_the_end(staff: Client) -> None:
    made = a_mixed_history()
    rows = both_tables()
    assert sum(row["archived"] for row in rows) == len(made["moved"]) > 20
    some_moved = next(row for row in rows if row["archived"] and row["dedup_key"])
    after = min(row["enqueued_at"] for row in rows if row["archived"]) + dt.timedelta(microseconds=1)
    checks: list[tuple[str, dict[str, str], Callable[[dict[str, Any]], bool]]] = [
        ("/dashboard/tasks/", {}, lambda r: True),
        ("/dashboard/tasks/", {"queue": "mail"}, lambda r: r["queue"] == "mail"),
        ("/dashboard/tasks/", {"task_path": ECHO}, lambda r: r["task_path"] == ECHO),
        ("/dashboard/tasks/", {"dedup_key": "key-3"}, lambda r: r["dedup_key"] == "key-3"),
        ("/dashboard/tasks/", {"workflow": str(made["workflow"])}, lambda r: r["workflow_id"] == made["workflow"]),
        ("/dashboard/tasks/", {"enqueued_after": after.isoformat()}, lambda r: r["enqueued_at"] >= after),
        ("/dashboard/tasks/", {"enqueued_before": after.isoformat()}, lambda r: r["enqueued_at"] < after),
        ("/dashboard/tasks/", {"q": "w-1"}, lambda r: r["holder"] == "w-1"),
        ("/dashboard/tasks/", {"q": NOOP}, lambda r: r["task_path"] == NOOP),
        ("/dashboard/tasks/", {"q": "key-1"}, lambda r: r["dedup_key"] == "key-1"),
        ("/dashboard/tasks/", {"q": str(some_moved["id"])}, lambda r: r["id"] == some_moved["id"]),
        ("/dashboard/tasks/", {"q": "w-0", "queue": "web"}, lambda r: r["holder"] == "w-0" and r["queue"] == "web"),
        (
            "/dashboard/tasks/",
            {"queue": "mail", "task_path": NOOP, "dedup_key": "key-1"},
            lambda r: (r["queue"], r["task_path"], r["dedup_key"]) == ("mail", NOOP, "key-1"),
        ),
    ]
    for status in ("SUCCESSFUL", "FAILED", "CANCELLED", "READY", "RUNNING"):
        label = vocabulary.label(status)
        checks.append(("/dashboard/tasks/", {"status": label}, matching(status=status)))
        checks.append(
            (
                "/dashboard/tasks/",
                {"status": f"{label},Cancelled", "queue": "web"},
                matching(status=(status, "CANCELLED"), queue="web"),
            )
        )
    for state, status in (("succeeded", "SUCCESSFUL"), ("failed", "FAILED"), ("cancelled", "CANCELLED")):
        checks += [
            (f"/dashboard/tasks/{state}/", {}, matching(status=status)),
            (
                f"/dashboard/tasks/{state}/",
                {"queue": "default"},
                matching(status=status, queue="default"),
            ),
            (f"/dashboard/tasks/{state}/", {"q": ECHO}, matching(status=status, task_path=ECHO)),
            (
                f"/dashboard/tasks/{state}/",
                {"q": "key-3", "queue": "mail"},
                matching(status=status, dedup_key="key-3", queue="mail"),
            ),
        ]
    for url, query, match in checks:
        want = expected(rows, match) if any(match(r) for r in rows) else []
        got = walk_dashboard(staff, url, query)
        assert len(got) == len(set(got)), (url, query, "listed twice")
        assert got == want, (url, query)


@pytest.mark.usefixtures("small_pages")
def test_the_api_listings_page_through_both_tables_to_the_end(api_on: Api) -> None:
    made = a_mixed_history()
    rows = both_tables()
    checks: list[tuple[str, Callable[[dict[str, Any]], bool]]] = [
        ("/api/tasks?limit=3", lambda r: True),
        ("/api/tasks?limit=3&queue=web", lambda r: r["queue"] == "web"),
        (f"/api/tasks?limit=3&workflow_id={made['workflow']}", lambda r: r["workflow_id"] == made["workflow"]),
        ("/api/tasks/processed?limit=3", lambda r: r["status"] in FINISHED),
        ("/api/tasks/processed?limit=2&queue=mail", lambda r: r["status"] in FINISHED and r["queue"] == "mail"),
        (
            f"/api/tasks/processed?limit=3&workflow_id={made['workflow']}",
            lambda r: r["status"] in FINISHED and r["workflow_id"] == made["workflow"],
        ),
    ]
    for status in (*FINISHED, "READY"):
        checks.append((f"/api/tasks?limit=3&status={status}", matching(status=status)))
        checks.append(
            (
                f"/api/tasks?limit=2&status={status}&queue=default",
                matching(status=status, queue="default"),
            )
        )
    middle = sorted(row["id"] for row in rows)[len(rows) // 2]
    checks.append((f"/api/tasks?limit=3&before={middle}", lambda r: r["id"] < middle))
    for url, match in checks:
        got = walk_api(api_on, url)
        assert len(got) == len(set(got)), (url, "listed twice")
        assert got == expected(rows, match), url
    _, reply = api_on.call("GET", "/api/tasks?limit=500")
    archived = {task["id"] for task in reply["tasks"] if task["archived"]}
    assert archived == set(made["moved"])


@pytest.mark.usefixtures("small_pages")
def test_the_admin_changelist_pages_through_both_tables(staff: Client) -> None:
    made = a_mixed_history()
    rows = both_tables()
    checks: list[tuple[dict[str, str], Callable[[dict[str, Any]], bool]]] = [
        ({}, lambda r: True),
        ({"queue__exact": "mail"}, lambda r: r["queue"] == "mail"),
        ({"workflow_id": str(made["workflow"])}, lambda r: r["workflow_id"] == made["workflow"]),
        ({"q": "w-1"}, lambda r: r["holder"] == "w-1"),
        ({"q": ECHO}, lambda r: r["task_path"] == ECHO),
        ({"q": "key-2"}, lambda r: r["dedup_key"] == "key-2"),
        ({"q": str(made["moved"][3])}, lambda r: r["id"] == made["moved"][3]),
        ({"q": "w-0", "status__exact": "FAILED"}, lambda r: r["holder"] == "w-0" and r["status"] == "FAILED"),
        (
            {"queue__exact": "web", "status__exact": "SUCCESSFUL"},
            lambda r: (r["queue"], r["status"]) == ("web", "SUCCESSFUL"),
        ),
    ]
    for status in (*FINISHED, "READY", "RUNNING"):
        checks.append(({"status__exact": status}, matching(status=status)))
    for query, match in checks:
        want = expected(rows, match)
        pages, everything = walk_admin(staff, query)
        assert pages == want, query
        assert everything == want, query
        response = staff.get("/admin/tasks/task/", query)
        assert response.context["cl"].result_count == len(want), query
    for task_id in made["moved"][:3]:
        page = staff.get(f"/admin/tasks/task/{task_id}/change/")
        assert page.status_code == 200
