"""Breaker 32's window race where it was seen (1 run in 6): through PgBouncer in transaction pooling.
One client holds an uncommitted windowed enqueue of a key; another's enqueue of the key waits for it,
longer than the window; the first rolls back. The waiter's window must start once it got the key,
and the key's lock must not outlive the statement's transaction on the pooled server connections
(invariant 13: no session state for the next client)."""

from __future__ import annotations

import datetime as dt
import threading
from typing import Any

import psycopg
import pytest
from django.db import connection

from tasks.lifecycle import statements as sql
from tests.helpers import enqueue_params, wait_until
from tests.helpers.pgbouncer import Bouncer

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

WINDOW = 2.0


def params(key: str) -> dict[str, Any]:
    return enqueue_params(queue="pooled", dedup_key=key, unique_for=WINDOW)


def let_the_clock_pass(seconds: float) -> None:
    until = direct("SELECT clock_timestamp()")[0] + dt.timedelta(seconds=seconds)
    wait_until(lambda: direct("SELECT clock_timestamp()")[0] > until, seconds + 30, what=f"{seconds} s to pass")


def direct(query: str, args: Any = None) -> Any:
    with connection.cursor() as cursor:
        cursor.execute(query, args)
        return cursor.fetchone()


def test_a_window_through_pgbouncer_starts_once_the_rolled_back_insert_let_its_key_go(
    bouncer_pool_of_2: Bouncer,
) -> None:
    conninfo = bouncer_pool_of_2.conninfo(connection.settings_dict["NAME"])
    for key in ("pooled:1", "pooled:2", "pooled:3"):
        holder = psycopg.connect(conninfo, prepare_threshold=None)
        result: dict[str, Any] = {}

        def wait_for_the_key(key: str = key, result: dict[str, Any] = result) -> None:
            with psycopg.connect(conninfo, autocommit=True, prepare_threshold=None) as waiter:
                result["row"] = waiter.execute(sql.ENQUEUE_UNIQUE_SQL, params(key)).fetchone()

        try:
            held = holder.execute(sql.ENQUEUE_UNIQUE_SQL, params(key)).fetchone()
            assert held is not None and held[1] is not None  # inserted, not committed
            thread = threading.Thread(target=wait_for_the_key, daemon=True)
            thread.start()
            wait_until(
                lambda: (
                    direct(
                        "SELECT count(*) FROM pg_stat_activity"
                        " WHERE datname = current_database() AND wait_event_type = 'Lock'"
                    )[0]
                    >= 1
                ),
                30,
                what="the second enqueue waiting for the key",
            )
            let_the_clock_pass(WINDOW * 1.5)
            released_at = direct("SELECT clock_timestamp()")[0]
            holder.rollback()
            thread.join(30)
            assert not thread.is_alive()
        finally:
            holder.close()
        task_id, enqueued_at = result["row"]
        assert enqueued_at is not None  # the waiter got the key and inserted its task
        accepted_at, expires_at = direct(
            "SELECT accepted_at, expires_at FROM tasks_uniquekey WHERE key = %s AND task_id = %s", [key, task_id]
        )
        assert accepted_at >= released_at, f"{key}: the window starts at {accepted_at}, before {released_at}"
        # Finished, inside its window: a third enqueue through the pooler is refused.
        direct("UPDATE tasks_task SET status = 'CANCELLED', finished_at = now() WHERE id = %s RETURNING id", [task_id])
        assert direct("SELECT clock_timestamp() < %s", [expires_at])[0], "too slow to prove anything"
        with psycopg.connect(conninfo, autocommit=True, prepare_threshold=None) as third:
            assert third.execute(sql.ENQUEUE_UNIQUE_SQL, params(key)).fetchone() is None
        # No key lock outlived its transaction on either server connection.
        assert (
            direct(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
                " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
            )[0]
            == 0
        )
    assert direct("SELECT count(*) FROM tasks_task WHERE queue = 'pooled'")[0] == 3
