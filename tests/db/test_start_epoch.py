"""The start marker stores the very instant the attempt's TaskResult was told (CI caught a 1 µs
difference between the two: the marker had sent the raw float, the TaskResult its rounded value)."""

from __future__ import annotations

import datetime as dt

import pytest
from django.db import connection

from tasks.lifecycle.values import ClaimedTask
from tasks.runtime import Execution
from tasks.worker.mailbox import Mailbox

pytestmark = pytest.mark.django_db

# Epochs whose raw float and its value rounded to whole microseconds land on different microseconds
# in PostgreSQL's to_timestamp() (found by converting 200,000 random epochs both ways).
DISAGREEING = [1795464906.0180745, 1795448207.4851365, 1795498088.0271955]


def _execution() -> Execution:
    now = dt.datetime.now(dt.timezone.utc)
    task = ClaimedTask(1, 1, "tasks.demo.sleep", [], {}, 0, 3, None, now, None, "default", 0, now)
    return Execution(task, "worker", ttl=30.0, claimed_at=0.0)


@pytest.mark.parametrize("raw", DISAGREEING)
def test_the_marker_carries_the_epoch_the_attempt_was_told(raw):
    with connection.cursor() as cursor:
        cursor.execute("SELECT to_timestamp(%s::float8), to_timestamp(%s::float8)", [raw, round(raw, 6)])
        as_sent_raw, as_rounded = cursor.fetchone()
    assert as_sent_raw != as_rounded  # the case can tell the two apart

    execution, mailbox = _execution(), Mailbox()
    execution.begin_local(raw)
    mailbox.started(execution)
    [(_, at)] = mailbox.take_starts()
    with connection.cursor() as cursor:
        cursor.execute("SELECT to_timestamp(%s::float8)", [at])
        stored = cursor.fetchone()[0]
    assert stored == execution.last_attempted_at == execution.started_at
