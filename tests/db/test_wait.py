"""Waiting for a task to finish (tasks/models/task_wait.py): ``Task.objects.wait`` and a django.tasks
result's ``wait()`` / ``await_()``. The waiter runs on a thread of its own with its own connections;
the finish comes from the test's connection, as a worker's would. A wait whose poll is far longer
than the test's deadline can only end in time through the finish's NOTIFY."""

from __future__ import annotations

import asyncio
import gc
import threading
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection, connections, transaction

from tasks.exceptions import TaskWaitTimeout
from tasks.models import Task, TaskStatus
from tasks.testing import run_until_empty
from tests.helpers import wait_until
from tests.helpers.task_paths import NOOP
from tests.testapp import option_tasks

pytestmark = pytest.mark.django_db(transaction=True)

FAR = 60.0  # a poll far longer than any deadline below


class Waiter(threading.Thread):
    """Runs ``wait()`` on a thread; keeps what it returned or raised."""

    def __init__(self, wait: Callable[[], Any]) -> None:
        super().__init__(daemon=True)
        self.wait = wait
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.wait()
        except BaseException as exc:
            self.error = exc
        finally:
            connections.close_all()


def waited(task_id: int) -> bool:
    """The waiter has marked the row (after its LISTEN): a finish from now on notifies it."""
    return Task.objects.filter(pk=task_id, finish_waited=True).exists()


def test_a_finish_wakes_the_wait_through_its_notify_not_a_poll() -> None:
    task_id = Task.objects.enqueue(NOOP, queue="waited").id
    waiter = Waiter(lambda: Task.objects.wait(task_id, timeout=FAR, poll=FAR))
    waiter.start()
    wait_until(lambda: waited(task_id), 10, what="the waiter to mark the row")
    run_until_empty(["waited"])
    waiter.join(10)
    assert not waiter.is_alive(), "the wait did not wake at the finish (it would have slept its 60 s poll)"
    assert waiter.error is None and waiter.result.status == TaskStatus.SUCCESSFUL


def test_a_cancel_wakes_the_wait_too() -> None:
    task_id = Task.objects.enqueue(NOOP, queue="waited-cancel").id
    waiter = Waiter(lambda: Task.objects.wait(task_id, timeout=FAR, poll=FAR))
    waiter.start()
    wait_until(lambda: waited(task_id), 10, what="the waiter to mark the row")
    assert Task.objects.filter(pk=task_id).cancel() == 1
    waiter.join(10)
    assert not waiter.is_alive() and waiter.result.status == TaskStatus.CANCELLED


def test_a_finished_task_returns_at_once_and_a_timeout_leaves_the_task_alone() -> None:
    done = Task.objects.enqueue(NOOP, queue="waited-done").id
    run_until_empty(["waited-done"])
    assert Task.objects.wait(done, timeout=0).status == TaskStatus.SUCCESSFUL
    later = Task.objects.enqueue(NOOP, queue="nobody-runs-this").id
    before = Task.objects.values("status", "attempts", "run_after").get(pk=later)
    with pytest.raises(TaskWaitTimeout, match=f"task {later} is still READY after 0.2s") as timed_out:
        Task.objects.wait(later, timeout=0.2)
    assert isinstance(timed_out.value, TimeoutError)
    assert Task.objects.values("status", "attempts", "run_after").get(pk=later) == before


def test_an_unnotified_row_is_never_marked() -> None:
    """A task nobody waits for is never marked, so its finish notifies nobody (what keeps the hot path
    free of NOTIFYs)."""
    task_id = Task.objects.enqueue(NOOP, queue="unwaited").id
    run_until_empty(["unwaited"])
    assert Task.objects.filter(pk=task_id, finish_waited=False, status=TaskStatus.SUCCESSFUL).exists()


def test_a_pooled_alias_polls(settings: Any) -> None:
    settings.LEASING_TASKS = {"POOLED_DATABASES": ["default"]}
    task_id = Task.objects.enqueue(NOOP, queue="waited-pooled").id
    waiter = Waiter(lambda: Task.objects.wait(task_id, timeout=FAR, poll=0.1))
    waiter.start()
    wait_until(lambda: waited(task_id), 10, what="the waiter to mark the row")
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE query = 'LISTEN leasing_task_finished'")
        assert cursor.fetchone()[0] == 0  # nothing LISTENs through a pooled alias
    run_until_empty(["waited-pooled"])
    waiter.join(10)
    assert not waiter.is_alive() and waiter.result.status == TaskStatus.SUCCESSFUL


