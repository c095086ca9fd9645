"""The bounded (pipelined) path's prepared statements are prepared once, not on every run.

Each run of a statement on a connection with the worker's bounds should reuse the statement the
connection prepared the first time (that is the point of preparing). Counted on the server
(pg_prepared_statements) after many runs.


Found by breaker 22 (the bug hunt on issue 22: prepared statements and pipelined bounds)."""

from __future__ import annotations

import pytest
from django.db import connection

from leasing.bounds import bound, unbound
from tasks.models import Task

pytestmark = pytest.mark.django_db(transaction=True)


def server_prepared() -> list[str]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT name FROM pg_prepared_statements ORDER BY name")
        return [row[0] for row in cursor.fetchall()]


def test_a_bounded_statement_is_prepared_once_not_once_per_run(fresh_session):
    bound(connection, statement_ms=5000, lock_ms=1000)
    for _ in range(50):
        Task.objects.claim("pipe-w", queues=["pipe"], ttl=60)
    unbound(connection)
    names = server_prepared()
    # the bounds prefix, the generic-plan prefix (tasks/lifecycle/prepared.py, GENERIC_PLAN) and the
    # claim: three statements, however many runs
    assert len(names) <= 3, f"{len(names)} statements prepared on the server after 50 claims: {names[:6]}..."
