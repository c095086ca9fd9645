"""A paused queue and its concurrency keys, with a real worker process: a task admitted from BLOCKED
to READY while its queue is paused (by the finish of the task holding its key's slot, in the worker's
own finish-and-claim statement) is claimed by nobody until the queue is resumed."""

from __future__ import annotations

from typing import Any

import pytest

from tasks.models import QueueControl, Task
from tests.helpers import wait_until
from tests.testapp.models import Effect, Gate

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

H = "tests.testapp.handlers."


def status(task_id: int) -> str:
    return str(Task.objects.get(pk=task_id).status)


def test_a_task_admitted_while_its_queue_is_paused_waits_for_the_resume(workers: Any) -> None:
    workers.start("pw", "--queues", "keyed,other", "--concurrency", "2")
    holder = Task.objects.enqueue(
        H + "block", kwargs={"gate": "a"}, queue="keyed", concurrency_key="k", concurrency_limit=1
    )
    waiting = Task.objects.enqueue(H + "record", queue="keyed", concurrency_key="k", concurrency_limit=1).id
    assert status(waiting) == "BLOCKED"
    wait_until(lambda: Effect.objects.filter(task_id=holder.id, phase="started").exists(), what="the holder to start")
    QueueControl.objects.pause("keyed", by="breaker")

    Gate.objects.create(key="a", open=True)  # the holder ends: its finish admits the waiting task
    wait_until(lambda: status(holder.id) == "SUCCESSFUL", what="the holder to finish")
    assert status(waiting) == "READY"  # admitted while paused

    # A task of the other queue the same worker serves: the claim statement that takes it also looks at
    # the paused queue, after the admission. Once it has run, that claim has passed the admitted task by.
    sentinel = Task.objects.enqueue(H + "record", queue="other").id
    wait_until(lambda: status(sentinel) == "SUCCESSFUL", what="the other queue's task to run")
    row = Task.objects.get(pk=waiting)
    assert (row.status, row.holder, row.attempts) == ("READY", None, 0)
    assert not Effect.objects.filter(task_id=waiting).exists()

    QueueControl.objects.resume("keyed", by="breaker")
    wait_until(lambda: status(waiting) == "SUCCESSFUL", what="the admitted task to run after the resume")
