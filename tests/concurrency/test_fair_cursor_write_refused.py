"""The shared fair cursor's write refused by the database (a read-only replica's error,
SQLSTATE 25006, raised by a trigger on tasks_faircursor) under a real ``run_worker`` process and
under API claims inside their request's transaction: no claim is lost or doubled, each task runs
once, and each API claim's transaction commits its claim (the write's savepoint).

Found by breaker 34 (the bug hunt on the shared fair cursor)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection

from tasks.models import FairCursor, Task
from tests.helpers import wait_until
from tests.helpers.api import Api
from tests.helpers.task_paths import NOOP
from tests.helpers.workers import Workers

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.usefixtures("fair_queue_api")]

QUEUE = "fair"
KEYS = [f"t{n:02d}" for n in range(8)]


@pytest.fixture
def refused() -> Iterator[None]:
    with connection.cursor() as cursor:
        cursor.execute(
            """CREATE FUNCTION breaker34_refuse() RETURNS trigger LANGUAGE plpgsql AS $$
               BEGIN RAISE EXCEPTION 'cannot execute INSERT in a read-only transaction'
                     USING ERRCODE = 'read_only_sql_transaction'; END $$"""
        )
        cursor.execute(
            "CREATE TRIGGER breaker34_refuse BEFORE INSERT OR UPDATE ON tasks_faircursor "
            "FOR EACH ROW EXECUTE FUNCTION breaker34_refuse()"
        )
    yield
    with connection.cursor() as cursor:
        cursor.execute("DROP TRIGGER breaker34_refuse ON tasks_faircursor")
        cursor.execute("DROP FUNCTION breaker34_refuse()")


def test_a_worker_whose_cursor_writes_are_refused_runs_each_task_once(refused: None, workers: Workers) -> None:
    for key in KEYS:
        Task.objects.bulk_enqueue(NOOP, [{}] * 6, queue=QUEUE, fair_key=key)
    total = 6 * len(KEYS)
    name = "refused"
    workers.start(
        name, "--queues", QUEUE, "--concurrency", "4", "--batch-size", "4", "--no-scheduler",
        LEASING_TEST_FAIR_QUEUES=QUEUE,
    )  # fmt: skip
    rows = Task.objects.filter(queue=QUEUE)
    wait_until(lambda: rows.filter(status="SUCCESSFUL").count() == total, 60, what="every task done")
    assert set(rows.values_list("attempts", flat=True)) == {1}
    assert all(len(ids) == 1 for ids in rows.values_list("worker_ids", flat=True))
    assert not FairCursor.objects.exists()
    assert "its shared cursor could not be written" in workers.log(name)


def test_api_claims_whose_cursor_writes_are_refused_commit_their_claims(refused: None, client: Any) -> None:
    for key in KEYS:
        Task.objects.bulk_enqueue(NOOP, [{}], queue=QUEUE, fair_key=key)
    api = Api(client)
    served = []
    for _ in range(len(KEYS)):
        status, body = api.call("POST", "/api/tasks/next", {"worker": "ext", "queues": [QUEUE]})
        assert status == 200 and body["task"] is not None, body
        served.append(body["task"]["fair_key"])
    assert served == KEYS  # every turn in order, none twice, though the cursor was never stored
    assert Task.objects.filter(queue=QUEUE, status="RUNNING", attempts=1).count() == len(KEYS)
    assert not FairCursor.objects.exists()
