"""The dashboard's workflow pages: the list, a workflow's page with its members counted and listed,
its Cancel button, a member task's parents and children, the awaiting state; and the plans that
keep a workflow's page at the cost of its own members whatever the table holds."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.db import connection
from django.test import Client

from tasks.models import Failure, Task, Workflow
from tasks.web import workflow_pages
from tasks.web.workflows import edges, member_counts, member_listing, workflow_page
from tasks.workflows import EnqueuedWorkflow, chain, group, step
from tests.factories import StaffFactory
from tests.helpers.plans import add_rows, explained, overreads, recorded
from tests.helpers.task_paths import NOOP

pytestmark = pytest.mark.django_db(transaction=True)


def finish_one(*, fail: bool = False) -> int:
    """Claim the next task and finish it (a failure for good with ``fail``)."""
    (task,) = Task.objects.claim("w1", limit=1)
    if fail:
        Task.objects.fail(Failure(task.id, task.token, "builtins.ValueError", "boom", retry=False), "w1")
    else:
        Task.objects.complete_many("w1", [(task.id, task.token, json.dumps(None))])
    return task.id


def report_group() -> EnqueuedWorkflow:
    """Three members and a callback under on_failure="run": one member succeeded, one failed, one
    waits; the callback is AWAITING one more."""
    done = group(
        [step(NOOP, n=n) for n in range(3)], then=step(NOOP), on_failure="run", name="nightly report"
    ).enqueue()
    finish_one()
    finish_one(fail=True)
    return done


def test_the_list_shows_each_workflow_with_its_progress_newest_first(staff: Client) -> None:
    done = report_group()
    newer = chain(step(NOOP), step(NOOP), name="newer").enqueue()
    response = staff.get("/dashboard/workflows/")
    assert response.status_code == 200
    assert [w.pk for w in response.context["workflows"]] == [newer.id, done.id]
    page = response.content.decode()
    assert "nightly report" in page and "(group)" in page and "(chain)" in page
    assert "1 successful · 1 failed · 2 remaining of 4" in page
    assert f'href="/dashboard/workflows/{done.id}/"' in page
    assert f'href="/dashboard/tasks/{done.callback_id}/"' in page  # the callback
    assert {name: c.value for name, c in response.context["counts"].items()} == {
        "RUNNING": 2,
        "SUCCESSFUL": 0,
        "FAILED": 0,
        "CANCELLED": 0,
    }
    assert 'href="/dashboard/workflows/"' in page  # the nav link of every page


def test_the_list_filters_by_status_and_pages_by_id(staff: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    flows = [chain(step(NOOP), name=f"flow {n}").enqueue() for n in range(5)]
    Workflow.objects.filter(pk=flows[1].id).cancel()
    running = staff.get("/dashboard/workflows/", {"status": "RUNNING"})
    assert [w.pk for w in running.context["workflows"]] == [f.id for f in reversed(flows) if f is not flows[1]]
    cancelled = staff.get("/dashboard/workflows/", {"status": "CANCELLED"})
    assert [w.pk for w in cancelled.context["workflows"]] == [flows[1].id]
    assert cancelled.context["counts"]["CANCELLED"].value == 1

    monkeypatch.setattr(workflow_pages, "PAGE_SIZE", 2)
    first = staff.get("/dashboard/workflows/", {"status": "RUNNING"})
    assert [w.pk for w in first.context["workflows"]] == [flows[4].id, flows[3].id]
    assert f"?before={flows[3].id}&status=RUNNING" in first.content.decode()
    second = staff.get("/dashboard/workflows/", {"status": "RUNNING", "before": str(flows[3].id)})
    assert [w.pk for w in second.context["workflows"]] == [flows[2].id, flows[0].id]
    assert second.context["next_before"] is None

    # An invalid filter is ignored with a message (as on the task lists), never a 500.
    odd = staff.get("/dashboard/workflows/", {"status": "NOPE", "before": "²"})
    assert odd.status_code == 200 and len(odd.context["workflows"]) == 2
    text = odd.content.decode()
    assert "Filter ignored: status must be one of" in text and "Filter ignored: before" in text


def test_a_workflows_page_counts_its_members_lists_them_and_links_each_task(staff: Client) -> None:
    done = report_group()
    response = staff.get(f"/dashboard/workflows/{done.id}/")
    assert response.status_code == 200
    counts = response.context["counts"]
    assert {s: n for s, n in counts.items() if n} == {"SUCCESSFUL": 1, "FAILED": 1, "READY": 1, "AWAITING": 1}
    assert [t.pk for t in response.context["tasks"]] == sorted(done.task_ids, reverse=True)
    page = response.content.decode()
    for task_id in done.task_ids:
        assert f'href="/dashboard/tasks/{task_id}/"' in page
    assert 'id="member-counts"' in page and 'data-status="AWAITING"' in page
    assert "1 task" in page  # the callback waits on one more member
    assert 'id="workflow-cancel"' in page  # running: it can be cancelled

    awaiting = staff.get(f"/dashboard/workflows/{done.id}/", {"status": "AWAITING"})
    assert [t.pk for t in awaiting.context["tasks"]] == [done.callback_id]
    assert staff.get("/dashboard/workflows/999999/").status_code == 404
    assert staff.get(f"/dashboard/workflows/{2**63}/").status_code == 404


def test_members_page_by_id_within_a_status(staff: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    done = group([step(NOOP) for _ in range(5)], then=step(NOOP)).enqueue()
    monkeypatch.setattr(workflow_pages, "PAGE_SIZE", 2)
    ids: list[int] = []
    before: int | None = None
    for _ in range(5):
        response = staff.get(f"/dashboard/workflows/{done.id}/", {"before": before} if before else {})
        ids += [t.pk for t in response.context["tasks"]]
        before = response.context["next_before"]
        if before is None:
            break
    assert ids == sorted(done.task_ids, reverse=True)


def test_cancel_is_a_post_with_csrf_and_a_second_one_is_a_409(staff: Client) -> None:
    done = report_group()
    url = f"/dashboard/workflows/{done.id}/cancel/"
    assert staff.get(url).status_code == 405

    guarded = Client(enforce_csrf_checks=True)
    guarded.force_login(StaffFactory.create())
    assert guarded.post(url).status_code == 403  # no CSRF token
    assert Workflow.objects.get(pk=done.id).status == "RUNNING"

    response = staff.post(url)
    assert response.status_code == 302 and response["Location"] == f"/dashboard/workflows/{done.id}/"
    row = Workflow.objects.get(pk=done.id)
    assert (row.status, row.remaining) == ("CANCELLED", 0)
    statuses = dict(Task.objects.filter(workflow_id=done.id).values_list("pk", "status"))
    assert sorted(statuses.values()) == ["CANCELLED", "CANCELLED", "FAILED", "SUCCESSFUL"]
    assert "Cancelled 2 unfinished task(s)" in staff.get(response["Location"]).content.decode()

    before = list(Task.objects.filter(workflow_id=done.id).values()), list(Workflow.objects.values())
    again = staff.post(url)
    assert again.status_code == 409
    assert f"Nothing changed: workflow {done.id} is already cancelled." in again.content.decode()
    assert 'id="workflow-cancel"' not in again.content.decode()
    assert (list(Task.objects.filter(workflow_id=done.id).values()), list(Workflow.objects.values())) == before
    assert staff.post("/dashboard/workflows/999999/cancel/").status_code == 404


def test_a_finished_workflow_cannot_be_cancelled(staff: Client) -> None:
    done = chain(step(NOOP)).enqueue()
    finish_one()
    assert Workflow.objects.get(pk=done.id).status == "SUCCESSFUL"
    response = staff.post(f"/dashboard/workflows/{done.id}/cancel/")
    assert response.status_code == 409
    assert Workflow.objects.get(pk=done.id).status == "SUCCESSFUL"


def test_a_members_page_shows_its_workflow_waiting_on_parents_and_children(staff: Client) -> None:
    done = report_group()
    callback = staff.get(f"/dashboard/tasks/{done.callback_id}/")
    assert callback.status_code == 200
    page = callback.content.decode()
    assert f'href="/dashboard/workflows/{done.id}/"' in page and "(its callback)" in page
    assert "1 of the tasks it depends on" in page
    parents = callback.context["edges"].parents
    assert [(p.task_id, p.on_failure) for p in parents] == [(i, "run") for i in done.task_ids[:3]]
    assert sorted(p.status or "" for p in parents) == ["FAILED", "READY", "SUCCESSFUL"]
    assert 'id="task-parents"' in page and "Depends on (3)" in page

    member = staff.get(f"/dashboard/tasks/{done.task_ids[0]}/")
    assert [c.task_id for c in member.context["edges"].children] == [done.callback_id]
    assert 'id="task-children"' in member.content.decode()

    plain = staff.get(f"/dashboard/tasks/{Task.objects.enqueue(NOOP).id}/")
    assert plain.context["edges"] is None and 'id="task-workflow"' not in plain.content.decode()


def test_a_task_lists_at_most_fifty_parents_and_counts_them_all() -> None:
    done = group([step(NOOP) for _ in range(60)], then=step(NOOP)).enqueue()
    assert done.callback_id is not None
    found = edges(done.callback_id)
    assert [p.task_id for p in found.parents] == done.task_ids[:50]
    assert (found.parent_count.value, found.parent_count.capped, found.children) == (60, False, [])
    assert str(edges(done.callback_id, shown=10).parent_count) == "60"


def test_the_awaiting_state_is_a_tab_a_card_and_a_list_with_queue_and_search(staff: Client) -> None:
    done = chain(step(NOOP), step(NOOP).options(queue="mail")).enqueue()
    waiting = done.task_ids[1]
    overview = staff.get("/dashboard/")
    assert overview.context["task_counts"]["awaiting"].value == 1
    assert 'data-state="awaiting"' in overview.content.decode()
    listed = staff.get("/dashboard/tasks/awaiting/")
    assert [t.pk for t in listed.context["tasks"]] == [waiting]
    assert 'href="/dashboard/tasks/awaiting/"' in listed.content.decode()  # its tab
    assert [t.pk for t in staff.get("/dashboard/tasks/awaiting/", {"queue": "mail"}).context["tasks"]] == [waiting]
    assert staff.get("/dashboard/tasks/awaiting/", {"queue": "default"}).context["tasks"] == []
    assert [t.pk for t in staff.get("/dashboard/tasks/awaiting/", {"q": NOOP}).context["tasks"]] == [waiting]
    assert [t.pk for t in staff.get("/dashboard/tasks/awaiting/", {"q": str(waiting)}).context["tasks"]] == [waiting]


def test_awaiting_with_a_queue_reads_a_window_of_the_status_index_not_every_awaiting_row(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No page index holds AWAITING rows, so a queue or a search is checked within the scan window,
    and the page says how far it looked."""
    from tasks.web import listings

    monkeypatch.setattr(listings, "SCAN_WINDOW", 3)
    rare = chain(step(NOOP), step(NOOP).options(queue="rare")).enqueue().task_ids[1]
    for _ in range(5):
        chain(step(NOOP), step(NOOP)).enqueue()
    listing = listings.state_listing("awaiting", queue="rare")
    first = listing.page(limit=10)
    assert first.tasks == [] and first.scanned_to is not None
    rest = listing.page(limit=10, before=first.next_before)
    assert [t.pk for t in rest.tasks] == [rare]


