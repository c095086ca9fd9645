"""The lease pages (issue 41's tabs: Held, Expired, Released) at 200,000 leases, most of them released
long ago: each page's statements read about a page of index entries, no sequential scan of
leasing_lease (invariant 12: costs do not grow with table size)."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection
from django.test import Client

from tests.factories import StaffFactory
from tests.helpers.plans import explained

LEASES_SQL = """
INSERT INTO leasing_lease (resource, holder, token, acquired_at, expires_at, created_at, renewed_at, released_at,
    renewals, transitions)
SELECT 'res-' || g, 'h-' || (g %% 50), nextval('leasing_fence_token_seq'), now() - interval '2 days',
       CASE WHEN g %% 1000 = 0 THEN now() + interval '1 hour' ELSE now() - interval '1 day' END,
       now() - interval '2 days', NULL,
       CASE WHEN g %% 1000 = 0 OR g %% 1000 = 1 THEN NULL ELSE now() - interval '1 day' END, g %% 3, 1
FROM generate_series(1, %(n)s) AS g
"""


def seq_scans(plan: dict[str, Any]) -> list[str]:
    found = [plan.get("Relation Name", "")] if plan.get("Node Type") == "Seq Scan" else []
    for child in plan.get("Plans", []):
        found += seq_scans(child)
    return found


@pytest.mark.django_db(transaction=True)
def test_the_lease_pages_read_no_whole_table_at_200k_leases(client: Client) -> None:
    with connection.cursor() as cursor:
        cursor.execute(LEASES_SQL, {"n": 200_000})
        cursor.execute("ANALYZE leasing_lease")
    client.force_login(StaffFactory.create())
    statements: list[tuple[str, object]] = []

    def record(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        if "leasing_lease" in sql:
            statements.append((sql, params))
        return execute(sql, params, many, context)

    with connection.execute_wrapper(record):
        for url in ("/leases/", "/leases/expired/", "/leases/released/", "/leases/renewed/"):
            assert client.get(url).status_code == 200, url
    assert statements
    found = {sql[:200]: scans for sql, params in statements if (scans := seq_scans(explained(sql, params)))}
    assert found == {}
