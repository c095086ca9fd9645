"""Pages, the API, the admin, /metrics and the worker send their statements without JIT compilation
(leasing/bounds.py says why: on a server with JIT, a loose index scan's estimate made PostgreSQL 15
compile the dashboard's key summary for 700 ms that then ran for 0.2 ms)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.db import connection, transaction
from django.test import Client
from django.test.utils import CaptureQueriesContext

from bench.pages import pages
from leasing.bounds import bound, unbound, without_jit
from tasks.lifecycle import concurrency
from tasks.models import Task, TaskStatus, Worker

pytestmark = pytest.mark.django_db(transaction=True)

NO_JIT = "set_config('jit', 'off', true)"


def session_jit() -> str:
    """The session's own value, read on the raw connection (past the execute wrappers)."""
    return connection.connection.execute("SELECT current_setting('jit')").fetchone()[0]


def test_statements_in_the_block_run_without_jit_and_the_session_keeps_its_own() -> None:
    connection.ensure_connection()
    before = session_jit()
    with without_jit(), connection.cursor() as cursor:
        cursor.execute("SELECT current_setting('jit')")
        assert cursor.fetchone() == ("off",)
        with transaction.atomic():
            cursor.execute("SELECT current_setting('jit'), %s::int", [7])
            assert cursor.fetchone() == ("off", 7)
    assert session_jit() == before
    with connection.cursor() as cursor:
        cursor.execute("SELECT current_setting('jit')")
        assert cursor.fetchone() == (before,)


def test_a_bounded_connection_runs_without_jit_too() -> None:
    bound(connection, statement_ms=5000, lock_ms=5000)
    try:
        with without_jit(), connection.cursor() as cursor:  # both prefixes at once
            cursor.execute("SELECT current_setting('jit'), current_setting('statement_timeout')")
            assert cursor.fetchone() == ("off", "5s")
        with connection.cursor() as cursor:
            cursor.execute("SELECT current_setting('jit')")
            assert cursor.fetchone() == ("off",)
    finally:
        unbound(connection)


def test_every_statement_of_every_page_goes_without_jit(client: Client) -> None:
    Worker.objects.create(id="worker-7", hostname="jit", pid=7, concurrency=10, running=1)
    tasks = [Task.objects.enqueue("tests.jobs.noop", queue=queue) for queue in ("default", "mail", "rare", "billing")]
    Task.objects.filter(pk=tasks[0].id).update(status=TaskStatus.FAILED)
    client.force_login(get_user_model().objects.create_superuser("jit", "jit@example.com", "pw"))
    keys = {"newest": tasks[-1].id, "middle": tasks[1].id, "failed": tasks[0].id, "dedup": "none"}
    checked = 0
    for label, url in pages(keys):
        with CaptureQueriesContext(connection) as queries:
            response = client.get(url)
        assert response.status_code == 200, (label, response.status_code)
        ours = [q["sql"] for q in queries.captured_queries if "tasks_" in q["sql"] or "leasing_" in q["sql"]]
        assert ours, label
        for sql in ours:
            assert sql.startswith(f"SELECT {NO_JIT}"), f"{label}: {sql[:200]}"
        checked += len(ours)
    assert checked > 100


def plan_has_jit(cursor: Any) -> bool:
    cursor.execute(
        "EXPLAIN (ANALYZE, FORMAT JSON) " + concurrency.KEY_STATS_SQL, {"limit": concurrency.SHOWN_KEYS, "cap": 10}
    )
    plan = cursor.fetchone()[0]
    plan = json.loads(plan) if isinstance(plan, str) else plan
    return "JIT" in plan[0]


def test_a_server_with_jit_compiles_nothing_for_a_page() -> None:
    """Where the server has JIT (Debian's PostgreSQL 15 in CI; the embedded server is built without
    it), every statement would be compiled at a zero threshold, and with the prefix none is."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_jit_available()")
        if not cursor.fetchone()[0]:
            pytest.skip("this PostgreSQL was built without JIT (the CI leg on Debian's PostgreSQL 15 has it)")
        cursor.execute("SET jit = on; SET jit_above_cost = 0")
        try:
            assert plan_has_jit(cursor)  # the test can fail: the server compiles this statement
            with without_jit():
                assert not plan_has_jit(cursor)
        finally:
            cursor.execute("RESET jit; RESET jit_above_cost")
