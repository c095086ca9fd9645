"""Two retirements of one day at once (the leader's partition keeper and ``manage.py tasks_partitions
retire`` by hand, or a new leader while the last term's detach still waits), and the catalog read of
the partitions (a ``/metrics`` scrape, the mover's pass) beside a detach that holds its partition
(issue 56): the second retirement leaves the day to the first, the read waits for neither, and the
day is retired once."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from django.db import connection
from django.test import Client

from tasks.maintenance.archive import Archiver
from tasks.maintenance.partitions import PARTITIONS_SQL, STATUS_TABLES, create_day, partitions, retire_before
from tests.db.test_finished_partitions import drop_partitions
from tests.helpers import wait_until
from tests.helpers.connections import OnItsOwnConnection, waits_for_a_lock

pytestmark = pytest.mark.django_db(transaction=True)  # DETACH PARTITION ... CONCURRENTLY: no transaction

UTC = dt.timezone.utc
DAY = dt.date(2020, 1, 1)
PARENT = "tasks_finished_successful"
DOOMED = f"tasks_finished_successful_{DAY:%Y%m%d}"
CUTOFF = dt.datetime(2020, 1, 2, tzinfo=UTC)


@pytest.fixture(autouse=True)
def no_partitions_left(settings: Any) -> Iterator[None]:
    settings.LEASING_METRICS_PUBLIC = True
    drop_partitions()
    yield
    drop_partitions()


def params() -> dict[str, Any]:
    return connection.get_connection_params()


def hold_the_parent(reader: psycopg.Connection[Any]) -> None:
    """An old snapshot that locks the status table but none of its partitions: a detach's second
    transaction (DETACH ... CONCURRENTLY) waits for it, and so does a FINALIZE, holding the partition."""
    reader.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    reader.execute("SELECT 1").fetchone()  # the snapshot
    reader.execute(f"LOCK TABLE ONLY {PARENT} IN ACCESS SHARE MODE")


def attached() -> list[str]:
    return [p.name for p in partitions() if p.name == DOOMED]


def leave_a_detach_pending() -> None:
    """A DETACH ... CONCURRENTLY interrupted in its second transaction (its session cancelled): the
    partition stays marked pending, for the next retirement to FINALIZE."""
    with psycopg.connect(**params(), autocommit=True) as reader:
        hold_the_parent(reader)
        detach = OnItsOwnConnection(
            lambda: connection.cursor().execute(f'ALTER TABLE {PARENT} DETACH PARTITION "{DOOMED}" CONCURRENTLY')
        )
        detach.start()
        detach.ready.wait(20)
        wait_until(lambda: waits_for_a_lock(detach.pid), 20, what="the detach to wait for the reader")
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_cancel_backend(%s)", [detach.pid])
        with pytest.raises(Exception, match="cancel"):
            detach.outcome()
        reader.execute("COMMIT")
    assert [p.detach_pending for p in partitions() if p.name == DOOMED] == [True]


def test_a_second_retirement_of_a_day_leaves_it_to_the_first() -> None:
    """The first retirement's detach waits for an old snapshot; a second one run meanwhile neither
    starts another nor FINALIZEs the first's (which would hold the partition until the snapshot ends,
    queueing every reader of the catalog behind it): it returns at once, and the day is retired once."""
    create_day("SUCCESSFUL", DAY)
    with psycopg.connect(**params(), autocommit=True) as reader:
        hold_the_parent(reader)
        first = OnItsOwnConnection(lambda: retire_before(CUTOFF, statuses=["SUCCESSFUL"]))
        first.start()
        first.ready.wait(20)
        try:
            wait_until(lambda: waits_for_a_lock(first.pid), 20, what="the first detach to wait for the reader")
            second = OnItsOwnConnection(lambda: retire_before(CUTOFF, statuses=["SUCCESSFUL"]))
            second.start()
            wait_until(lambda: not second.is_alive(), 30, what="the second retirement to return")
            assert second.outcome() == []
            assert waits_for_a_lock(first.pid)  # the first still waits, its detach its own
        finally:
            reader.execute("COMMIT")
        assert first.outcome() == [DOOMED]
    assert attached() == []
    with connection.cursor() as cursor:
        cursor.execute("SELECT to_regclass(%s)", [DOOMED])
        assert cursor.fetchone() == (None,)
    assert retire_before(CUTOFF, statuses=["SUCCESSFUL"]) == []  # nothing left to retire


def test_the_partitions_read_waits_for_no_finalize(client: Client) -> None:
    """A retirement finishing a detach left pending (FINALIZE) holds the partition while it waits for
    every older snapshot, among them a read of the partitions begun before it (a scrape's statement,
    here a transaction's): reading that partition's size would wait for the FINALIZE, which waits for
    the read, and PostgreSQL would end one of them ("deadlock detected"). The read leaves the sizes
    of partitions being detached unread: the scrape answers with the database's series, the mover's
    pass plans, and the retirement ends once the snapshots have."""
    create_day("SUCCESSFUL", DAY)
    create_day("SUCCESSFUL", DAY + dt.timedelta(days=1))
    leave_a_detach_pending()
    with (
        psycopg.connect(**params(), autocommit=True) as reader,
        psycopg.connect(**params(), autocommit=True) as scrape,
    ):
        hold_the_parent(reader)
        scrape.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        scrape.execute("SELECT 1").fetchone()  # its snapshot, older than the FINALIZE's
        finalize = OnItsOwnConnection(lambda: retire_before(CUTOFF, statuses=["SUCCESSFUL"]))
        finalize.start()
        finalize.ready.wait(20)
        try:
            wait_until(lambda: waits_for_a_lock(finalize.pid), 20, what="the FINALIZE to wait for old snapshots")
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT mode FROM pg_locks WHERE pid = %s AND relation = to_regclass(%s) AND granted",
                    [finalize.pid, DOOMED],
                )
                assert cursor.fetchall() == [("AccessExclusiveLock",)]  # it holds the partition
            read = OnItsOwnConnection(
                lambda: scrape.execute(PARTITIONS_SQL, {"parents": list(STATUS_TABLES.values())}).fetchall()
            )
            read.start()
            wait_until(lambda: not read.is_alive(), 30, what="the read of the partitions")
            listed = read.outcome()
            assert sorted(name for _, name, *_ in listed) == [DOOMED, f"tasks_finished_successful_{DAY:%Y%m}02"]
            scrape.execute("COMMIT")
            # A scrape and a mover's pass begun now: no older than the FINALIZE, yet its partition is
            # held until the reader ends.
            scraped = OnItsOwnConnection(lambda: client.get("/metrics"))
            scraped.start()
            wait_until(lambda: not scraped.is_alive(), 30, what="the scrape to answer")
            body = scraped.outcome().content.decode()
            assert 'tasks_finished_partitions{database="default",status="SUCCESSFUL"} 2.0' in body
            assert 'leasing_database_up{database="default"} 1.0' in body
            passed = OnItsOwnConnection(lambda: Archiver(interval=0.0).run_for(1.0))
            passed.start()
            wait_until(lambda: not passed.is_alive(), 30, what="the mover's pass")
            passed.outcome()
            assert waits_for_a_lock(finalize.pid)
        finally:
            reader.execute("COMMIT")
        assert finalize.outcome() == [DOOMED]
    assert attached() == []
