"""The leasing migrations squashed to 0002 and the holder index's ``varchar_pattern_ops`` twin dropped
by 0003 (SeparateDatabaseAndState), walked back to 0001 and forward again on a table with rows: the
twin comes back on the way down (0001's ``db_index=True`` made it), goes on the way up, the plain
holder index keeps its name throughout, the rows and their states are untouched, and the model's
state after the round trip still matches the database (no migration to make)."""

from __future__ import annotations

import io

import pytest
from django.core.management import call_command
from django.db import connection

from leasing.models import Lease

pytestmark = pytest.mark.django_db(transaction=True)

ROWS = """
INSERT INTO leasing_lease (resource, holder, token, acquired_at, expires_at, created_at, renewed_at, released_at,
    renewals, transitions)
SELECT 'm-' || g, 'h-' || (g % 7), nextval('leasing_fence_token_seq'), now(),
       now() + CASE g % 3 WHEN 0 THEN interval '1 hour' ELSE interval '-1 hour' END, now(), NULL,
       CASE WHEN g % 3 = 1 THEN now() - interval '2 hours' END, 0, 1
FROM generate_series(1, 3000) AS g
"""
LATEST = {
    "leasing_lease_expires_idx",
    "leasing_lease_holder_d453b376",
    "leasing_lease_live_res_idx",
    "leasing_lease_pkey",
    "leasing_lease_released_res_idx",
    "leasing_lease_resource_5aa0f567_like",
    "leasing_lease_resource_key",
}
AT_0001 = (LATEST - {"leasing_lease_live_res_idx", "leasing_lease_released_res_idx"}) | {
    "leasing_lease_holder_d453b376_like"
}


def indexes() -> set[str]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT indexname FROM pg_indexes WHERE tablename = 'leasing_lease'")
        return {name for (name,) in cursor.fetchall()}


def states() -> tuple[int, int, int, int]:
    return (
        Lease.objects.count(),
        Lease.objects.active().count(),
        Lease.objects.expired().count(),
        Lease.objects.released().count(),
    )


def test_leasing_back_to_0001_and_forward_again_with_rows() -> None:
    with connection.cursor() as cursor:
        cursor.execute(ROWS)
    before = states()
    assert before == (3000, 1000, 1000, 1000)
    assert indexes() == LATEST
    try:
        call_command("migrate", "leasing", "0001", verbosity=0)
        assert indexes() == AT_0001
        assert states() == before
        with connection.cursor() as cursor:  # the twin is a pattern-ops index again (prefix searches)
            cursor.execute("SELECT indexdef FROM pg_indexes WHERE indexname = 'leasing_lease_holder_d453b376_like'")
            assert "varchar_pattern_ops" in cursor.fetchone()[0]
    finally:
        call_command("migrate", "leasing", verbosity=0)
    assert indexes() == LATEST
    assert states() == before
    out = io.StringIO()
    call_command("makemigrations", "leasing", "--check", "--dry-run", stdout=out)
    assert "No changes detected" in out.getvalue()
