"""Row locks the worker does not own: another session (an admin edit, a report with SELECT ... FOR
UPDATE, a handler's own transaction) holding a task row must not wedge the worker, cost the other
attempts it holds their leases, or keep SIGTERM from stopping it. Real worker processes."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from django.db import connection, transaction

from tasks.models import Task, TaskStatus, Worker
from tests.helpers import start_manage, stop_process, wait_until
from tests.helpers import test_database_url as database_url  # imported under another name: not a test
from tests.testapp.models import Effect, Gate

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

H = "tests.testapp.handlers."


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[Any]:
    started = []

    def start(name: str, *args: str) -> Any:
        proc = start_manage(
            tmp_path / f"{name}.log", "run_worker", "--worker-id", name, "--recovery-interval", "0.2",
            "--poll-interval", "0.2", "-v", "2", *args,
        )  # fmt: skip
        started.append(proc)
        wait_until(lambda: Worker.objects.filter(name=name).exists(), 30, what=f"{name} to register")
        return proc

    yield start
    for proc in started:
        stop_process(proc)


def started_and_marked(task_id: int) -> bool:
    return (
        Task.objects.filter(pk=task_id, attempt_started=True).exists()
        and Effect.objects.filter(task_id=task_id, phase="started").exists()
    )


def waiting_on_a_lock() -> bool:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND"
            " pid <> pg_backend_pid() AND wait_event_type = 'Lock'"
        )
        return bool(cursor.fetchone()[0])


def renewals(task_id: int) -> int:
    return Task.objects.get(pk=task_id).renewals


def test_a_row_locked_by_another_session_neither_wedges_the_worker_nor_costs_its_neighbours(worker: Any) -> None:
    Gate.objects.create(key="a")
    Gate.objects.create(key="b")
    locked = Task.objects.enqueue(H + "block", kwargs={"gate": "a"}, priority=10).id
    neighbour = Task.objects.enqueue(H + "block", kwargs={"gate": "b"}).id
    proc = worker("locked", "--concurrency", "3", "--ttl", "3", "--shutdown-grace", "2")
    wait_until(lambda: started_and_marked(locked) and started_and_marked(neighbour), 20, what="both to start")
    locker = psycopg.connect(database_url())
    try:
        locker.execute("SELECT id FROM tasks_task WHERE id = %s FOR UPDATE", [locked])
        Gate.objects.filter(key="a").update(open=True)  # its handler returns; the finish meets the lock
        # The neighbour keeps its lease across more than a TTL (its beats skip the locked row only).
        before = renewals(neighbour)
        wait_until(lambda: renewals(neighbour) >= before + 4, 15, what="the neighbour to be renewed")
        assert Task.objects.get(pk=neighbour).errors == []
        # The worker keeps serving while the row stays locked.
        quick = Task.objects.enqueue(H + "noop").id
        wait_until(lambda: Task.objects.get(pk=quick).status == TaskStatus.SUCCESSFUL, 15, what="a new task to run")
        assert not waiting_on_a_lock()  # nothing of the worker's sits on the lock for long
    finally:
        locker.rollback()
        locker.close()
    # Once the lock is gone, the deferred result lands.
    wait_until(lambda: Task.objects.get(pk=locked).status == TaskStatus.SUCCESSFUL, 15, what="the deferred finish")
    Gate.objects.filter(key="b").update(open=True)
    wait_until(lambda: Task.objects.get(pk=neighbour).status == TaskStatus.SUCCESSFUL, 15, what="the neighbour")
    assert Task.objects.get(pk=neighbour).attempts == 1
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(15) == 0


def test_sigterm_stops_the_worker_while_a_row_it_finishes_stays_locked(worker: Any) -> None:
    Gate.objects.create(key="a", open=True)
    with transaction.atomic():
        locked = Task.objects.enqueue(H + "block", kwargs={"gate": "a"}).id
    locker = psycopg.connect(database_url())
    try:
        proc = worker("stuck-row", "--concurrency", "2", "--ttl", "3", "--shutdown-grace", "2")
        wait_until(lambda: started_and_marked(locked), 20, what="the task to start")
        locker.execute("SELECT id FROM tasks_task WHERE id = %s FOR UPDATE", [locked])
        wait_until(lambda: Effect.objects.filter(task_id=locked, phase="finished").exists(), 20, what="its handler")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(2 + 3 * 3) == 0  # the grace, then bounded retries: not "until the lock goes"
    finally:
        locker.rollback()
        locker.close()


def test_a_checkpoint_inside_the_handlers_transaction_does_not_lock_its_own_row(worker: Any) -> None:
    """The checkpoint is written on a connection of its own: the handler's open transaction holds no
    lock on the task row, so the worker's heartbeat keeps this attempt and its neighbours alive."""
    Gate.objects.create(key="n")
    with transaction.atomic():
        task = Task.objects.enqueue(H + "checkpoint_in_atomic", kwargs={"gate": "n"}, priority=10).id
        neighbour = Task.objects.enqueue(H + "block", kwargs={"gate": "n"}).id
    proc = worker("atomic", "--concurrency", "3", "--ttl", "2")
    # Committed at once, although the handler's own transaction is still open.
    wait_until(lambda: Task.objects.get(pk=task).progress == {"step": 1}, 20, what="the checkpoint")
    wait_until(lambda: started_and_marked(neighbour), 20, what="the neighbour to start")
    before = (renewals(task), renewals(neighbour))
    wait_until(lambda: renewals(task) >= before[0] + 4 and renewals(neighbour) >= before[1] + 4, 15, what="renewals")
    Gate.objects.filter(key="n").update(open=True)
    wait_until(lambda: Task.objects.filter(pk__in=[task, neighbour], status=TaskStatus.SUCCESSFUL).count() == 2, 15)
    for row in Task.objects.filter(pk__in=[task, neighbour]):
        assert (row.attempts, row.errors) == (1, [])
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(15) == 0
