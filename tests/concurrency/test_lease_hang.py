"""A renewal that hangs does not delay the loss: on_lost and lease_lost arrive by the local deadline.

Two real hangs: the lease row locked by somebody's open transaction (the renewal waits on the
lock until its lock_timeout), and the server process of the heartbeat's connection frozen with
SIGSTOP, as a frozen network looks to the client (no statement timeout can end that wait).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from django.db import connection, connections

from leasing import clock
from leasing.holder import DEADLINE_PASSED, LeaseHolder
from leasing.models import Lease
from leasing.signals import lease_lost, lease_renewed
from tests.helpers import wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("short_leasing")]

#: Text only the renewal statement (leasing.models.RENEW_SQL) contains.
RENEWAL_TEXT = "%renewals = renewals + 1%"


class Announcements:
    """What the body would be told: on_lost calls and lease_lost signals, with clock readings."""

    def __init__(self) -> None:
        self.on_lost: list[tuple[float, str]] = []
        self.signals: list[tuple[float, str]] = []
        self.renewals = 0
        self.both = threading.Event()
        self._lock = threading.Lock()

    def record_on_lost(self, held: LeaseHolder) -> None:
        with self._lock:
            self.on_lost.append((clock.monotonic(), threading.current_thread().name))
            self._check()

    def record_signal(self, sender: Any, reason: str, **kwargs: Any) -> None:
        with self._lock:
            self.signals.append((clock.monotonic(), reason))
            self._check()

    def record_renewal(self, sender: Any, **kwargs: Any) -> None:
        with self._lock:
            self.renewals += 1

    def _check(self) -> None:
        if self.on_lost and self.signals:
            self.both.set()


@pytest.fixture
def announced_with_renewals() -> Iterator[Announcements]:
    seen = Announcements()
    lease_lost.connect(seen.record_signal)
    lease_renewed.connect(seen.record_renewal)
    try:
        yield seen
    finally:
        lease_lost.disconnect(seen.record_signal)
        lease_renewed.disconnect(seen.record_renewal)


@contextmanager
def row_locked(resource: str) -> Iterator[None]:
    """Another session holds the lease row with FOR UPDATE in an open transaction."""
    blocker = connections.create_connection("default")
    try:
        with blocker.cursor() as cursor:
            cursor.execute("BEGIN")
            cursor.execute("SELECT 1 FROM leasing_lease WHERE resource = %s FOR UPDATE", [resource])
            assert cursor.fetchone() is not None
            yield
            cursor.execute("ROLLBACK")
    finally:
        blocker.close()


def renewal_waiting_on_lock() -> bool:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND pid <> pg_backend_pid() AND wait_event_type = 'Lock' AND query LIKE %s",
            [RENEWAL_TEXT],
        )
        return cursor.fetchone()[0] > 0


def assert_on_time(announced_with_renewals: Announcements, deadline: float) -> None:
    """Announced once, for the deadline, by the watchdog, not before the deadline. That it came while
    the renewal still hung is the caller's: it waits for it inside the hang. How soon after the
    deadline it comes is a figure of the machine's load, not a verdict."""
    [(on_lost_at, thread)] = announced_with_renewals.on_lost
    [(signal_at, reason)] = announced_with_renewals.signals
    assert reason == DEADLINE_PASSED
    assert thread.startswith("lease-lost:"), thread
    assert deadline <= on_lost_at and deadline <= signal_at


def test_renewal_blocked_by_a_row_lock_is_announced_lost_at_the_local_deadline(
    announced_with_renewals: Announcements, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="leasing")
    held = LeaseHolder("r", ttl=1.0, timeout=0, on_lost=announced_with_renewals.record_on_lost).acquire()
    try:
        with row_locked("r"):
            wait_until(renewal_waiting_on_lock, timeout=5, what="the renewal to wait on the row lock")
            # The body is busy elsewhere: it neither checks `lost` nor waits for the loss.
            assert announced_with_renewals.both.wait(10), "loss not announced"
            assert_on_time(announced_with_renewals, held._deadline)
            # The renewal did not hang on the lock: its lock_timeout ended it, and it was retried.
            assert "lock timeout" in caplog.text or "statement timeout" in caplog.text
            # The row is still locked: the release cannot land, but returns (inside the lock's hold).
            assert held.release() is False
            heartbeat = held._thread
            assert heartbeat is not None
            heartbeat.join(5)
            assert not heartbeat.is_alive()
    finally:
        held.release()
    assert held.lost and held.lost_reason == DEADLINE_PASSED
    assert len(announced_with_renewals.on_lost) == 1 and len(announced_with_renewals.signals) == 1


