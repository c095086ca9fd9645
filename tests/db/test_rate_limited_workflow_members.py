"""Rate-limited workflow members, run by a real worker.
A group's members are released together (WAITING -> READY when the workflow starts; its callback
when every member is final): every member's start is still a start of its key, no window of the
key holds more than its count, and the callback runs once they all finished.

Found by breaker 32 (the bug hunt on issue 24's rate limits per key)."""

from __future__ import annotations

import datetime as dt

import pytest

from tasks.models import FINISHED, Task, TaskStatus
from tasks.worker.process import Worker
from tasks.workflows import group, step
from tests.helpers import wait_until, worker_in_thread
from tests.helpers.task_paths import NOOP

pytestmark = pytest.mark.django_db(transaction=True)


def test_rate_limited_group_members_and_their_callback_keep_the_window() -> None:
    members = [step(NOOP, n=n).options(rate_key="b32-wf", rate_limit=(2, 0.5)) for n in range(8)]
    then = step(NOOP, last=True).options(rate_key="b32-wf", rate_limit=(2, 0.5))
    group(members, then=then).enqueue()
    ids = list(Task.objects.values_list("pk", flat=True))
    assert len(ids) == 9
    worker = Worker(
        concurrency=4, ttl=10, poll_interval=5, recovery_interval=0.2, install_signal_handlers=False, worker_id="b32w"
    )
    with worker_in_thread(worker):
        wait_until(
            lambda: Task.objects.filter(pk__in=ids, status__in=FINISHED).count() == 9, 40, what="the workflow to end"
        )
    rows = list(Task.objects.filter(pk__in=ids))
    assert all(r.status == TaskStatus.SUCCESSFUL and r.attempts == 1 for r in rows), [
        (r.id, r.status, r.attempts) for r in rows
    ]
    assert all(r.rate_key == "b32-wf" for r in rows)
    starts = sorted(r.last_attempted_at for r in rows if r.last_attempted_at is not None)
    assert len(starts) == len(rows)
    window = dt.timedelta(seconds=0.5)
    most = max(sum(1 for s in starts[i:] if s < at + window) for i, at in enumerate(starts))
    assert most <= 2, starts
    callback = max(rows, key=lambda r: r.id)
    assert callback.last_attempted_at is not None
    assert callback.last_attempted_at >= max(r.finished_at for r in rows if r.id != callback.id and r.finished_at)