# -- plans ----------------------------------------------------------------------------------------

HISTORY = 30_000


def index_names(plan: dict[str, Any]) -> set[str]:
    found = {plan["Index Name"]} if "Index Name" in plan else set()
    for child in plan.get("Plans", []):
        found |= index_names(child)
    return found


def test_a_workflows_members_are_counted_and_listed_through_the_workflow_index(staff: Client) -> None:
    """An old workflow under a newer burst of history: its counts and every page of its members read
    tasks_task_workflow_idx (its own members), never a backward scan of the primary key that steps
    over every newer task, nor the table."""
    done = group([step(NOOP) for _ in range(40)], then=step(NOOP)).enqueue()
    Task.objects.claim("w1", limit=15)
    add_rows("bulk", "SUCCESSFUL", HISTORY)
    add_rows("bulk", "READY", HISTORY // 3)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE tasks_task")
    with recorded() as statements:
        counts = member_counts(done.id)
        assert counts["READY"] == 25 and counts["RUNNING"] == 15 and counts["AWAITING"] == 1
        listing = member_listing(done.id, counts)
        first = listing.page(limit=10)
        second = listing.page(limit=10, before=first.next_before)
        assert [t.pk for t in first.tasks + second.tasks] == sorted(done.task_ids, reverse=True)[:20]
        assert [t.pk for t in member_listing(done.id, counts, "RUNNING").page(limit=50).tasks] == sorted(
            done.task_ids[:15], reverse=True
        )
    members = [(sql, params) for sql, params in statements if 'workflow_id" = ANY' in sql or "workflow_id = %" in sql]
    assert len(members) >= 4
    for sql, params in members:
        assert "tasks_task_workflow_idx" in index_names(explained(sql, params)), sql[:300]
    problems = overreads(statements, 2 * len(done.task_ids))
    assert not problems, "\n".join(problems)

    with recorded() as page_statements:
        assert staff.get(f"/dashboard/workflows/{done.id}/").status_code == 200
        assert staff.get(f"/dashboard/tasks/{done.callback_id}/").status_code == 200
    # (The task page's state counts read up to their cap: tests/db/test_state_count_plans.py.)
    ours = [(sql, params) for sql, params in page_statements if "status >= %(status)s" not in sql]
    problems = overreads(ours, 2 * len(done.task_ids))
    assert not problems, "\n".join(problems)


def workflow_nodes_read(plan: dict[str, Any]) -> list[tuple[str, float]]:
    """Per node reading tasks_workflow: the rows it read per loop."""
    found = []
    if plan.get("Relation Name") == "tasks_workflow":
        read = plan["Actual Rows"] + plan.get("Rows Removed by Filter", 0)
        found.append((f"{plan['Node Type']} {plan.get('Index Name', '')}", read))
    for child in plan.get("Plans", []):
        found += workflow_nodes_read(child)
    return found


def add_workflows(status: str, n: int) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO tasks_workflow (name, kind, status, total, remaining, failed, created_at, finished_at)"
            " SELECT '', 'group', %(status)s, 1, 0, 0, now(), now() FROM generate_series(1, %(n)s)",
            {"status": status, "n": n},
        )


