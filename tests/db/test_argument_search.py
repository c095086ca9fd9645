"""Search by arguments (``kwargs:{…}``, ``args:[…]``): refused while its opt-in index is absent, served by
that index once ``tasks_search_index create`` built it (EXPLAIN: the GIN index, rows read bounded by
the matches, no sequential scan), on the dashboard and in the admin."""

from __future__ import annotations

from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.db import connection
from django.test import Client

from tasks.web.listings import SCAN_WINDOW
from tests.helpers.plans import explained, rows_read, seq_scans_of_tasks

pytestmark = pytest.mark.django_db(transaction=True)

ROWS = 20_000
FILL = """
INSERT INTO tasks_task (queue, priority, task_path, args, kwargs, status, run_after, enqueued_at, finished_at,
    attempts, max_attempts, errors, worker_ids, renewals, transitions, failures, crashes, shared_crashes,
    unstarted_returns, attempt_started, attempt_isolated, errors_dropped)
SELECT 'default', 0, 'app.jobs.x', jsonb_build_array(g %% 500), jsonb_build_object('customer', g %% 1000, 'n', g),
       'FAILED', now(), now(), now(), 1, 1, '[]', '[]', 0, 0, 1, 0, 0, 0, false, false, 0
FROM generate_series(1, %s) AS g
"""
TERM = 'kwargs:{"customer": 7}'


@pytest.fixture
def rows() -> None:
    with connection.cursor() as cursor:
        cursor.execute(FILL, [ROWS])
        cursor.execute("VACUUM ANALYZE tasks_task")


def index(action: str) -> str:
    out = StringIO()
    call_command("tasks_search_index", action, stdout=out)
    return out.getvalue()


def test_without_its_index_an_argument_search_is_refused_not_scanned(staff: Client, rows: None) -> None:
    assert "kwargs: tasks_task_kwargs_search_idx absent" in index("status")
    page = staff.get("/dashboard/tasks/failed/", {"q": TERM}).content.decode()
    assert "Search refused" in page and "tasks_search_index create" in page
    admin = staff.get("/admin/tasks/task/", {"q": TERM}).content.decode()
    assert "Search refused" in admin
    bad = staff.get("/dashboard/tasks/failed/", {"q": "kwargs:[1, 2"}).content.decode()
    assert "Search refused" in bad and "JSON object" in bad


def test_with_its_index_the_search_reads_the_matches_through_it(staff: Client, rows: None) -> None:
    try:
        assert "kwargs: tasks_task_kwargs_search_idx present" in index("create")
        statements: list[tuple[str, Any]] = []

        def record(execute: Any, sql: str, params: Any, many: bool, context: dict[str, Any]) -> Any:
            if "@>" in sql:
                statements.append((sql, params))
            return execute(sql, params, many, context)

        with connection.execute_wrapper(record):
            page = staff.get("/dashboard/tasks/failed/", {"q": TERM}).content.decode()
        assert "Search refused" not in page
        with connection.cursor() as cursor:
            cursor.execute("SELECT id FROM tasks_task WHERE kwargs @> '{\"customer\": 7}' ORDER BY id DESC")
            expected = [row[0] for row in cursor.fetchall()]
        assert len(expected) == ROWS // 1000
        for task_id in expected:
            assert f'href="/dashboard/tasks/{task_id}/"' in page
        assert statements
        for sql, params in statements:
            plan = explained(sql, params)
            if '"tasks_finished' in sql:  # the table or a status's partition
                # tasks_finished (the mover's rows) has no argument index: the search is checked there
                # within the lists' window, at most SCAN_WINDOW rows of each day (issue 43)
                assert max((n for _, n in rows_read(plan)), default=0) <= SCAN_WINDOW + 1, sql
                continue
            assert not seq_scans_of_tasks(plan), sql
            read = rows_read(plan)
            assert any("tasks_task_kwargs_search_idx" in node for node, _ in read), read
            assert max(n for _, n in read) <= 10 * len(expected), read  # the matches, not the table
        # The admin's search goes through the same index.
        admin = staff.get("/admin/tasks/task/", {"q": TERM}).content.decode()
        assert "Search refused" not in admin and f"{len(expected)} result" in admin
    finally:
        assert "kwargs: tasks_task_kwargs_search_idx absent" in index("drop")
    assert "Search refused" in staff.get("/dashboard/tasks/failed/", {"q": TERM}).content.decode()
