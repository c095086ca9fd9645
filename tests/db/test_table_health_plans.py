"""The table-health figures of /metrics (tasks/web/metrics.py ``TABLE_HEALTH_SQL``) read the statistics
and the catalog, never tasks_task: a scrape costs the same at an empty table and at 100,000 rows."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.db import connection

from tasks.web.metrics import TABLE_HEALTH_SQL
from tests.helpers.plans import add_rows

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def analyzed() -> dict[str, Any]:
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + TABLE_HEALTH_SQL, {"table": "tasks_task"})
        raw = cursor.fetchone()[0]
    plan: dict[str, Any] = (json.loads(raw) if isinstance(raw, str) else raw)[0]["Plan"]
    return plan


def relations(plan: dict[str, Any]) -> set[str]:
    """Every table and index a plan reads."""
    found = {name for name in (plan.get("Relation Name"), plan.get("Index Name")) if name}
    for child in plan.get("Plans", []):
        found |= relations(child)
    return found


def pages(plan: dict[str, Any]) -> int:
    return int(plan["Shared Hit Blocks"]) + int(plan["Shared Read Blocks"])


def test_table_health_reads_the_catalog_only_whatever_the_table_size() -> None:
    analyzed()  # the catalog caches warm, as they are after a scrape
    empty = analyzed()
    add_rows("bulk", "SUCCESSFUL", 100_000)
    add_rows("bulk", "READY", 1_000)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE tasks_task")
    full = analyzed()
    read = relations(full)
    assert read, "the plan names what it reads"
    assert all(name.startswith("pg_") for name in read), sorted(read)
    # The same catalog pages, give or take what the catalog caches of this database held at the time
    # (20 then 22 seen in one run of the parallel pass, 17 then 11 in another): nothing that grows
    # with the table's rows. Fewer at 100,000 rows is the caches, not a cost.
    assert pages(full) - pages(empty) <= 5, (pages(empty), pages(full))
    assert pages(full) < 100
