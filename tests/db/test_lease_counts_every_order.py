"""The held leases without an index of their own (``leasing_lease_live_idx`` folded into
``leasing_lease_expires_idx``), attacked at 100,000 released, 40,000 expired and 5,000 held leases
in each of the six orders the states' resource names can sort in, on every stack CI runs (found on
Django 5.2 and PostgreSQL 15): no page, count, scrape, admin list or search scans a table; the held
leases' count and lists read the held leases and nothing else (not the expired ones named before
them, not the released); every other node reads at most the count cap and a page, plus the held
leases where the expired ones are walked in resource order (no index tells expired from held: expiry
is relative to now)."""

from __future__ import annotations

import itertools

import pytest
from django.db import connection
from django.test import Client

from leasing.views import PAGE_SIZE, state_counts
from tests.db import test_lease_counts_at_scale as at_scale
from tests.db.test_lease_counts_at_scale import PAGES, add, explained, nodes, problems_of, statements_of

pytestmark = pytest.mark.django_db(transaction=True)

ORDERS = list(itertools.permutations(("e-", "h-", "r-")))
NAMES = {"e-": "expired", "h-": "held", "r-": "released"}
#: The held leases and a page: an index range may also hold entries of row versions not yet vacuumed
#: (25 more entries than rows seen on a first run in a session).
HELD_BOUND = 5_000 + PAGE_SIZE
IDS = ["_before_".join(NAMES[state] for state in order) for order in ORDERS]


def prefixes_of(names: tuple[str, ...]) -> dict[str, str]:
    """Each state's resource prefix (its own letter) when the states sort in the order ``names`` gives."""
    return dict(zip(names, ("a-", "m-", "z-"), strict=True))


#: leasing_lease's indexes and constraints but its primary key: (name, CREATE INDEX, constraint, its definition).
SECONDARY_INDEXES_SQL = """
SELECT i.indexname, i.indexdef, con.conname, pg_get_constraintdef(con.oid)
FROM pg_indexes i
LEFT JOIN pg_constraint con ON con.conname = i.indexname AND con.conrelid = 'leasing_lease'::regclass
WHERE i.schemaname = current_schema() AND i.tablename = 'leasing_lease' AND i.indexname <> 'leasing_lease_pkey'
ORDER BY i.indexname
"""


def fill(names: tuple[str, ...]) -> None:
    """40,000 expired, 5,000 held and 100,000 released leases, named so that the states sort in the
    order ``names`` gives: the smallest fill that still tells a bounded plan from a scan by the rows
    a node reads (each state 8-20 times the bound its statements are held to: with
    ``leasing_lease_expires_idx`` left out, the held count read 145,000 rows against its bound of
    5,050). It was 1.2 M leases, 56 s of the six orders on PostgreSQL 18; this one takes 18 s. The
    secondary indexes are dropped for the inserts and built again after (the same indexes and
    constraints, by their own definitions): building one sorts the rows once, where each insert
    would walk seven indexes. The plans below read the rebuilt indexes as a migrated table's."""
    prefixes = prefixes_of(names)
    with connection.cursor() as cursor:
        cursor.execute(SECONDARY_INDEXES_SQL)
        indexes = cursor.fetchall()
        assert len(indexes) >= 6, indexes  # the unique resource and its pattern twin, holder, expiry, two states
        for name, _definition, constraint, _constraint_definition in indexes:
            cursor.execute(
                f'ALTER TABLE leasing_lease DROP CONSTRAINT "{constraint}"' if constraint else f'DROP INDEX "{name}"'
            )
        try:
            add(prefixes["e-"], 40_000, released=False, expires_in="-1 hour")
            add(prefixes["h-"], 5_000, released=False, expires_in="1 hour")
            add(prefixes["r-"], 100_000, released=True, expires_in="-1 day")
        finally:  # the indexes come back whatever failed: the next test in this database needs them
            for _name, definition, constraint, constraint_definition in indexes:
                cursor.execute(
                    f'ALTER TABLE leasing_lease ADD CONSTRAINT "{constraint}" {constraint_definition}'
                    if constraint
                    else definition
                )
        cursor.execute(SECONDARY_INDEXES_SQL)
        assert cursor.fetchall() == indexes
        cursor.execute("VACUUM ANALYZE leasing_lease")