def test_renewal_blocked_for_less_than_the_deadline_keeps_the_lease(announced_with_renewals: Announcements) -> None:
    with LeaseHolder("r", ttl=2.0, timeout=0, on_lost=announced_with_renewals.record_on_lost) as held:
        with row_locked("r"):
            wait_until(renewal_waiting_on_lock, timeout=5, what="the renewal to wait on the row lock")
            renewals = announced_with_renewals.renewals
        # The lock is gone well before the local deadline (the renewal waited a few ms of the 1.3 s
        # left): the blocked renewal, or its retry, lands and the holder goes on renewing.
        wait_until(lambda: announced_with_renewals.renewals >= renewals + 2, timeout=5, what="two more renewals")
        assert not held.lost, held.lost_reason
        token = held.token
    assert announced_with_renewals.on_lost == [] and announced_with_renewals.signals == []
    row = Lease.objects.get(resource="r")
    assert row.token == token and row.released_at is not None


def heartbeat_backend() -> int:
    """The server process of the heartbeat's connection, idle after its last renewal."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
            " AND state = 'idle' AND query LIKE %s",
            [RENEWAL_TEXT],
        )
        rows = cursor.fetchall()
    return rows[0][0] if len(rows) == 1 else 0


def backend_state(pid: int) -> str | None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT state FROM pg_stat_activity WHERE pid = %s", [pid])
        row = cursor.fetchone()
    return row[0] if row else None


def is_local_server_process(pid: int) -> bool:
    settings = connection.settings_dict
    host = (settings.get("OPTIONS") or {}).get("host") or settings["HOST"] or ""
    if not (host.startswith("/") or host in ("", "localhost", "127.0.0.1", "::1")):
        return False
    try:
        if not Path(f"/proc/{pid}/comm").read_text().startswith("postgres"):
            return False
        os.kill(pid, 0)  # allowed to signal it?
    except OSError:
        return False
    return True


@contextmanager
def frozen_while_idle(pid: int) -> Iterator[None]:
    """SIGSTOP a backend between two statements, so that it holds no lock while frozen."""
    for _ in range(50):
        os.kill(pid, signal.SIGSTOP)
        # A backend reports 'active' before it runs a statement: 'idle' now means it holds nothing.
        if backend_state(pid) == "idle":
            break
        os.kill(pid, signal.SIGCONT)
        wait_until(lambda: backend_state(pid) == "idle", timeout=5, what="the backend to go idle")
    else:
        raise AssertionError("could not freeze the heartbeat's backend between statements")
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def test_renewal_hanging_on_a_frozen_server_is_announced_lost_at_the_local_deadline(
    announced_with_renewals: Announcements,
) -> None:
    held = LeaseHolder("r", ttl=1.0, timeout=0, on_lost=announced_with_renewals.record_on_lost).acquire()
    heartbeat = held._thread
    assert heartbeat is not None
    try:
        pid = wait_until(heartbeat_backend, timeout=5, what="the heartbeat's first renewal")
        if not is_local_server_process(pid):
            pytest.skip("the database server is not a local process of this user")
        with frozen_while_idle(pid):
            # The next renewal goes out and never comes back; the body is busy elsewhere.
            assert announced_with_renewals.both.wait(10), "loss not announced"
            assert_on_time(announced_with_renewals, held._deadline)
            held.release()  # the bounded join, then a fresh connection
            assert heartbeat.is_alive()  # still inside the frozen renewal: release() did not wait for it
        # Thawed, the stuck renewal is answered (rejected: released or expired) and the thread ends.
        heartbeat.join(10)
        assert not heartbeat.is_alive()
    finally:
        held.release()
    assert not Lease.objects.active().filter(resource="r").exists()
    assert len(announced_with_renewals.on_lost) == 1 and len(announced_with_renewals.signals) == 1
