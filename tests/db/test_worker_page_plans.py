"""A worker's pages read the running set, never the table (issue 59, helper-25's attack on migration
0045). No index has the running rows by holder or in id order since then: the workers page and a
worker's own page read a worker's running rows from the running index, in its order (lease expiry,
``RUNNING_ORDER``), and show them by id. Ordered by id, with the statistics of a busy hour (two
long-lived workers holding the table's history, so each one's running share looks large), the
planner walked the primary key from the oldest task for rows that have the newest ids: 200,401 rows
read of 220,000 for a page of 201, and as many for a stopped worker whose tasks were recovered and
that holds nothing."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from django.test import Client
from django.utils import timezone

from bench.pages import FILL_SQL, RUNNING_SQL
from tasks.models import Worker
from tests.helpers.plans import explained, recorded, total_rows_read

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

ROWS = 200_000
RUNNING = 20_000


def test_a_workers_pages_read_the_running_set_not_the_table(client: Client) -> None:
    for n in (0, 1, 2):
        Worker.objects.create(id=f"worker-{n}", hostname="plans", pid=n, concurrency=10, running=10)
    with connection.cursor() as cursor:
        cursor.execute(FILL_SQL, {"n": ROWS, "stride": ROWS // 60, "now": timezone.now()})
        cursor.execute(RUNNING_SQL.replace("generate_series(1, 205)", f"generate_series(1, {RUNNING})"))
        # Two workers hold the running set and the history; worker-2 held a share of the history and
        # holds nothing now (its tasks recovered): what the statistics of a busy hour then say.
        cursor.execute("UPDATE tasks_task SET holder = 'worker-' || (id % 2) WHERE holder IS NOT NULL")
        cursor.execute(
            "UPDATE tasks_task SET holder = 'worker-2' WHERE id IN"
            " (SELECT id FROM tasks_task WHERE holder IS NOT NULL AND status <> 'RUNNING' LIMIT 30000)"
        )
        cursor.execute("VACUUM ANALYZE tasks_task")
    client.force_login(get_user_model().objects.create_superuser("plans", "plans@example.com", "pw"))
    problems = []
    for url, shown in (
        ("/dashboard/workers/worker-1/", 200),  # HELD_LIMIT of its 10,000, by id
        ("/dashboard/workers/worker-2/", 0),
        ("/dashboard/workers/", 1000),  # the first 1,000 held by the live workers, by id
    ):
        with recorded() as statements:
            response = client.get(url)
        assert response.status_code == 200, url
        if "held" in response.context:
            held = response.context["held"]
            assert response.context["held_more"] == bool(shown)
        else:
            held = [task for row in response.context["workers"] for task in row["tasks"]]
        assert len(held) == shown, url
        assert all(task.status == "RUNNING" and task.holder in url for task in held) or url.endswith("/workers/")
        for row in response.context.get("workers", []):
            assert [task.pk for task in row["tasks"]] == sorted(task.pk for task in row["tasks"]), url
        for sql, params in statements:
            plan: dict[str, Any] = explained(sql, params)
            read = total_rows_read(plan)
            if read > RUNNING + 1_000:
                problems.append(f"{url}: {read:,.0f} rows read by {sql[:300]}")
    assert not problems, "\n".join(problems)