@pytest.mark.parametrize("names", ORDERS, ids=IDS)
def test_counts_and_pages_read_bounded_rows_in_every_order(
    client: Client, names: tuple[str, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One fill per order (145,000 leases), then the counts, the pages and the admin's search (by a
    prefix 1 % of the released leases share, as 9,999 of the million did at the old size: its count
    and page read a bounded range, not the prefix's rows; at 10 %, PostgreSQL 15 rightly scans)."""
    fill(names)
    check_counts(client, monkeypatch)
    check_pages(client)
    search = f"/admin/leasing/lease/?q={prefixes_of(names)['r-']}00000"
    assert problems_of(statements_of(client, (search,))) == []


def check_counts(client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """The counts of the overview, /metrics and every lease page's tabs (state_counts): the held
    count reads the held leases only (it read all 205,000 entries of leasing_lease_live_res_idx,
    857 buffers, in every order, on PostgreSQL 15 and Django 5.2)."""
    counts = state_counts()
    assert (counts["active"].value, counts["renewed"].value) == (5_000, sum(1 for g in range(1, 5_001) if g % 3))
    assert (counts["expired"].capped, counts["released"].capped) == (True, True)
    statements = statements_of(client, ("/dashboard/", "/metrics"))
    held = [(url, sql, params) for url, sql, params in statements if "COALESCE" in sql and "COUNT" in sql]
    assert len(held) == 2, statements
    for _url, sql, params in held:  # the held count reads the held leases, nothing else
        plan = explained(sql, params)
        read = max(n.get("Actual Rows", 0) + n.get("Rows Removed by Filter", 0) for n in nodes(plan))
        assert read <= HELD_BOUND, [
            (n["Node Type"], n.get("Actual Rows"), n.get("Rows Removed by Filter")) for n in nodes(plan)
        ]
    # The expired count walks leasing_lease_live_res_idx in resource order, the held leases among the
    # expired ones (no index can tell them apart: expiry is relative to now): the cap and the held.
    monkeypatch.setattr(at_scale, "ROW_BOUND", at_scale.ROW_BOUND + 5_000)
    assert problems_of(statements) == []


def check_pages(client: Client) -> None:
    """The Held tab, its renewed view and the admin's ?state=active list the held leases in resource
    order: they walked leasing_lease_live_res_idx through every expired lease named first (/leases/:
    200,050 rows, 3,239 buffers) or ANDed its 205,000 entries into a bitmap (deep pages, the capped
    counts: 857 buffers); a filter out of the partial index's reach alone walked
    leasing_lease_resource_key through the released ones (1,000,050 rows, 20,235 buffers). Now each
    reads the held leases (5,000 rows, 69 buffers) and sorts them."""
    urls = (
        *PAGES,
        "/leases/?page=100",
        "/admin/leasing/lease/?state=active&p=40",
        "/admin/leasing/lease/?state=renewed",
    )
    statements = statements_of(client, urls)
    held = [(url, sql, params) for url, sql, params in statements if "COALESCE" in sql]
    assert {url for url, _, _ in held} >= {"/leases/", "/leases/renewed/", "/admin/leasing/lease/?state=active"}
    for _url, sql, params in held:  # the held leases' statements read the held leases, nothing else
        plan = explained(sql, params)
        read = max(n.get("Actual Rows", 0) + n.get("Rows Removed by Filter", 0) for n in nodes(plan))
        assert read <= HELD_BOUND, [
            (n["Node Type"], n.get("Actual Rows"), n.get("Rows Removed by Filter")) for n in nodes(plan)
        ]
    assert problems_of(statements) == []  # ROW_BOUND as check_counts set it
