"""The lease() context manager against a real server: renewal threads use their own connections."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.db import connections, transaction

from leasing import LeaseAcquisitionError, LeaseLost, lease
from leasing.holder import LeaseHolder, backoff_delay
from leasing.models import Lease
from leasing.signals import lease_acquired, lease_lost, lease_released, lease_renewed
from tests.helpers import wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("short_leasing")]


async def close_executor_connections() -> None:
    # Like Django's async views, sync_to_async keeps a connection in its executor thread.
    await sync_to_async(connections.close_all)()


def other_connection_sees(resource: str, token: int) -> bool:
    """Ask through a second connection, as another replica would."""
    conn = connections.create_connection("default")
    try:
        with conn.cursor() as cursor:
            cursor.execute(
                "SELECT 1 FROM leasing_lease WHERE resource = %s AND token = %s"
                " AND released_at IS NULL AND expires_at > statement_timestamp()",
                [resource, token],
            )
            return cursor.fetchone() is not None
    finally:
        conn.close()


def test_with_block_acquires_and_releases() -> None:
    with lease("reports:daily", ttl=5, timeout=0) as held:
        assert held.token > 0
        assert not held.lost
        held.check()
        assert other_connection_sees("reports:daily", held.token)
    row = Lease.objects.get(resource="reports:daily")
    assert row.released_at is not None
    assert not held.lost  # released cleanly, never lost


def test_default_holder_id_is_host_pid_and_unique_suffix() -> None:
    import os
    import socket

    first, second = LeaseHolder("r"), LeaseHolder("r")
    host, pid, suffix = first.holder.rsplit(":", 2)
    assert (host, int(pid)) == (socket.gethostname(), os.getpid())
    assert suffix and first.holder != second.holder
    assert LeaseHolder("r", holder="mine").holder == "mine"


def test_timeout_zero_tries_once() -> None:
    with lease("r", ttl=5, timeout=0), pytest.raises(LeaseAcquisitionError, match="held by another"):
        lease("r", ttl=5, timeout=0).acquire()


def test_acquire_waits_with_backoff_until_the_timeout() -> None:
    attempts: list[Any] = []

    def count(sender: Any, **kwargs: Any) -> None:
        attempts.append(kwargs)

    with lease("r", ttl=5, timeout=0):
        started = time.monotonic()
        with pytest.raises(LeaseAcquisitionError):
            lease("r", ttl=5, timeout=0.3).acquire()
        assert time.monotonic() - started >= 0.3


def test_acquire_succeeds_once_the_holder_releases() -> None:
    first = lease("r", ttl=5, timeout=0).acquire()
    result: dict[str, Any] = {}
    trying = threading.Event()

    def contender() -> None:
        trying.set()
        try:
            with lease("r", ttl=5, timeout=20) as held:
                result["token"] = held.token
        finally:
            connections.close_all()

    thread = threading.Thread(target=contender)
    thread.start()
    trying.wait(5)
    first.release()
    thread.join(30)
    assert result["token"] > first.token


def test_backoff_is_capped_and_jittered() -> None:
    delays = [backoff_delay(attempt, 0.05, 2.0) for attempt in range(20)]
    assert all(0.025 <= d <= 0.05 for d in delays[:1])
    assert all(1.0 <= d <= 2.0 for d in delays[10:])
    assert len({round(d, 6) for d in delays[10:]}) > 1


def test_heartbeat_keeps_the_lease_for_five_ttls_on_its_own_connection() -> None:
    ttl = 0.6
    with lease("r", ttl=ttl, timeout=0) as held:
        token = held.token
        end = time.monotonic() + 5.5 * ttl
        while time.monotonic() < end:
            # If renewals stopped, the lease would expire within one TTL and this would fail.
            assert other_connection_sees("r", token), "lease expired while held"
            assert not held.wait_lost(ttl / 6), held.lost_reason
        assert held.token == token
    row = Lease.objects.get(resource="r")
    assert row.renewals >= 10  # about three renewals per TTL
    assert row.token == token
    assert row.released_at is not None


def test_revoked_lease_is_noticed_at_the_next_renewal() -> None:
    lost_calls: list[LeaseHolder] = []
    signals_seen: list[str] = []

    def on_signal(sender: Any, reason: str, **kwargs: Any) -> None:
        signals_seen.append(reason)

    lease_lost.connect(on_signal)
    try:
        with lease("r", ttl=1.0, timeout=0, on_lost=lost_calls.append) as held:
            Lease.objects.filter(resource="r").revoke()
            assert held.wait_lost(timeout=5), "loss not detected"
            assert "rejected" in (held.lost_reason or "")
            with pytest.raises(LeaseLost):
                held.check()
    finally:
        lease_lost.disconnect(on_signal)
    assert lost_calls == [held]
    assert len(signals_seen) == 1


def test_wait_lost_returns_false_while_held() -> None:
    with lease("r", ttl=2, timeout=0) as held:
        assert held.wait_lost(timeout=0.05) is False


def test_lease_taken_inside_a_transaction_is_visible_to_others_at_once() -> None:
    with transaction.atomic(), lease("r", ttl=5, timeout=0) as held:
        assert other_connection_sees("r", held.token)
    assert Lease.objects.get(resource="r").released_at is not None


def test_lease_survives_the_callers_rollback() -> None:
    seen: dict[str, int] = {}

    def body() -> None:
        with transaction.atomic(), lease("r", ttl=5, timeout=0) as held:
            seen["token"] = held.token
            raise RuntimeError("body failed")

    with pytest.raises(RuntimeError):
        body()
    token = seen["token"]
    row = Lease.objects.get(resource="r")
    assert row.token == token
    assert row.released_at is not None  # released, not rolled back into nonexistence


def test_signals_are_sent_for_each_transition() -> None:
    seen: list[tuple[str, int]] = []
    receivers = {
        "acquired": lease_acquired,
        "renewed": lease_renewed,
        "released": lease_released,
    }

    def make(name: str) -> Any:
        def receiver(sender: Any, grant: Any, **kwargs: Any) -> None:
            seen.append((name, grant.token))

        return receiver

    handlers = {name: make(name) for name in receivers}
    for name, signal in receivers.items():
        signal.connect(handlers[name])
    try:
        with lease("r", ttl=0.3, timeout=0) as held:
            wait_until(lambda: any(name == "renewed" for name, _ in seen), timeout=5, what="a renewal")
    finally:
        for name, signal in receivers.items():
            signal.disconnect(handlers[name])
    names = [name for name, _ in seen]
    assert names[0] == "acquired" and names[-1] == "released" and "renewed" in names
    assert {token for _, token in seen} == {held.token}


def test_async_form_acquires_renews_and_releases() -> None:
    async def body() -> tuple[int, bool]:
        async with lease("r", ttl=0.5, timeout=0) as held:
            end = time.monotonic() + 3
            while time.monotonic() < end:
                assert not held.lost
                await asyncio.sleep(0.05)
            result = held.token, held.lost
        await close_executor_connections()
        return result

    token, lost = asyncio.run(body())
    assert not lost
    row = Lease.objects.get(resource="r")
    assert row.token == token and row.renewals >= 4 and row.released_at is not None


def test_async_form_raises_when_held() -> None:
    async def body() -> None:
        try:
            async with lease("r", ttl=5, timeout=0), lease("r", ttl=5, timeout=0.1):
                pass
        finally:
            await close_executor_connections()

    with pytest.raises(LeaseAcquisitionError):
        asyncio.run(body())


def test_invalid_arguments_are_rejected() -> None:
    with pytest.raises(ValueError, match="renew_interval"):
        lease("r", ttl=1, renew_interval=2)
    with pytest.raises(ValueError, match="timeout"):
        lease("r", timeout=-1)
