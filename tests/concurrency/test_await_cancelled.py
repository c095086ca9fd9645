"""The async wait for a task (``await result.await_()``, ``await Task.objects.await_()``) when its
caller gives up, as ``asyncio.wait_for`` or an ASGI client hanging up does: the wait lets go of its
thread and its connection at once, and a wait's timeout counts from its call, whatever else holds
the event loop's default executor. Listening (the alias allows LISTEN) and polling (a pooled alias).

The loop's default executor is a small pool that counts the calls it holds (running or queued), and
the connections to the test database are counted in pg_stat_activity by a connection of the test's
own; both are read from a thread of their own while the loop goes on (what closes a cancelled wait's
connection runs on the loop)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import psycopg
import pytest
from django.db import connections

from tasks.exceptions import TaskWaitTimeout
from tasks.models import Task, TaskStatus
from tasks.testing import run_until_empty
from tests.helpers import test_database_url as database_url  # not collected as a test
from tests.helpers import wait_until
from tests.testapp import option_tasks

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

CANCELLED_WAITS = 100
THREADS = 4  # the loop's default executor: far fewer threads than waits
#: Seconds an outcome below may take at most: a bound on a hang, never a measure of speed.
HANG = 30.0
OTHER_CONNECTIONS = """
SELECT count(*) FROM pg_stat_activity
WHERE datname = current_database() AND pid <> pg_backend_pid() AND backend_type = 'client backend'
"""


LINGERING = """
SELECT pid, application_name, state, backend_start, state_change, left(query, 200) FROM pg_stat_activity
WHERE datname = current_database() AND pid <> pg_backend_pid() AND backend_type = 'client backend'
"""


class CountingPool(ThreadPoolExecutor):
    """A default executor that counts the calls it holds: submitted and not yet returned."""

    def __init__(self, threads: int) -> None:
        super().__init__(max_workers=threads, thread_name_prefix="default-executor")
        self.held = 0
        self._count = threading.Lock()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        def counted() -> Any:
            try:
                return fn(*args, **kwargs)
            finally:
                with self._count:
                    self.held -= 1

        with self._count:
            self.held += 1
        return super().submit(counted)


@pytest.fixture(params=["listening", "polling"])
def mode(request: pytest.FixtureRequest, settings: Any) -> str:
    if request.param == "polling":
        settings.LEASING_TASKS = {"POOLED_DATABASES": ["default"]}
    return str(request.param)


def stuck_and_done() -> tuple[Any, Any]:
    """A result nobody will run (its queue has no worker) and one already final."""
    done = option_tasks.plain.enqueue(41)
    run_until_empty()
    return option_tasks.plain.using(queue_name="nobody-runs-this").enqueue(1), done


def run_on_loop(
    scenario: Coroutine[Any, Any, None], pool: ThreadPoolExecutor, release: Callable[[], None] | None = None
) -> None:
    """Run ``scenario`` on a new loop whose default executor is ``pool``; ``release`` then frees, on a
    thread aside, what a wait left blocked (the loop's shutdown joins the pool's threads)."""

    async def main() -> None:
        asyncio.get_running_loop().set_default_executor(pool)
        try:
            await scenario
        finally:
            if release is not None:
                await aside(release)

    asyncio.run(main())


async def aside(call: Callable[[], Any]) -> Any:
    """``call()`` on a thread of its own, not the loop's default executor (which the test watches)."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="aside") as side:
        return await asyncio.get_running_loop().run_in_executor(side, call)


def test_cancelled_awaits_let_go_of_their_threads_and_connections_at_once(mode: str) -> None:
    stuck, done = stuck_and_done()
    pool = CountingPool(THREADS)
    observer = psycopg.connect(database_url(), autocommit=True)

    def others() -> int:
        row = observer.execute(OTHER_CONNECTIONS).fetchone()
        assert row is not None
        return int(row[0])

    baseline = others()

    def closed() -> None:
        """The waits' connections closed; else which stayed (ci10's 5.2 leg saw one stay 60 s)."""
        try:
            wait_until(lambda: others() <= baseline, what="the waits' connections to close")
        except AssertionError as exc:
            raise AssertionError(f"{exc} ({baseline} before): {observer.execute(LINGERING).fetchall()}") from None

    async def scenario() -> None:
        given_up = await asyncio.gather(
            *(asyncio.wait_for(stuck.await_(), 0.3) for _ in range(CANCELLED_WAITS)), return_exceptions=True
        )
        # asyncio.TimeoutError: the builtin TimeoutError from Python 3.11, a class of its own before
        assert all(type(outcome) is asyncio.TimeoutError for outcome in given_up), {type(o) for o in given_up}
        # At once: a final task's wait returns its result, a stuck one's raises its own timeout.
        returned: Any
        timed_out: Any
        returned, timed_out = await asyncio.gather(
            asyncio.wait_for(done.await_(timeout=2), HANG),
            asyncio.wait_for(stuck.await_(timeout=0.5), HANG),
            return_exceptions=True,
        )
        assert returned is done and done.status == "SUCCESSFUL" and done.return_value == 41, returned
        assert isinstance(timed_out, TaskWaitTimeout), repr(timed_out)
        await aside(lambda: wait_until(lambda: pool.held == 0, what="the default executor's threads to be free"))
        await aside(closed)

    def release() -> None:
        # A wait left blocked on a thread (the bug) ends once its task is final.
        Task.objects.filter(pk=int(stuck.id)).cancel()
        connections.close_all()

    try:
        run_on_loop(scenario(), pool, release)
    finally:
        observer.close()
    assert Task.objects.get(pk=int(stuck.id)).status == TaskStatus.CANCELLED


def test_a_timeout_counts_from_the_call_while_every_executor_thread_is_busy(mode: str) -> None:
    stuck, _ = stuck_and_done()
    pool = CountingPool(THREADS)
    gate = threading.Event()

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        blockers = [loop.run_in_executor(None, gate.wait) for _ in range(THREADS)]
        await aside(lambda: wait_until(lambda: pool.held == THREADS, what="the blockers to run"))
        # Its own timeout fires while every thread of the executor is still held: it never needed one.
        with pytest.raises(TaskWaitTimeout, match=r"still READY after 0\.3s"):
            await asyncio.wait_for(stuck.await_(timeout=0.3), HANG)
        assert not gate.is_set()
        gate.set()
        await asyncio.gather(*blockers)

    run_on_loop(scenario(), pool, gate.set)


def test_the_rows_own_async_wait_returns_the_final_row(mode: str) -> None:
    stuck, done = stuck_and_done()

    async def scenario() -> None:
        row = await Task.objects.await_(int(done.id), timeout=2)
        assert row.status == TaskStatus.SUCCESSFUL
        with pytest.raises(TaskWaitTimeout):
            await Task.objects.await_(int(stuck.id), timeout=0.2)

    run_on_loop(scenario(), CountingPool(THREADS))
