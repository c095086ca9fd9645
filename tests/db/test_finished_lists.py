"""The lists read finished tasks from both tables (issue 43): a task the mover took to tasks_finished
is still on the dashboard's every-task page and its state page (Succeeded, Failed, Cancelled), in the
JSON API's listing and in the state counts, newest first among the tasks still in tasks_task, paged
across both, found by the filters and the search (its id, dedup key, worker, task path), marked as
history (``archived`` in the JSON, the admin's read-only page, where it may be deleted); run again
from the dashboard, the API or the admin's requeue it comes back to tasks_task first, in the
requeue's transaction (refused: it stays); any other action on it is refused and names it. Each page reads
about a page of tasks_finished's index entries per day kept, whatever the days hold (migration 0036's
indexes; no sequential scan of a day)."""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection, transaction
from django.test import Client

from leasing.pagination import COUNT_CAP
from tasks.maintenance.partitions import create_ahead, create_day
from tasks.models import Task
from tasks.web.listings import SCAN_WINDOW, Listing, state_listing
from tasks.web.queries import state_counts
from tests.db.test_finished_partitions import drop_partitions
from tests.helpers import wait_until
from tests.helpers.api import Api
from tests.helpers.connections import OnItsOwnConnection, waits_for_a_lock
from tests.helpers.plans import explained, recorded
from tests.helpers.task_paths import NOOP

pytestmark = pytest.mark.django_db(transaction=True)  # DDL of partitions

UTC = dt.timezone.utc
ECHO = "tests.testapp.handlers.echo"

MOVE_SQL = """
WITH moved AS (DELETE FROM tasks_task WHERE id = ANY(%s) AND status IN ('SUCCESSFUL', 'FAILED', 'CANCELLED')
               RETURNING *)
INSERT INTO tasks_finished SELECT * FROM moved RETURNING id
"""


@pytest.fixture(autouse=True)
def days() -> Iterator[None]:
    """Today's and tomorrow's partitions, and the two days before (UTC): a task made to have
    finished hours ago finished yesterday in the first hours of a day."""
    drop_partitions()
    create_ahead(2, now=dt.datetime.now(UTC) - dt.timedelta(days=2))
    create_ahead(1)
    yield
    drop_partitions()


@pytest.fixture
def api_on(settings: Any) -> Api:
    from tests.helpers.api import TOKEN

    settings.LEASING_API_TOKENS = [TOKEN]
    return Api(Client())


def move(*ids: int) -> None:
    with connection.cursor() as cursor:
        cursor.execute(MOVE_SQL, [list(ids)])
        assert sorted(r[0] for r in cursor.fetchall()) == sorted(ids)


def ended(status: str, *, path: str = NOOP, at: dt.datetime | None = None, **enqueue: Any) -> int:
    task_id = Task.objects.enqueue(path, **enqueue).id
    Task.objects.filter(pk=task_id).update(
        status=status, finished_at=at or dt.datetime.now(UTC), holder="w-7" if status != "CANCELLED" else None
    )
    return task_id


def a_history() -> dict[str, int]:
    """Tasks in both tables, ids interleaved: moved ones among hot ones of the same status."""
    ids = {
        "ok-old": ended("SUCCESSFUL", queue="mail", dedup_key="order-1"),
        "ok-hot": ended("SUCCESSFUL"),
        "failed": ended("FAILED", path=ECHO),
        "ready": Task.objects.enqueue(NOOP).id,
        "ok-new": ended("SUCCESSFUL", queue="mail"),
        "cancelled": ended("CANCELLED"),
        "failed-hot": ended("FAILED"),
    }
    move(ids["ok-old"], ids["failed"], ids["ok-new"], ids["cancelled"])
    return ids


def shown(staff: Client, url: str, query: dict[str, str] | None = None) -> list[int]:
    response = staff.get(url, query or {})
    assert response.status_code == 200, response.content.decode()[-600:]
    return [task.pk for task in response.context["tasks"]]


