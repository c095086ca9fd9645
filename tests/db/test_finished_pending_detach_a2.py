"""A retirement interrupted half-way (``manage.py tasks_partitions retire`` cancelled while its DETACH
... CONCURRENTLY waits for old snapshots, or its process killed) leaves its partition's detach
pending: the partition takes no row from then on. The mover, with tasks of that day still to move,
failed every batch on it and never went past the day (each pass raised IntegrityError, later days
never moved); and the keeper finished the detach only once the day passed its status's retention,
never where the status is kept for ever. Now the mover passes over the day (its rows stay) and the
next retirement finishes the detach whatever the cutoffs, once the interrupted holder's lease is
gone (its TTL), so the day's rows move at the pass after."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from django.db import connection
from django.db.models.functions import Now

from leasing.models import Lease
from tasks.maintenance.archive import Archiver
from tasks.maintenance.partitions import RETIREMENT_LEASE, PartitionKeeper, create_day, partitions
from tests.db.test_finished_mover import finished_at, roll_up_hours, where
from tests.db.test_finished_retire_overlaps import DAY, DOOMED, leave_a_detach_pending, no_partitions_left

pytestmark = pytest.mark.django_db(transaction=True)

__all__ = ["no_partitions_left"]  # its autouse fixture: no partition before or after each test

UTC = dt.timezone.utc
LATER = DAY + dt.timedelta(days=4)


@pytest.fixture(autouse=True)
def kept_for_ever(settings: Any) -> None:
    settings.LEASING_TASKS = {"ARCHIVE_AFTER": "10m", "RETENTION": {"SUCCESSFUL": None}}


def noon(day: dt.date) -> dt.datetime:
    return dt.datetime(day.year, day.month, day.day, 12, tzinfo=UTC)


def pending() -> list[str]:
    return [p.name for p in partitions() if p.detach_pending]


def test_the_mover_passes_over_a_day_whose_detach_is_pending_and_the_next_retirement_finishes_it() -> None:
    create_day("SUCCESSFUL", DAY)
    stuck, later = finished_at(noon(DAY)), finished_at(noon(LATER))
    leave_a_detach_pending()
    # The interrupted retirement's holder died holding the lease (a process killed: nothing released it).
    assert Lease.objects.acquire(RETIREMENT_LEASE, "killed-retirement", 30) is not None
    roll_up_hours()
    mover = Archiver(interval=0.0)
    assert mover.run_for(60.0) == 1  # the later day moved; the pending day's task stays, no error
    assert where(stuck) == "tasks_task"
    assert where(later) == f"tasks_finished_successful_{LATER:%Y%m%d}"
    keeper = PartitionKeeper(interval=0.0)
    done = keeper.run_once(force=True)
    assert done is not None and done.retired == []  # the lease is the dead holder's until its TTL
    assert pending() == [DOOMED]
    Lease.objects.filter(resource=RETIREMENT_LEASE).update(expires_at=Now())  # its TTL passed
    done = keeper.run_once(force=True)
    assert done is not None and done.retired == [DOOMED]  # SUCCESSFUL is kept for ever: no cutoff
    assert pending() == []
    with connection.cursor() as cursor:
        cursor.execute("SELECT to_regclass(%s)", [DOOMED])
        assert cursor.fetchone() == (None,)
    # The day is made again for its rows, which move at the next pass.
    assert Archiver(interval=0.0).run_for(60.0) == 1
    assert where(stuck) == DOOMED
