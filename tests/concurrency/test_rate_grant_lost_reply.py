"""Rate limits per key: the reply of a worker's rate start is lost (the
fault-injecting proxy forwards RATE_START_SQL, lets it commit, swallows the answer and cuts the
connection). A lost grant is answered again when resent (the handler runs once, one grant taken);
a lost refusal leaves the task handed back uncharged, and it runs at its reserved time.

Found by breaker 32 (the bug hunt on issue 24's rate limits per key)."""

from __future__ import annotations

import datetime as dt

import pytest

from tasks.models import FINISHED, RateLimit, Task, TaskStatus
from tests.helpers import test_database_url as database_url  # not collected as a test
from tests.helpers import wait_until
from tests.helpers.pgproxy import PgProxy
from tests.helpers.workers import Workers
from tests.testapp.models import Effect, Gate

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

H = "tests.testapp.handlers."
RATE_START = b"WITH mine AS MATERIALIZED"


def charges(task: Task) -> tuple[int, int, int, int, int]:
    return (task.attempts, task.failures, task.crashes, task.shared_crashes, task.unstarted_returns)


@pytest.mark.parametrize("handler", ["noop", "async_double"])
def test_a_lost_grant_reply_is_answered_again_and_the_handler_runs_once(
    proxy: PgProxy, workers: Workers, handler: str
) -> None:
    kwargs = {"n": 2} if handler == "async_double" else {}
    [task_id] = Task.objects.bulk_enqueue(H + handler, [kwargs], rate_key="b32-lost", rate_limit=(1, 60))
    fault = proxy.drop_reply_after(RATE_START)
    workers.start("lossy", "--concurrency", "2", DATABASE_URL=proxy.url_for(database_url()))
    assert fault.fired.wait(30)
    assert fault.status == b"I"  # the rate start committed: the grant was taken
    wait_until(lambda: Task.objects.get(pk=task_id).status in FINISHED, 30, what="the task to finish")
    task = Task.objects.get(pk=task_id)
    assert task.status == TaskStatus.SUCCESSFUL, (task.status, task.errors, workers.log("lossy")[-3000:])
    assert charges(task) == (1, 0, 0, 0, 0)
    key = RateLimit.objects.get(key="b32-lost")
    assert (key.grants, key.refusals, len(key.starts)) == (1, 0, 1)


@pytest.mark.parametrize("handler", ["noop", "async_double"])
def test_a_lost_refusal_reply_charges_nothing_and_the_task_runs_at_its_reservation(
    proxy: PgProxy, workers: Workers, handler: str
) -> None:
    period = 1.5
    Gate.objects.create(key="b32-first")
    [first] = Task.objects.bulk_enqueue(
        H + "block", [{"gate": "b32-first"}], rate_key="b32-refused", rate_limit=(1, period)
    )
    workers.start("lossy", "--concurrency", "2", "--batch-size", "1", DATABASE_URL=proxy.url_for(database_url()))
    wait_until(lambda: Effect.objects.filter(task_id=first, phase="started").exists(), 30, what="the first start")
    # The second task's start is refused (the window holds the first grant); its reply is lost.
    fault = proxy.drop_reply_after(RATE_START)
    kwargs = {"n": 2} if handler == "async_double" else {}
    [second] = Task.objects.bulk_enqueue(H + handler, [kwargs], rate_key="b32-refused", rate_limit=(1, period))
    assert fault.fired.wait(30)
    assert fault.status == b"I"
    Gate.objects.filter(key="b32-first").update(open=True)
    wait_until(
        lambda: Task.objects.filter(pk__in=[first, second], status__in=FINISHED).count() == 2,
        30,
        what="both tasks to finish",
    )
    rows = {t.id: t for t in Task.objects.filter(pk__in=[first, second])}
    for task in rows.values():
        assert task.status == TaskStatus.SUCCESSFUL, (task.status, task.errors)
        assert charges(task) == (1, 0, 0, 0, 0), (task.id, charges(task))
    assert rows[second].rate_refusals >= 1
    second_at, first_at = rows[second].last_attempted_at, rows[first].last_attempted_at
    assert second_at is not None and first_at is not None
    gap = second_at - first_at
    assert gap >= dt.timedelta(seconds=period), gap
    key = RateLimit.objects.get(key="b32-refused")
    assert key.grants == 2