def test_the_every_task_page_and_the_state_pages_list_moved_tasks_among_the_others(staff: Client) -> None:
    ids = a_history()
    every = shown(staff, "/dashboard/tasks/")
    assert every == sorted(ids.values(), reverse=True)
    assert shown(staff, "/dashboard/tasks/", {"status": "Successful"}) == [ids["ok-new"], ids["ok-hot"], ids["ok-old"]]
    assert shown(staff, "/dashboard/tasks/succeeded/") == [ids["ok-new"], ids["ok-hot"], ids["ok-old"]]
    assert shown(staff, "/dashboard/tasks/failed/") == [ids["failed-hot"], ids["failed"]]
    assert shown(staff, "/dashboard/tasks/cancelled/") == [ids["cancelled"]]
    # each filter a tasks_finished index serves, and one checked within the window (the time range)
    assert shown(staff, "/dashboard/tasks/", {"queue": "mail"}) == [ids["ok-new"], ids["ok-old"]]
    assert shown(staff, "/dashboard/tasks/", {"task_path": ECHO}) == [ids["failed"]]
    assert shown(staff, "/dashboard/tasks/", {"dedup_key": "order-1"}) == [ids["ok-old"]]
    assert shown(staff, "/dashboard/tasks/succeeded/", {"queue": "mail"}) == [ids["ok-new"], ids["ok-old"]]
    after = Task.objects.find(ids["ok-new"]).enqueued_at.isoformat()
    assert shown(staff, "/dashboard/tasks/", {"enqueued_after": after, "status": "Successful"}) == [ids["ok-new"]]
    # the search: an id, a dedup key, a worker, a task path
    assert shown(staff, "/dashboard/tasks/", {"q": str(ids["cancelled"])}) == [ids["cancelled"]]
    assert shown(staff, "/dashboard/tasks/", {"q": "order-1"}) == [ids["ok-old"]]
    assert shown(staff, "/dashboard/tasks/failed/", {"q": "w-7"}) == [ids["failed-hot"], ids["failed"]]
    assert shown(staff, "/dashboard/tasks/", {"q": ECHO}) == [ids["failed"]]
    # selectable as the others: its action (run again) brings it back first
    body = staff.get("/dashboard/tasks/succeeded/").content.decode()
    assert f'name="ids" value="{ids["ok-hot"]}"' in body and f'name="ids" value="{ids["ok-new"]}"' in body


def test_pages_go_on_across_both_tables(staff: Client, api_on: Api) -> None:
    ids = a_history()
    newest_first = sorted(ids.values(), reverse=True)
    listing = Listing(Task.objects.all(), ("SUCCESSFUL", "FAILED", "CANCELLED", "READY"))
    seen: list[int] = []
    before = None
    while True:
        page = listing.page(limit=2, before=before)
        seen += [task.pk for task in page.tasks]
        if page.next_before is None:
            break
        before = page.next_before
    assert seen == newest_first
    status, reply = api_on.call("GET", "/api/tasks?limit=2")
    got = [task["id"] for task in reply["tasks"]]
    while reply["next"]:
        status, reply = api_on.call("GET", "/api/tasks" + reply["next"])
        assert status == 200
        got += [task["id"] for task in reply["tasks"]]
    assert got == newest_first
    status, reply = api_on.call("GET", "/api/tasks?status=SUCCESSFUL&queue=mail")
    assert [(t["id"], t["archived"]) for t in reply["tasks"]] == [(ids["ok-new"], True), (ids["ok-old"], True)]
    status, reply = api_on.call("GET", "/api/tasks?status=FAILED")
    assert [(t["id"], t["archived"]) for t in reply["tasks"]] == [(ids["failed-hot"], False), (ids["failed"], True)]


def test_the_state_counts_include_the_moved_tasks() -> None:
    a_history()
    counts = state_counts()
    assert (counts["succeeded"].value, counts["failed"].value, counts["cancelled"].value) == (3, 2, 1)
    assert state_counts(cap=2)["succeeded"].capped


