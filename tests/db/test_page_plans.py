"""Every query the pages send reads an index, never the whole tasks table.

The table is filled with 50,000 tasks in the mix bench/pages.py uses (big enough for the planner
to care: on a small table a sequential scan is the right plan; with the dedup key's index dropped,
four pages' statements scan it at this size, as at the 200,000 it was once filled with), then every
page of the benchmark (dashboard with its searches and filters, admin list, filters and search, API lists, /metrics) is
requested while its SQL is recorded, and each statement that touches tasks_task is EXPLAINed: no
plan may have a sequential scan of it. Timing is bench/pages.py's job; this test pins the plans.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from django.test import Client
from django.utils import timezone

from bench.pages import FILL_SQL, RUNNING_SQL, pages
from tests.helpers.plans import explained, seq_scans_of_tasks

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

ROWS = 50_000


def fill() -> dict[str, Any]:
    from tasks.models import Worker

    Worker.objects.create(id="worker-7", hostname="plans", pid=7, concurrency=10, running=10)
    with connection.cursor() as cursor:
        cursor.execute(FILL_SQL, {"n": ROWS, "stride": ROWS // 60, "now": timezone.now()})
        cursor.execute(RUNNING_SQL)
        cursor.execute("VACUUM ANALYZE tasks_task")
        cursor.execute("SELECT max(id), min(id) FROM tasks_task")
        newest, oldest = cursor.fetchone()
        cursor.execute("SELECT id FROM tasks_task WHERE status = 'FAILED' ORDER BY id LIMIT 1 OFFSET 3")
        failed = cursor.fetchone()[0]
        cursor.execute("SELECT dedup_key FROM tasks_task WHERE dedup_key IS NOT NULL ORDER BY id LIMIT 1 OFFSET 7")
        dedup = cursor.fetchone()[0]
    return {"newest": newest, "middle": (newest + oldest) // 2, "failed": failed, "dedup": dedup}


def test_every_page_query_reads_an_index(client: Client) -> None:
    keys = fill()
    client.force_login(get_user_model().objects.create_superuser("plans", "plans@example.com", "pw"))
    statements: dict[str, tuple[str, Any, str]] = {}
    page = ""

    def record(execute: Any, sql: str, params: Any, many: bool, context: dict[str, Any]) -> Any:
        if "tasks_task" in sql:
            statements.setdefault(sql + repr(params), (sql, params, page))
        return execute(sql, params, many, context)

    urls = pages(keys)
    assert len(urls) > 40
    with connection.execute_wrapper(record):
        for label, url in urls:
            page = f"{label}: {url}"
            assert client.get(url).status_code == 200, url
    assert len(statements) > 50

    problems = [
        f"{url}\n  Seq Scan on tasks_task, filter {condition}\n  {sql[:400]}"
        for sql, params, url in statements.values()
        for condition in seq_scans_of_tasks(explained(sql, params, analyze=False))
    ]
    assert not problems, "\n".join(problems)
