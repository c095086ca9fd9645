"""The search finds a task by its task path's last part, as people type it (issue 56, item 11:
``send_email`` for ``app.tasks.send_email``), in both tables, and says what it matched; the paths are
read by one index probe per distinct path, whatever the number of tasks."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection
from django.test import Client

from tasks.models import Task
from tasks.web import queries
from tests.db.test_finished_lists import days, ended, move  # noqa: F401 (days: the autouse fixture)
from tests.helpers.plans import add_rows, explained, rows_read, seq_scans_of_tasks

NOOP = "tests.testapp.handlers.noop"
ADD = "tests.testapp.handlers.add"


def listed(staff: Client, url: str) -> tuple[list[int], Any]:
    response = staff.get(url)
    assert response.status_code == 200, response.content.decode()[-600:]
    return [task.pk for task in response.context["tasks"]], response


@pytest.mark.django_db(transaction=True)
def test_a_last_part_finds_the_paths_it_ends_in_both_tables_and_the_page_says_so(staff: Client) -> None:
    ready = Task.objects.enqueue(NOOP).id
    other = Task.objects.enqueue(ADD, kwargs={"a": 1, "b": 2}).id
    gone = ended("SUCCESSFUL")  # NOOP, moved to tasks_finished below
    move(gone)
    assert not Task.objects.filter(pk=gone).exists()

    ids, response = listed(staff, "/dashboard/tasks/?q=noop")
    assert sorted(ids) == sorted([ready, gone])
    assert other not in ids
    note = response.content.decode()
    assert 'id="search-matched"' in note
    assert f'<span class="mono">{NOOP}</span>' in note

    ids, response = listed(staff, "/dashboard/tasks/pending/?q=noop")
    assert ids == [ready]
    assert NOOP in response.content.decode()
    ids, _ = listed(staff, "/dashboard/tasks/succeeded/?q=noop")
    assert ids == [gone]

    # The whole path finds the same tasks, and says nothing more; a part that is not a whole last
    # part, or a middle part, finds nothing (each match is exact, as the search box says).
    ids, response = listed(staff, f"/dashboard/tasks/?q={NOOP}")
    assert sorted(ids) == sorted([ready, gone])
    assert 'id="search-matched"' not in response.content.decode()
    for term in ("noo", "handlers", "handlers.noop", "NOOP", "no op"):
        ids, response = listed(staff, f"/dashboard/tasks/?q={term}")
        assert ids == [], term
        assert 'id="search-matched"' not in response.content.decode()
    # The admin's search too.
    admin = staff.get("/admin/tasks/task/?q=add").content.decode()
    assert f"/admin/tasks/task/{other}/change/" in admin
    assert f"/admin/tasks/task/{ready}/change/" not in admin


@pytest.mark.django_db
def test_a_running_task_is_found_by_its_last_part(staff: Client) -> None:
    Task.objects.enqueue("app.jobs.running_only")
    (claimed,) = Task.objects.claim("w-1", limit=1, ttl=300)
    assert queries.paths_ending_with("running_only", "default") == ["app.jobs.running_only"]
    ids, _ = listed(staff, "/dashboard/tasks/running/?q=running_only")
    assert ids == [claimed.id]


@pytest.mark.django_db
def test_the_paths_are_read_by_one_probe_per_path_not_per_task() -> None:
    """20,000 tasks of one path and a few of two others: the statement reads each index a few
    entries per distinct path, and scans no table."""
    add_rows("bulk", "READY", 10_000)
    add_rows("bulk", "SUCCESSFUL", 10_000)
    Task.objects.enqueue(NOOP)
    Task.objects.enqueue(ADD, kwargs={"a": 1, "b": 2})
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE tasks_task")
    plan = explained(queries.TASK_PATHS_SQL, queries.task_paths_params())
    assert seq_scans_of_tasks(plan) == []
    assert max(read for _node, read in rows_read(plan)) <= 3, rows_read(plan)
    assert queries.paths_ending_with("x", "default") == ["app.jobs.x"]
    assert queries.paths_ending_with("noop", "default") == [NOOP]


@pytest.mark.django_db(transaction=True)
def test_the_running_part_reads_the_running_index_however_the_running_rows_lie() -> None:
    """No index of status holds the RUNNING rows (migration 0044): with a share of the table running,
    spread over its pages, the running part ``LIMIT 5000`` without an order was a sequential scan that
    stopped after 5,000 matches, wherever in the heap it found them (helper-24: 830,247 rows read
    beside 60,000 running in 1,000,000; here a sixth of 200,000 running, on PostgreSQL 15 and 18). In
    lease-expiry order it reads the running index, at most the running rows."""
    add_rows("bulk", "READY", 200_000)
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE tasks_task SET status = 'RUNNING', holder = 'w', token = id,"
            " expires_at = now() + interval '5 minutes' + random() * interval '1 minute' WHERE id % 6 = 0"
        )
        cursor.execute("VACUUM (FREEZE, ANALYZE) tasks_task")
    plan = explained(queries.TASK_PATHS_SQL, queries.task_paths_params())
    assert seq_scans_of_tasks(plan) == []
    running = 200_000 // 6  # at most the running rows: a set bounded by the workers, not the table
    assert max(read for _node, read in rows_read(plan)) <= running, rows_read(plan)
    assert queries.paths_ending_with("x", "default") == ["app.jobs.x"]