def test_a_task_moved_between_reading_the_ids_and_the_rows_is_still_listed() -> None:
    """The move is one way (tasks_task to tasks_finished): rows are read from tasks_task first, then the
    ids it did not find from tasks_finished, so a row moved between the two reads is found by the second."""
    ids = a_history()
    listing = state_listing("succeeded")
    page = listing.page(limit=10)
    assert [t.pk for t in page.tasks] == [ids["ok-new"], ids["ok-hot"], ids["ok-old"]]
    move(ids["ok-hot"])
    rows = listing.rows([t.pk for t in page.tasks])
    assert [(t.pk, t.archived) for t in rows] == [(ids["ok-new"], True), (ids["ok-hot"], True), (ids["ok-old"], True)]


def test_an_action_that_does_not_fit_a_moved_task_is_refused_and_names_it(staff: Client) -> None:
    ids = a_history()
    ready = Task.objects.enqueue(NOOP).id
    response = staff.post("/dashboard/tasks/action/", {"action": "cancel", "ids": [ids["failed"], ready]})
    assert response.status_code == 409
    assert f"task {ids['failed']} is Failed history" in response.content.decode()
    assert Task.objects.get(pk=ready).status == "READY"  # nothing changed
    assert where(ids["failed"]) == "tasks_finished"


def where(task_id: int) -> str | None:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT 'tasks_task' FROM tasks_task WHERE id = %s UNION ALL SELECT 'tasks_finished' FROM tasks_finished"
            " WHERE id = %s",
            [task_id, task_id],
        )
        found = [row[0] for row in cursor.fetchall()]
    assert len(found) <= 1, found  # never in both
    return found[0] if found else None


def test_the_admin_requeues_a_selection_with_moved_tasks_and_refuses_to_delete_one(staff: Client) -> None:
    """Its actions' queryset reads tasks_task: the requeue brings the selected moved tasks back first
    (its transaction); a delete of a selection holding one is refused whole (its confirmation page
    would not list it), naming it."""
    ids = a_history()
    refused = staff.post(
        "/admin/tasks/task/",
        {"action": "delete_selected", "_selected_action": [ids["ok-hot"], ids["failed"]]},
        follow=True,
    )
    assert f"task(s) {ids['failed']} are kept in the finished history" in refused.content.decode()
    assert where(ids["ok-hot"]) == "tasks_task" and where(ids["failed"]) == "tasks_finished"
    done = staff.post(
        "/admin/tasks/task/", {"action": "requeue", "_selected_action": [ids["failed-hot"], ids["failed"]]}, follow=True
    )
    assert "Requeued 2 finished task(s)." in done.content.decode()
    for task_id in (ids["failed-hot"], ids["failed"]):
        assert where(task_id) == "tasks_task" and Task.objects.get(pk=task_id).status == "READY"


def test_a_moved_task_runs_again_from_the_dashboard_and_the_api_and_comes_back(staff: Client, api_on: Api) -> None:
    """Retry (a failed task), run again (a successful one): the row comes back to tasks_task as it was,
    then the requeue, in one transaction; its id, path and arguments kept, a fresh set of attempts."""
    ids = a_history()
    before = Task.objects.find(ids["failed"])
    response = staff.post("/dashboard/tasks/action/", {"action": "retry", "ids": [ids["failed"]]})
    assert response.status_code == 302, response.content.decode()[-400:]
    again = Task.objects.get(pk=ids["failed"])
    assert where(ids["failed"]) == "tasks_task" and again.status == "READY" and again.attempts == 0
    assert (again.task_path, again.enqueued_at) == (before.task_path, before.enqueued_at)
    status, reply = api_on.call("POST", f"/api/tasks/{ids['ok-new']}/requeue")
    assert status == 200 and reply["task"]["status"] == "READY" and reply["task"]["archived"] is False
    assert where(ids["ok-new"]) == "tasks_task"
    status, reply = api_on.call("POST", f"/api/tasks/{ids['ok-new']}/requeue")  # now a waiting task: run now
    assert status == 200


