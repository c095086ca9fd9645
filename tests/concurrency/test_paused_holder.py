"""A holder paused past its TTL loses its lease, and storage fenced by the token rejects it."""

from __future__ import annotations

import os
import signal

import pytest

from leasing.fencing import fenced_update
from leasing.models import Lease
from tests.helpers import ensure_ended, read_message, send, start_child, wait_until
from tests.testapp.models import FencedRecord

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def test_sigstopped_holder_loses_the_lease_and_its_fenced_write_is_rejected(holder_id: str) -> None:
    FencedRecord.objects.create(key="report")
    with start_child("hold", "report-lock", "1.0", "report") as child, ensure_ended(child):
        first = read_message(child)
        assert first["acquired"]
        old_token = first["token"]

        os.kill(child.pid, signal.SIGSTOP)
        # Nobody renews now; wait (database clock) until the lease is free, then take it over.
        grant = wait_until(lambda: Lease.objects.acquire("report-lock", holder_id, ttl=30), timeout=15, what="takeover")
        assert grant.token > old_token
        fenced_update(FencedRecord.objects.filter(key="report"), grant.token, value="written by the new holder")

        os.kill(child.pid, signal.SIGCONT)
        send(child, {"write": True})
        verdict = read_message(child)
        assert verdict["lost"] is True
        assert verdict["write"].startswith("rejected"), verdict
        assert verdict["reason"]
        assert read_message(child)["done"]
        assert child.wait(30) == 0

    row = FencedRecord.objects.get(key="report")
    assert (row.value, row.fence_token) == ("written by the new holder", grant.token)
    # The stale holder's exit did not release the new holder's lease.
    assert Lease.objects.is_current("report-lock", grant.token)


def test_stalled_renewal_is_rejected_by_the_database_after_takeover(holder_id: str) -> None:
    """The heartbeat statement itself fails once another holder took over (no local deadline involved)."""
    from django.db import connection

    from leasing.models import renew_on

    grant = Lease.objects.acquire("r", "paused-holder", ttl=0.2)
    assert grant is not None
    taken = wait_until(lambda: Lease.objects.acquire("r", holder_id, ttl=30), what="takeover")
    assert renew_on(connection, "r", "paused-holder", grant.token, 30) is None
    assert Lease.objects.is_current("r", taken.token)
