"""Regression: an acquire that waited behind a row lock must stamp its grant *after* the wait.

Found by the race test: with the token taken from EXCLUDED (drawn before the wait) tokens went
backwards, and with statement_timestamp() a grant's start preceded the release it waited for.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from django.db import connections

from leasing.models import FENCE_SEQUENCE, Lease, acquire_on
from tests.helpers import wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def blocked_on_a_lock(pid: int) -> bool:
    with connections["default"].cursor() as cursor:
        cursor.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", [pid])
        row = cursor.fetchone()
    return bool(row) and row[0] == "Lock"


def test_acquire_queued_behind_a_release_gets_a_later_token_and_start() -> None:
    grant = Lease.objects.acquire("r", "old-holder", ttl=30)
    assert grant is not None

    releaser = connections.create_connection("default")
    waiter = connections.create_connection("default")
    try:
        releaser.set_autocommit(False)
        with releaser.cursor() as cursor:  # release, but keep the row locked (uncommitted)
            cursor.execute(
                "UPDATE leasing_lease SET released_at = clock_timestamp() WHERE resource = 'r' RETURNING released_at"
            )
            released_at = cursor.fetchone()[0]

        waiter.ensure_connection()
        waiter.inc_thread_sharing()
        waiter_pid = waiter.connection.info.backend_pid
        result: dict[str, Any] = {}
        thread = threading.Thread(target=lambda: result.update(grant=acquire_on(waiter, "r", "new-holder", 30)))
        thread.start()
        wait_until(lambda: blocked_on_a_lock(waiter_pid), what="the acquire to block on the row lock")

        # A grant elsewhere draws a token while our acquire waits.
        with connections["default"].cursor() as cursor:
            cursor.execute(f"SELECT nextval('{FENCE_SEQUENCE}')")
            token_drawn_meanwhile = cursor.fetchone()[0]

        releaser.commit()
        thread.join(10)
    finally:
        releaser.close()
        if waiter.connection is not None:
            waiter.dec_thread_sharing()
        waiter.close()

    taken = result["grant"]
    assert taken is not None
    assert taken.token > token_drawn_meanwhile, "token was drawn before the lock wait"
    assert taken.acquired_at >= released_at, "grant starts before the release it waited for"