def test_a_wait_inside_the_enqueuing_transaction_says_why_it_cannot_see_the_task() -> None:
    with transaction.atomic():
        task_id = Task.objects.enqueue(NOOP, queue="waited-tx").id
        with pytest.raises(Task.DoesNotExist, match="not yet visible"):
            Task.objects.wait(task_id, timeout=1)


def test_a_django_tasks_result_waits_and_refreshes_itself() -> None:
    result = option_tasks.plain.enqueue(41)
    waiter = Waiter(lambda: result.wait(timeout=FAR))
    waiter.start()
    wait_until(lambda: waited(int(result.id)), 10, what="the waiter to mark the row")
    run_until_empty()
    waiter.join(10)
    assert not waiter.is_alive() and waiter.error is None
    assert result.status == "SUCCESSFUL" and result.return_value == 41
    assert asyncio.run(result.await_(timeout=5)) is result


def test_an_async_wait_wakes_at_the_finish_through_its_notify_not_a_poll() -> None:
    """On the event loop (tasks/models/task_await.py), as the sync wait does on its thread."""
    task_id = Task.objects.enqueue(NOOP, queue="awaited").id

    def finish_once_marked() -> None:
        try:
            wait_until(lambda: waited(task_id), 10, what="the wait to mark the row")
            run_until_empty(["awaited"])
        finally:
            connections.close_all()

    async def scenario() -> Task:
        waiting = asyncio.ensure_future(Task.objects.await_(task_id, timeout=FAR, poll=FAR))
        await asyncio.to_thread(finish_once_marked)
        # A bound on a hang, not a measure: without the NOTIFY it would sleep its 60 s poll.
        row: Task = await asyncio.wait_for(waiting, 10)
        return row

    assert asyncio.run(scenario()).status == TaskStatus.SUCCESSFUL


def test_an_async_wait_times_out_with_the_same_error() -> None:
    result = option_tasks.plain.using(queue_name="nobody-runs-this").enqueue(1)
    with pytest.raises(TaskWaitTimeout):
        asyncio.run(result.await_(timeout=0.2))


def test_an_async_wait_goes_on_past_its_unnotified_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """A listening wait sleeps one poll step at a time for the finish's NOTIFY; a step that passes
    with none is the wait going on, not its end. (On Python 3.10, asyncio.wait_for's TimeoutError is
    not the builtin one: the step's timeout escaped the wait as a bare asyncio.TimeoutError, and a
    wait with a timeout never raised TaskWaitTimeout.) The task finishes only once the wait has
    read its row three times: two steps passed with no notify, whatever the machine's speed."""
    from tasks.models.task_await import Hub

    task_id = Task.objects.enqueue(NOOP, queue="awaited").id
    reads = 0
    status = Hub.status

    async def counted(self: Hub, task_id: int, *, mark: bool) -> tuple[str, bool]:
        nonlocal reads
        reads += 1
        return await status(self, task_id, mark=mark)

    monkeypatch.setattr(Hub, "status", counted)

    def finish() -> None:
        try:
            run_until_empty(["awaited"])
        finally:
            connections.close_all()

    async def scenario() -> Task:
        waiting = asyncio.ensure_future(Task.objects.await_(task_id, poll=0.01))
        while reads < 3 and not waiting.done():
            await asyncio.sleep(0.01)  # looks again: the verdict does not depend on how long
        assert not waiting.done(), waiting.exception()
        await asyncio.to_thread(finish)
        row: Task = await asyncio.wait_for(waiting, 30)  # a bound on a hang
        return row

    assert asyncio.run(scenario()).status == TaskStatus.SUCCESSFUL
    result = option_tasks.plain.using(queue_name="nobody-runs-this").enqueue(1)
    with pytest.raises(TaskWaitTimeout):  # a step of FAR cut to the 0.2 s left
        asyncio.run(result.await_(timeout=0.2))


