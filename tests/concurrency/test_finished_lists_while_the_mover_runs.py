"""The lists read while a real recovery leader (``manage.py recover_tasks``, another process) moves
finished tasks of every final status from tasks_task to tasks_finished: each read of the admin's
count, the admin's pages, the every-task page walked by ``before=`` and the JSON API's listing
shows every task once (a move changes neither the ids nor the statuses), none in neither table and
none twice, until the backlog has moved."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest
from django.db import connection
from django.test import Client

from tasks.models import Task
from tasks.web.listings import Listing
from tests.db.test_finished_mover import roll_up_hours
from tests.db.test_finished_partitions import drop_partitions
from tests.factories import StaffFactory
from tests.helpers import start_manage, stop_process, wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.one_stack]

ROWS = """
INSERT INTO tasks_task (queue, priority, task_path, args, kwargs, status, run_after, enqueued_at, started_at,
    last_attempted_at, finished_at, attempts, max_attempts, errors, worker_ids, renewals, transitions,
    failures, crashes, shared_crashes, unstarted_returns, attempt_started, attempt_isolated, errors_dropped, holder)
SELECT 'mover61-' || (g %% 20), 0, 'tests.testapp.handlers.noop', '[]', jsonb_build_object('n', g),
       (ARRAY['SUCCESSFUL', 'FAILED', 'CANCELLED'])[1 + g %% 3],
       h - interval '2 seconds', h - interval '1 minute', h - interval '1 second', h - interval '1 second', h,
       1, 1, '[]', '[]', 0, 0, 0, 0, 0, 0, true, false, 0, 'w-' || (g %% 2)
FROM generate_series(1, %(n)s) AS g
CROSS JOIN LATERAL (SELECT date_trunc('hour', now()) - interval '3 hours' + (g %% 3600) * interval '1 second') AS t(h)
"""


@pytest.fixture
def staff(client: Client) -> Client:
    client.force_login(StaffFactory.create())
    return client


@pytest.fixture(autouse=True)
def no_partitions() -> Iterator[None]:
    drop_partitions()
    yield
    drop_partitions()


def test_every_list_shows_every_task_once_while_a_leader_moves_them(staff: Client, tmp_path: Path) -> None:
    n = 10_000  # 20 queues of 500, three statuses, hours old
    with connection.cursor() as cursor:
        cursor.execute(ROWS, {"n": n})
        cursor.execute("ANALYZE tasks_task")
    roll_up_hours()
    expected = {}
    for queue in ("mover61-3", "mover61-11"):
        expected[queue] = list(Task.objects.filter(queue=queue).order_by("-pk").values_list("pk", flat=True))
        assert len(expected[queue]) == n // 20
    log = tmp_path / "leader.log"
    # Batches of 25 (400 of them), the leader's mover working half the time: seconds of moving,
    # where 1,000 a batch moved all of them within one read of the lists.
    paced = '{"RETENTION_BATCH_SIZE": 25, "ARCHIVE_BUSY_FRACTION": 0.5}'
    proc = start_manage(log, "recover_tasks", "--interval", "0.2", LEASING_TEST_TASKS=paced)
    wrong: list[tuple[object, ...]] = []
    seen_moved: list[int] = []
    paused_reads: list[int] = []

    def read_every_list() -> int:
        moved = moved_so_far()
        seen_moved.append(moved)
        assert proc.poll() is None, log.read_text()[-3000:]
        for queue, every in expected.items():
            listing = Listing(Task.objects.filter(queue=queue))
            if (count := listing.count().value) != n // 20:
                wrong.append(("count", queue, moved, count))
            if (ids := listing.ids(0, n // 20)) != every:
                wrong.append(("ids", queue, moved, len(ids), len(set(ids))))
            page = staff.get("/admin/tasks/task/", {"queue__exact": queue})
            if page.context["cl"].result_count != n // 20:
                wrong.append(("admin count", queue, moved, page.context["cl"].result_count))
            shown = [t.pk for t in page.context["cl"].result_list]
            if shown != every[:100]:
                wrong.append(("admin page", queue, moved, len(shown)))
        return moved

    # Reads of two kinds: three while the leader is stopped, each once a batch more has moved (a
    # half-moved state, read whole), then one while it moves (moves commit between the read's
    # statements). The stopped reads come first and make the half-moved reads a count of the loop,
    # not of the machine's speed: beside two busy loops, one free-running read once spanned all
    # 10,000 moves, and another 8,600.
    try:
        while True:
            for _ in range(3):
                before = moved_so_far()
                if before == n:
                    break  # all moved: the next read is the last
                wait_until(partial(moved_past, before), what="the leader to move a batch more")
                proc.send_signal(signal.SIGSTOP)
                try:
                    if (moved := read_every_list()) < n:
                        paused_reads.append(moved)
                finally:
                    proc.send_signal(signal.SIGCONT)
            if read_every_list() == n:
                break
    finally:
        stop_process(proc)
    assert len(set(paused_reads)) >= 3 and not wrong, (seen_moved, wrong[:10])


def moved_past(count: int) -> bool:
    return moved_so_far() > count


def moved_so_far() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM tasks_finished WHERE queue LIKE 'mover61%%'")
        return int(cursor.fetchone()[0])