def test_a_refused_rerun_leaves_the_moved_task_where_it_was(staff: Client, api_on: Api) -> None:
    """An unfinished task holds the moved task's dedup key: the requeue is refused (409, the key and its
    holder named) and the restore before it is rolled back with it."""
    old = ended("FAILED", dedup_key="invoice-9")
    move(old)
    holder = Task.objects.enqueue(NOOP, dedup_key="invoice-9").id
    response = staff.post("/dashboard/tasks/action/", {"action": "retry", "ids": [old]})
    assert response.status_code == 409 and f"task {holder}" in response.content.decode()
    assert where(old) == "tasks_finished" and Task.objects.find(old).status == "FAILED"
    status, reply = api_on.call("POST", f"/api/tasks/{old}/requeue")
    assert status == 409 and "invoice-9" in reply["error"]
    assert where(old) == "tasks_finished"


def test_two_operators_rerun_one_moved_task_at_once_and_it_runs_once(staff: Client) -> None:
    """Two real connections: the first restores and requeues it in a transaction it keeps open; the
    second's restore waits for that row, finds it gone when the first commits, and its requeue finds
    the task READY: refused by the statement's condition, named. One rerun, the row in tasks_task once."""
    ids = a_history()
    task_id = ids["failed"]
    restored, release = threading.Event(), threading.Event()

    def first() -> int:
        with transaction.atomic():
            assert Task.objects.restore([task_id]) == [task_id]
            changed = Task.objects.filter(pk=task_id).requeue()
            restored.set()
            release.wait(60)
            return changed

    holder = OnItsOwnConnection(first)
    holder.start()
    assert restored.wait(30)

    def second() -> Any:
        with transaction.atomic():
            back = Task.objects.restore([task_id])
            return back, Task.objects.filter(pk=task_id).requeue()

    other = OnItsOwnConnection(second)
    other.start()
    wait_until(lambda: waits_for_a_lock(other.pid), 30, what="the second restore to wait for the row")
    release.set()
    assert holder.outcome() == 1
    assert other.outcome() == ([], 0)  # nothing to restore, nothing finished to requeue
    assert where(task_id) == "tasks_task" and Task.objects.get(pk=task_id).status == "READY"


def test_a_page_reads_about_a_page_of_each_day_whatever_the_days_hold(staff: Client) -> None:
    """Three days of 10,000 finished tasks each in tasks_finished (and a few in tasks_task): every
    statement of the every-task page, unfiltered, by queue, by task path and searched, and of the
    Succeeded page, reads at most a page and a window's rows of a day partition (a count: COUNT_CAP
    rows in all, as on tasks_task), and no day is read
    whole (a sequential scan and a sort, or an index scan that filters its rows one by one).

    10,000 a day, not fewer: PostgreSQL 15 reads a day of 4,000 by a sequential scan for the page's
    rows (``id = ANY`` of 50 ids), rightly cheaper there than 50 probes of its primary key; from
    PostgreSQL 17 such an array is one index scan, and at a real day's size every major probes."""
    today = dt.datetime.now(UTC).replace(hour=12, minute=0, second=0, microsecond=0)
    for back in (1, 2):
        create_day("SUCCESSFUL", (today - dt.timedelta(days=back)).date())
    with connection.cursor() as cursor:
        for back in (0, 1, 2):
            cursor.execute(
                "INSERT INTO tasks_task (queue, priority, task_path, args, kwargs, status, run_after, enqueued_at,"
                " finished_at, attempts, max_attempts, errors, worker_ids, renewals, transitions, failures, crashes,"
                " shared_crashes, unstarted_returns, attempt_started, attempt_isolated, holder)"
                " SELECT 'q' || (g %% 4), 0, 'app.jobs.x' || (g %% 3), '[]', '{}', 'SUCCESSFUL', now(), now(),"
                " %s - g * interval '1 second', 1, 3, '[]', '[]', 0, 0, 0, 0, 0, 0, false, false, 'w-' || (g %% 5)"
                " FROM generate_series(1, 10000) AS g",
                [today - dt.timedelta(days=back)],
            )
        cursor.execute("SELECT array_agg(id) FROM tasks_task WHERE status = 'SUCCESSFUL'")
        (every,) = cursor.fetchone()
    with connection.cursor() as cursor:  # one task of its own kind in the oldest day: found by its index
        cursor.execute(
            "UPDATE tasks_task SET queue = 'rare', holder = 'w-rare', dedup_key = 'rare-key',"
            " task_path = 'app.jobs.rare' WHERE id = %s",
            [min(every)],
        )
    move(*every)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE tasks_finished")
    ended("SUCCESSFUL", queue="q1")
    checks: list[tuple[str, dict[str, str]]] = [
        ("/dashboard/tasks/", {}),
        ("/dashboard/tasks/", {"queue": "q1"}),
        ("/dashboard/tasks/", {"task_path": "app.jobs.x2", "status": "Successful"}),
        ("/dashboard/tasks/", {"q": "w-3"}),
        ("/dashboard/tasks/", {"q": str(every[5])}),
        ("/dashboard/tasks/succeeded/", {}),
        ("/dashboard/tasks/succeeded/", {"queue": "q2"}),
        ("/dashboard/tasks/", {"queue": "rare"}),
        ("/dashboard/tasks/", {"task_path": "app.jobs.rare"}),
        ("/dashboard/tasks/", {"dedup_key": "rare-key"}),
        ("/dashboard/tasks/", {"q": "w-rare"}),
        ("/dashboard/tasks/succeeded/", {"q": "rare-key"}),
    ]
    for url, query in checks:
        with recorded() as statements:
            assert len(shown(staff, url, query)) >= 1
        finished = [(sql, params) for sql, params in statements if "tasks_finished" in sql]
        assert finished, (url, query)
        for sql, params in finished:
            # a count reads up to COUNT_CAP rows, as on tasks_task; a page about a page or a window
            bound = COUNT_CAP + 1 if "count(*)" in sql else SCAN_WINDOW + 200
            problems = day_overreads(explained(sql, params), bound)
            assert not problems, (url, query, problems, sql[:400])


