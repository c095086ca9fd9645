"""The test helpers (tasks/testing: run_until_empty, eager mode): handlers that raise what is not
an Exception, tasks of a concurrency key, a workflow whose step fails for good, a bulk operation's
retry run inline. Every attempt ends recorded (invariant 9), nothing is left RUNNING or waiting for
something that will never come (invariant 7), inside a test's transaction.

Found by breaker 32 (the bug hunt on issue 25's operations: bulk operations, history, tracing, test helpers)."""

from __future__ import annotations

from typing import Any

import pytest

from tasks.maintenance.bulk import BulkRunner
from tasks.models import FINISHED, BulkOperation, Task, TaskStatus
from tasks.testing import eager_tasks, run_until_empty
from tasks.workflows import chain, step
from tests.testapp import testing_handlers as h

pytestmark = pytest.mark.django_db

P = h.PATH
RAISE = "tests.testapp.handlers.raise_base"


@pytest.mark.parametrize("kind", ["system_exit", "cancelled", "generator_exit"])
def test_run_until_empty_records_a_base_exception_and_goes_on(kind: str) -> None:
    poisoned = Task.objects.enqueue(RAISE, args=[kind], max_attempts=1).id
    after = Task.objects.enqueue(P + "record", args=["after"]).id
    drained = run_until_empty()
    assert (drained.failed, drained.succeeded) == (1, 1), drained
    row = Task.objects.get(pk=poisoned)
    assert row.status == TaskStatus.FAILED and len(row.errors) == 1, (row.status, row.errors)
    assert Task.objects.get(pk=after).status == TaskStatus.SUCCESSFUL
    assert not Task.objects.running().exists()


@pytest.mark.parametrize("kind", ["system_exit", "cancelled", "generator_exit"])
def test_eager_mode_records_a_base_exception_and_the_enqueue_returns(kind: str) -> None:
    with eager_tasks() as run:
        poisoned = Task.objects.enqueue(RAISE, args=[kind], max_attempts=2).id
    row = Task.objects.get(pk=poisoned)
    assert (row.status, row.attempts, len(row.errors)) == (TaskStatus.FAILED, 2, 2), row.errors
    assert (run.drained.retried, run.drained.failed) == (1, 1)
    assert not Task.objects.running().exists()


def test_eager_mode_runs_every_task_of_a_serial_concurrency_key() -> None:
    options: dict[str, Any] = {"concurrency_key": "breaker32-serial", "concurrency_limit": 1}
    with eager_tasks() as run:
        ids = Task.objects.bulk_enqueue(P + "record", [{"label": f"k{i}"} for i in range(3)], **options)
        single = Task.objects.enqueue(P + "record", args=["k-single"], **options).id
    statuses = dict(Task.objects.filter(pk__in=[*ids, single]).values_list("pk", "status"))
    # The slot frees as each finishes: the next is admitted and run in the same call.
    assert set(statuses.values()) == {TaskStatus.SUCCESSFUL}, statuses
    assert run.drained.succeeded == 4


def test_run_until_empty_runs_every_task_of_a_serial_concurrency_key() -> None:
    options: dict[str, Any] = {"concurrency_key": "breaker32-serial", "concurrency_limit": 1}
    ids = [Task.objects.enqueue(P + "record", args=[f"k{i}"], **options).id for i in range(3)]
    drained = run_until_empty()
    statuses = dict(Task.objects.filter(pk__in=ids).values_list("pk", "status"))
    assert set(statuses.values()) == {TaskStatus.SUCCESSFUL}, (statuses, drained)


def test_eager_workflow_whose_first_step_fails_for_good_leaves_nothing_waiting() -> None:
    with eager_tasks():
        flow = chain(
            step(P + "fail_always", "first").options(max_attempts=1),
            step(P + "record", "second"),
            step(P + "record", "third"),
        ).enqueue()
    statuses = dict(Task.objects.filter(pk__in=flow.task_ids).values_list("pk", "status"))
    waiting = {pk: s for pk, s in statuses.items() if s not in FINISHED}
    assert not waiting, statuses
    assert statuses[flow.task_ids[0]] == TaskStatus.FAILED


def test_a_bulk_retry_then_run_until_empty_runs_each_retried_task_once() -> None:
    ids = Task.objects.bulk_enqueue(P + "fail_always", [{"label": str(i)} for i in range(30)], max_attempts=1)
    first = run_until_empty()
    assert first.failed == 30
    operation = BulkOperation.objects.request("retry", {"task_path": P + "fail_always"})
    BulkRunner(batch_size=7, span=11).run_until_idle()
    operation.refresh_from_db()
    assert (operation.status, operation.changed) == ("DONE", 30)
    second = run_until_empty()
    assert second.failed == 30 and sorted(second.task_ids) == sorted(ids)
    assert not Task.objects.running().exists()