def test_waits_that_start_after_their_hubs_listener_broke_listen_again() -> None:
    """The LISTEN connection of a loop's waits is dropped (terminated, a network cut) while a wait
    keeps their hub open: that wait polls on, and a wait that starts later opens a hub of its own
    with a listener. (Before, it joined the hub that no longer listened, and so did every later
    wait for as long as the loop never ran out of them, as an ASGI server's does: all polled.)"""
    from tasks.models.task_await import _hubs
    from tasks.models.task_wait import FINISHED_CHANNEL

    listeners = (
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
        f" AND query = 'LISTEN {FINISHED_CHANNEL}'"
    )
    stuck = option_tasks.plain.using(queue_name="nobody-runs-this").enqueue(1)
    later = Task.objects.enqueue(NOOP, queue="awaited").id

    def on_its_connection(sql: str) -> list[Any]:
        try:
            with connection.cursor() as cursor:
                cursor.execute(sql)
                return list(cursor.fetchall())
        finally:
            connections.close_all()

    async def until(predicate: Callable[[], bool]) -> None:
        for _ in range(3000):  # a bound on a hang (30 s), not a measure
            if predicate():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("not reached")

    async def scenario() -> tuple[list[Any], str]:
        first = asyncio.ensure_future(stuck.await_(timeout=FAR))
        key = (asyncio.get_running_loop(), "default")
        await until(lambda: key in _hubs and _hubs[key].listening)
        hub = _hubs[key]
        killed = await asyncio.to_thread(on_its_connection, f"SELECT pg_terminate_backend(pid) FROM ({listeners}) AS l")
        assert killed == [(True,)]
        await until(lambda: not hub.listening)
        second = asyncio.ensure_future(Task.objects.await_(later, timeout=FAR, poll=FAR))
        await asyncio.to_thread(wait_until, lambda: waited(later), 30, what="the later wait to mark its row")
        listening = await asyncio.to_thread(on_its_connection, listeners)
        await asyncio.to_thread(finish_awaited)
        row: Task = await asyncio.wait_for(second, 30)  # a bound on a hang
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        return listening, row.status

    def finish_awaited() -> None:
        try:
            run_until_empty(["awaited"])
        finally:
            connections.close_all()

    listening, status = asyncio.run(scenario())
    assert len(listening) == 1, "the later wait's hub does not listen"
    assert status == TaskStatus.SUCCESSFUL


# The scenario leaves tasks pending on closed loops, on purpose: asyncio says so ("Task was destroyed but
# it is pending", "coroutine ... was never awaited") when they are collected. They are collected at the
# end of this test (gc.collect() below), so that what asyncio says is this test's and not whichever
# test the collector happened to run in: the 3.11 leg of a clean-clone run failed a conformance test
# on them.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.filterwarnings("ignore:coroutine .* was never awaited:RuntimeWarning")
def test_loops_closed_with_waits_pending_leave_no_connection_open() -> None:
    """A hand-made event loop closed while an await_() is pending (its task never finished: asyncio.run
    cancels such tasks first, loop.close() does not): nothing runs on that loop again, so nothing there
    closes the connections its waits shared. The next wait, on any loop, closes them. (Before: the
    module kept them, and their server connections, for the life of the process: two per loop.)"""
    from tasks.models.task_await import _hubs

    stuck = option_tasks.plain.using(queue_name="nobody-runs-this").enqueue(1)
    others = (
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
        " AND backend_type = 'client backend'"
    )

    def opened() -> set[int]:
        """Client connections to the test database that were not there when the test began (by pid:
        one an earlier test left closing may end meanwhile, and a count would then never come back)."""
        with connection.cursor() as cursor:
            cursor.execute(others)
            return {pid for (pid,) in cursor.fetchall()} - before

    before: set[int] = set()
    before = opened()
    pending = []
    for _ in range(3):
        loop = asyncio.new_event_loop()

        async def begin() -> asyncio.Future[Any]:
            waiting = asyncio.ensure_future(stuck.await_(timeout=FAR))
            key = (asyncio.get_running_loop(), "default")
            while not (key in _hubs and _hubs[key].listening):  # its connections are open
                await asyncio.sleep(0.01)
            return waiting

        pending.append(loop.run_until_complete(asyncio.wait_for(begin(), 30)))
        loop.close()
    assert opened()  # the last closed loop's listener and reader are still connected
    with pytest.raises(TaskWaitTimeout):
        asyncio.run(stuck.await_(timeout=0))  # a later wait, on a loop of its own
    try:
        wait_until(lambda: not opened(), 10, what="the closed loops' connections to be closed")
    except AssertionError as still_open:
        with connection.cursor() as cursor:  # which they are, for the next reader of a failure
            cursor.execute(
                "SELECT pid, application_name, state, backend_start, left(query, 120) FROM pg_stat_activity"
                " WHERE pid = ANY(%s)",
                [sorted(opened())],
            )
            raise AssertionError(f"{still_open}: {cursor.fetchall()}") from None
    del pending, begin, loop
    gc.collect()
