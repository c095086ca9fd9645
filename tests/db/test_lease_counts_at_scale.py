"""Issue 41's bounded lease counts: the helpers that attack them at 100,000 released and 40,000
expired leases (test_lease_counts_every_order.py, in each order the states' names can sort in, on
every stack CI runs: the lease pages, the overview, /metrics and the admin's lease list and search
read no whole table and no node reads more than the count cap's rows); the admin's refused orders;
the counts exact under the cap and "10,000+" above it."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.db import connection
from django.test import Client

from leasing.pagination import COUNT_CAP
from leasing.views import state_counts
from tests.factories import StaffFactory

pytestmark = pytest.mark.django_db(transaction=True)

LEASES_SQL = """
INSERT INTO leasing_lease (resource, holder, token, acquired_at, expires_at, created_at, renewed_at, released_at,
    renewals, transitions)
SELECT %(prefix)s || lpad(g::text, 8, '0'), 'h-' || (g %% 50), nextval('leasing_fence_token_seq'),
       now() - interval '2 days', now() + %(expires_in)s::interval, now() - interval '2 days', NULL,
       CASE WHEN %(released)s THEN now() - interval '1 day' END, g %% 3, 1
FROM generate_series(1, %(n)s) AS g
"""
PAGES = (
    "/leases/",
    "/leases/renewed/",
    "/leases/expired/",
    "/leases/released/",
    "/leases/expired/?page=3",
    "/dashboard/",
    "/metrics",
    "/admin/leasing/lease/",
    "/admin/leasing/lease/?state=expired",
    "/admin/leasing/lease/?state=released",
    "/admin/leasing/lease/?state=active",
    "/admin/leasing/lease/?o=-1",
    "/admin/leasing/lease/?state=expired&o=-1",
    "/admin/leasing/lease/?state=released&o=-1",
)
#: Rows a node may read: the cap's count (cap + 1) and a page, with room for the page's own lookups.
ROW_BOUND = COUNT_CAP + 1 + 500


def add(prefix: str, n: int, *, released: bool, expires_in: str) -> None:
    with connection.cursor() as cursor:
        cursor.execute(LEASES_SQL, {"prefix": prefix, "n": n, "released": released, "expires_in": expires_in})


def nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    found = [plan]
    for child in plan.get("Plans", []):
        found += nodes(child)
    return found


def explained(sql: str, params: Any) -> dict[str, Any]:
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sql, params)
        raw = cursor.fetchone()[0]
    plan: dict[str, Any] = (json.loads(raw) if isinstance(raw, str) else raw)[0]["Plan"]
    return plan


def statements_of(client: Client, urls: tuple[str, ...]) -> list[tuple[str, str, Any]]:
    """Each statement on leasing_lease that requesting ``urls`` as a staff user sent, with its URL."""
    client.force_login(StaffFactory.create())
    statements: list[tuple[str, str, Any]] = []
    current = [""]

    def record(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        if "leasing_lease" in sql:
            statements.append((current[0], sql, params))
        return execute(sql, params, many, context)

    with connection.execute_wrapper(record):
        for url in urls:
            current[0] = url
            assert client.get(url).status_code == 200, url
    return statements


def problems_of(statements: list[tuple[str, str, Any]]) -> list[str]:
    report, problems = [], []
    for url, sql, params in statements:
        plan = explained(sql, params)
        buffers = plan.get("Shared Hit Blocks", 0) + plan.get("Shared Read Blocks", 0)
        read = max(
            (n.get("Actual Rows", 0) + n.get("Rows Removed by Filter", 0)) * n.get("Actual Loops", 1)
            for n in nodes(plan)
        )
        kinds = sorted({f"{n['Node Type']} {n.get('Index Name', n.get('Relation Name', ''))}" for n in nodes(plan)})
        report.append(f"{url}: buffers {buffers}, most rows read by a node {read:.0f}: {kinds}\n    {sql[:160]}")
        if any(n["Node Type"] == "Seq Scan" for n in nodes(plan)) or read > ROW_BOUND:
            problems.append(report[-1])
    print("\n".join(report))
    return problems


def test_the_lease_admin_refuses_orders_no_index_gives(client: Client) -> None:
    """Django's admin sorts by any column's ?o=, sortable_by or not: renewals, transitions,
    acquired_at and token have no index, and sorting by them read every lease (15,894 buffers at
    1,200,000); expiry and holder, with the admin's tie-breaks, 200,000 rows or more. Refused with
    a message, the list shown in its own order."""
    client.force_login(StaffFactory.create())
    for order in ("3", "6", "-6", "7", "8", "9", "4", "1.-7", "x", "99"):
        response = client.get(f"/admin/leasing/lease/?o={order}")
        assert response.status_code == 302 and response["Location"] == "/admin/leasing/lease/", order
    assert client.get("/admin/leasing/lease/?o=-1").status_code == 200


def test_counts_exact_under_the_cap_and_capped_above() -> None:
    add("e-", COUNT_CAP - 1, released=False, expires_in="-1 hour")
    add("h-", 7, released=False, expires_in="1 hour")
    add("r-", COUNT_CAP + 5, released=True, expires_in="-1 day")
    counts = state_counts()
    assert {k: (v.value, v.capped, str(v)) for k, v in counts.items()} == {
        "active": (7, False, "7"),
        "renewed": (sum(1 for g in range(1, 8) if g % 3), False, str(sum(1 for g in range(1, 8) if g % 3))),
        "expired": (COUNT_CAP - 1, False, f"{COUNT_CAP - 1:,}"),
        "released": (COUNT_CAP, True, f"{COUNT_CAP:,}+"),
    }