def test_a_page_of_one_status_reads_its_own_entries_not_a_newer_burst_of_others() -> None:
    """Failed workflows first, then a burst of successful ones: a page of failed workflows (and its
    count) reads about a page of tasks_workflow_status_idx, whatever lies after them."""
    add_workflows("FAILED", 200)
    add_workflows("SUCCESSFUL", 20_000)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE tasks_workflow")
    statements: list[tuple[str, Any]] = []

    def record(execute: Any, sql: str, params: Any, many: bool, context: dict[str, Any]) -> Any:
        statements.append((sql, params))
        return execute(sql, params, many, context)

    with connection.execute_wrapper(record):
        page = workflow_page("FAILED", limit=20)
    assert len(page.workflows) == 20 and all(w.status == "FAILED" for w in page.workflows)
    ((sql, params),) = statements
    plan = explained(sql, params)
    assert [read for _, read in workflow_nodes_read(plan)] and all(
        read <= 21 for _, read in workflow_nodes_read(plan)
    ), workflow_nodes_read(plan)


def test_hostile_query_strings_are_a_400_page_or_an_ignored_filter(staff: Client) -> None:
    done = report_group()
    for url in ("/dashboard/workflows/", f"/dashboard/workflows/{done.id}/"):
        for param in ("status", "before", "other"):
            for value in ("%00", "%C2%B2", "9" * 5000, "9" * 20, "%ED%A0%80", "x" * 5000, "-1", "0"):
                status = staff.get(f"{url}?{param}={value}").status_code
                assert status in (200, 400), (url, param, value[:20], status)


def test_a_chain_s_last_step_is_its_last_step_and_a_group_s_callback_its_callback(staff: Client) -> None:
    import re

    def words(html: str) -> str:
        return " ".join(re.sub(r"<[^>]+>", " ", html).split())

    last = chain(step(NOOP), step(NOOP), name="two steps").enqueue()
    grouped = report_group()
    workflow = words(staff.get(f"/dashboard/workflows/{last.id}/").content.decode())
    assert "Last step task" in workflow and f"{last.callback_id} last step" in workflow
    assert "callback" not in workflow.lower()
    assert "(its last step)" in words(staff.get(f"/dashboard/tasks/{last.callback_id}/").content.decode())
    workflow = words(staff.get(f"/dashboard/workflows/{grouped.id}/").content.decode())
    assert "Callback task" in workflow and f"{grouped.callback_id} callback" in workflow
    assert "last step" not in workflow
    assert "(its callback)" in words(staff.get(f"/dashboard/tasks/{grouped.callback_id}/").content.decode())
    listed = words(staff.get("/dashboard/workflows/").content.decode())
    assert f"task {last.callback_id} last step" in listed and f"task {grouped.callback_id} callback" in listed
