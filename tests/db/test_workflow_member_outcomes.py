"""The handler's Cancel / Discard / Snooze outcomes (issue 24) on members of a
callback_only group, run by a real Worker (its own threads and connections).

Found by breaker 31 (the bug hunt on the workflow settle fast path and callback_only groups)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tasks.models import FINISHED, Task
from tasks.models import Workflow as WorkflowRow
from tasks.worker.process import Worker
from tasks.workflows import Step, group, step
from tests.helpers import wait_until, worker_in_thread
from tests.helpers.task_paths import NOOP

pytestmark = pytest.mark.django_db(transaction=True)

H = "tests.testapp.outcome_handlers."


@pytest.fixture
def worker_of_members() -> Iterator[Worker]:
    worker = Worker(
        concurrency=3,
        ttl=5,
        poll_interval=0.05,
        recovery_interval=0.1,
        install_signal_handlers=False,
        worker_id="breaker31-outcomes",
        queues=["default"],
    )
    with worker_in_thread(worker):
        yield worker


def members() -> list[Step]:
    return [
        step(NOOP),
        step(H + "cancel_with", "no thanks"),
        step(H + "discard_now"),
        step(H + "snooze_times", 1, 0.05),
    ]


@pytest.mark.parametrize("on_failure", ["run", "cancel"])
def test_handler_outcomes_of_group_members_settle_the_callback(worker_of_members: Worker, on_failure: str) -> None:
    done = group(members(), then=step(NOOP), on_failure=on_failure).enqueue()
    assert WorkflowRow.objects.get(pk=done.id).callback_only
    row = wait_until(
        lambda: WorkflowRow.objects.filter(pk=done.id).exclude(status="RUNNING").first(),
        30,
        what="the workflow to end",
    )
    statuses: dict[int | None, str] = dict(Task.objects.filter(pk__in=done.task_ids).values_list("id", "status"))
    ids = done.task_ids
    assert [statuses[i] for i in ids[:4]] == ["SUCCESSFUL", "CANCELLED", "FAILED", "SUCCESSFUL"]
    assert statuses[done.callback_id] == ("SUCCESSFUL" if on_failure == "run" else "CANCELLED")
    assert (row.status, row.remaining, row.failed, row.callback_waiting) == (
        "FAILED",
        0,
        2 if on_failure == "run" else 3,
        0,
    )
    assert all(s in FINISHED for s in statuses.values())
