"""The recovery leader's scans of expired leases (tasks/maintenance/recovery.py, RecoveryWindow):
between full scans it reads only the leases that expired since its last scan began, so beside an
old snapshot a round no longer steps over every RUNNING version since the snapshot; a row another
session held locked during a scan is taken by the first round after its lock goes."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import psycopg
import pytest
from django.db import connection, transaction

from tasks.maintenance.recovery import RECOVERY_MARGIN, RecoveryWindow, recover_once
from tasks.models import Task
from tests.helpers import db_now, wait_until
from tests.helpers import test_database_url as database_url  # not collected as a test
from tests.helpers.plans import recorded
from tests.helpers.task_paths import NOOP

pytestmark = pytest.mark.django_db(transaction=True)


def expired(*ids: int) -> bool:
    """Every lease of ``ids`` has expired on the database clock."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT bool_and(expires_at <= clock_timestamp()) FROM tasks_task WHERE id = ANY(%s)", [list(ids)]
        )
        return bool(cursor.fetchone()[0])


def claim_briefly(n: int, *, queue: str = "window", ttl: float = 0.2) -> list[int]:
    for _ in range(n):
        Task.objects.enqueue(NOOP, queue=queue)
    claimed = [t.id for t in Task.objects.claim("gone", limit=n, queues=[queue], ttl=ttl)]
    assert len(claimed) == n
    return claimed


def test_a_windowed_round_recovers_the_leases_that_expired_since_the_last_scan() -> None:
    window = RecoveryWindow(full_scan_interval=3600)
    first = recover_once(window=window)
    assert first.full_scan and window.since is not None
    lapsed = claim_briefly(3)
    wait_until(lambda: expired(*lapsed))
    report = recover_once(window=window)
    assert not report.full_scan
    assert sorted(report.requeued) == sorted(lapsed)
    assert set(Task.objects.filter(pk__in=lapsed).values_list("status", flat=True)) == {"READY"}


def test_a_row_held_locked_during_scans_is_recovered_by_the_first_round_after_its_lock_goes() -> None:
    """SKIP LOCKED passes over a row another session holds; the next windows still cover its expiry
    (not only the last second before the last scan), so it is not left to the next full scan."""
    window = RecoveryWindow(full_scan_interval=3600)
    (held,) = claim_briefly(1)
    expiry = Task.objects.get(pk=held).expires_at
    assert expiry is not None
    wait_until(lambda: db_now() > expiry + RECOVERY_MARGIN * 2)  # older than any window's margin
    with psycopg.connect(database_url(), autocommit=False) as other:
        other.execute("SELECT 1 FROM tasks_task WHERE id = %s FOR UPDATE", [held])  # someone holds it
        report = recover_once(window=window)
        assert (report.full_scan, report.requeued) == (True, [])  # skipped
        report = recover_once(window=window)
        assert (report.full_scan, report.requeued) == (False, [])  # still held
        other.rollback()
    report = recover_once(window=window)
    assert (report.full_scan, report.requeued) == (False, [held])
    assert window.since is not None and window.since > expiry  # nothing left behind now


def _blocks(sql: str, params: Any) -> int:
    """Blocks the whole statement touches, run again under EXPLAIN (ANALYZE, BUFFERS) and rolled back."""
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sql, params)
        plan = cursor.fetchone()[0][0]["Plan"]
        transaction.set_rollback(True)
    return int(plan["Shared Hit Blocks"] + plan["Shared Read Blocks"])


LEASE = 3.0


def test_beside_an_old_snapshot_a_windowed_round_reads_few_blocks(old_snapshot: None) -> None:
    Task.objects.bulk_enqueue(NOOP, [{}] * 6000, queue="history")
    # Short leases, past soon after. On a loaded machine a claim's lease may lapse before its finish,
    # which the compare-and-set then refuses: those tasks are requeued once their lease is past and
    # claimed again, so that every task ends SUCCESSFUL whatever the machine's speed.
    while Task.objects.filter(queue="history").exclude(status="SUCCESSFUL").exists():
        batch = Task.objects.claim("busy", limit=500, queues=["history"], ttl=LEASE)
        assert batch, "unfinished tasks and none to claim"
        accepted = Task.objects.complete_many("busy", [(t.id, t.token, json.dumps(None)) for t in batch])
        lapsed = [t for t in batch if (t.id, t.token) not in accepted]
        if lapsed:
            expiry = max(t.expires_at for t in lapsed)
            wait_until(lambda: db_now() > expiry)  # noqa: B023 (read at once, in this iteration)
            assert {r.id for r in Task.objects.recover_expired()} == {t.id for t in lapsed}
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE tasks_task")
        cursor.execute("SELECT count(*) FROM tasks_task WHERE status = 'SUCCESSFUL'")
        assert cursor.fetchone()[0] == 6000
    # 6,000 dead RUNNING versions, still in the expiry index beside the snapshot, their leases (LEASE)
    # past by more than the margin before the first scan begins.
    last = Task.objects.latest("finished_at").finished_at + dt.timedelta(seconds=LEASE) + RECOVERY_MARGIN
    wait_until(lambda: db_now() > last + dt.timedelta(seconds=0.1))
    window = RecoveryWindow(full_scan_interval=3600)
    with recorded() as statements:
        full = recover_once(window=window)
        windowed = recover_once(window=window)
    assert (full.full_scan, windowed.full_scan, full.requeued, windowed.requeued) == (True, False, [], [])
    picks = [(sql, params) for sql, params in statements if "recovered AS (" in sql]
    (full_sql, full_params), (windowed_sql, windowed_params) = picks
    full_blocks = _blocks(full_sql, full_params)
    windowed_blocks = _blocks(windowed_sql, windowed_params)
    # The case shows the cost: a full scan visits every dead RUNNING version (or the whole table).
    assert full_blocks > 100, (windowed_blocks, full_blocks)
    assert windowed_blocks < 20, (windowed_blocks, full_blocks)
