"""A worker behind a pooler nobody declared (issue 40): PgBouncer in transaction pooling between the
worker and PostgreSQL, ``LEASING_TASKS["POOLED_DATABASES"]`` empty. Its LISTEN would hold on whichever
server connection ran it; the worker must say so at start, naming the setting, and poll instead. A
worker on a direct connection says nothing of the kind."""

from __future__ import annotations

import pytest
from django.db import connection

from tasks.models import Task
from tests.helpers import wait_until
from tests.helpers.pgbouncer import Bouncer
from tests.helpers.task_paths import NOOP
from tests.helpers.workers import Workers

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

WARNING = "goes through a connection pooler"


def test_a_worker_through_an_undeclared_pooler_says_so_and_still_drains(
    bouncer_pool_of_2: Bouncer, workers: Workers
) -> None:
    ids = Task.objects.bulk_enqueue(NOOP, [{}] * 20, queue="undeclared")
    url = bouncer_pool_of_2.url(connection.settings_dict["NAME"])
    workers.start("pooled", "--queues", "undeclared", "--poll-interval", "0.2", DATABASE_URL=url)
    workers.start("direct", "--queues", "elsewhere", "--poll-interval", "0.2")
    wait_until(lambda: WARNING in workers.log("pooled"), 30, what="the pooled worker's warning")
    log = workers.log("pooled")
    assert "LEASING_TASKS['POOLED_DATABASES'] = ['default']" in log, log[-3000:]
    assert "this worker polls every 0.2s" in log
    wait_until(lambda: Task.objects.filter(pk__in=ids, status="SUCCESSFUL").count() == len(ids), 60, what="the drain")
    # Polling from then on, the pooled worker still takes what is enqueued after its warning.
    late = Task.objects.enqueue(NOOP, queue="undeclared").id
    wait_until(lambda: Task.objects.filter(pk=late, status="SUCCESSFUL").exists(), 30, what="the late task")
    wait_until(lambda: "wake-up=LISTEN on default" in workers.log("direct"), 30, what="the direct worker's start")
    assert WARNING not in workers.log("direct")