def test_the_admins_counts_of_moved_tasks_read_their_index_only_and_a_status_filtered_out_reads_nothing(
    staff: Client,
) -> None:
    """The admin's count of a search (a worker, a task path) or a queue filter reads each status's
    partition of tasks_finished by an index-only scan of ``(column, id)``: nothing checked on the
    row, no heap page read once the day is all-visible (the status is a constant there, not a
    condition on each row: with
    ``WHERE status = s`` each entry cost a heap page, 25,000 buffers for a count of 10,001 at 10 M
    retained). A filter on another status (the admin's "stuck": running, lease expired) reads no
    entry of tasks_finished at all: the planner decides it once. Every task here has moved, so
    tasks_task names no queue: the queue filter is still applied (its choices came from tasks_task
    alone, and the admin drops a filter without choices: the list showed every queue's tasks)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO tasks_task (queue, priority, task_path, args, kwargs, status, run_after, enqueued_at,"
            " finished_at, attempts, max_attempts, errors, worker_ids, renewals, transitions, failures, crashes,"
            " shared_crashes, unstarted_returns, attempt_started, attempt_isolated, holder)"
            " SELECT 'q' || (g %% 4), 0, 'app.jobs.x' || (g %% 3), '[]', '{}', s.status, now(), now(),"
            " now() - g * interval '1 second', 1, 3, '[]', '[]', 0, 0, 0, 0, 0, 0, false, false, 'w-' || (g %% 5)"
            " FROM generate_series(1, 3000) AS g, (VALUES ('SUCCESSFUL'), ('FAILED')) AS s(status)",
            [],
        )
        cursor.execute("SELECT array_agg(id) FROM tasks_task WHERE status IN ('SUCCESSFUL', 'FAILED')")
        (every,) = cursor.fetchone()
    move(*every)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE tasks_finished")
    for query, expected in (({"q": "w-3"}, 1200), ({"q": "app.jobs.x1"}, 2000), ({"queue__exact": "q2"}, 1500)):
        with recorded() as statements:
            page = staff.get("/admin/tasks/task/", query)
        assert page.context["cl"].result_count == expected, query
        (count,) = [(sql, params) for sql, params in statements if "count(*)" in sql and "tasks_finished" in sql]
        with connection.cursor() as cursor:
            # 3,000 rows a day here are read best whole, or by a bitmap; at millions the count walks
            # the index newest first up to the cap: whether that path can skip the heap is checked
            cursor.execute("SET enable_bitmapscan = off; SET enable_seqscan = off")
        try:
            scans = partition_scans(explained(*count))
        finally:
            with connection.cursor() as cursor:
                cursor.execute("RESET enable_bitmapscan; RESET enable_seqscan")
        assert any(rows for _node, rows, _, _ in scans), (query, scans)
        for _node, _rows, _heap, checked in scans:
            # nothing about the status is read from a row (PostgreSQL 15 may still walk a day's
            # primary key, checking the lookup, where its visibility map is empty: a cost choice)
            assert "status" not in checked, (query, scans)
    with recorded() as statements:
        assert staff.get("/admin/tasks/task/", {"lease": "stuck"}).context["cl"].result_count == 0
    (count,) = [(sql, params) for sql, params in statements if "count(*)" in sql and "tasks_finished" in sql]
    assert partition_scans(explained(*count), executed_only=True) == []


def partition_scans(plan: dict[str, Any], *, executed_only: bool = False) -> list[tuple[str, int, int, str]]:
    """(node type, rows, heap fetches, the condition it checks on each row) of each scan of a day
    partition of tasks_finished; with ``executed_only``, of those that ran."""
    found = []
    if (plan.get("Relation Name") or "").startswith("tasks_finished_") and (
        not executed_only or plan.get("Actual Loops", 0) > 0
    ):
        found.append(
            (plan["Node Type"], plan.get("Actual Rows", 0), plan.get("Heap Fetches", 0), plan.get("Filter", ""))
        )
    for child in plan.get("Plans", []):
        found += partition_scans(child, executed_only=executed_only)
    return found


def day_overreads(plan: dict[str, Any], limit: int) -> list[str]:
    """Nodes on a day partition of tasks_finished that read more than ``limit`` rows (an empty day
    may be read by a sequential scan: nothing to read; a full one read so would be sorted whole)."""
    problems = []
    relation = plan.get("Relation Name") or ""
    if relation.startswith("tasks_finished_"):
        read = plan.get("Actual Rows", 0) + plan.get("Rows Removed by Filter", 0)
        if read > limit:
            problems.append(f"{plan.get('Node Type')} on {relation} read {read}")
    for child in plan.get("Plans", []):
        problems += day_overreads(child, limit)
    return problems


def test_the_admin_lists_moved_tasks_counts_them_opens_them_read_only_and_deletes_one(staff: Client) -> None:
    ids = a_history()
    page = staff.get("/admin/tasks/task/")
    assert page.status_code == 200
    assert [t.pk for t in page.context["cl"].result_list] == sorted(ids.values(), reverse=True)
    assert page.context["cl"].result_count == len(ids)
    body = page.content.decode()
    assert f'name="_selected_action" value="{ids["ok-hot"]}"' in body
    assert f'name="_selected_action" value="{ids["ok-new"]}"' in body
    status_only = staff.get("/admin/tasks/task/", {"status__exact": "SUCCESSFUL", "queue__exact": "mail"})
    assert [t.pk for t in status_only.context["cl"].result_list] == [ids["ok-new"], ids["ok-old"]]
    for term in (str(ids["failed"]), "order-1", ECHO):
        found = staff.get("/admin/tasks/task/", {"q": term})
        assert [t.pk for t in found.context["cl"].result_list] != [], term
    change = staff.get(f"/admin/tasks/task/{ids['ok-new']}/change/")
    assert change.status_code == 200
    assert change.context["original"].archived and not change.context["has_change_permission"]
    assert 'name="_save"' not in change.content.decode()
    # deleted from its page (history that must go before its day: a customer's data), and only it
    assert staff.get(f"/admin/tasks/task/{ids['ok-new']}/delete/").status_code == 200
    assert staff.post(f"/admin/tasks/task/{ids['ok-new']}/delete/", {"post": "yes"}).status_code == 302
    assert where(ids["ok-new"]) is None and where(ids["ok-old"]) == "tasks_finished"
    assert staff.get(f"/admin/tasks/task/{ids['ok-new']}/change/").status_code == 302  # gone: "does not exist"
