"""Ad hoc dependants and requeues that break a workflow's promises.

Found by breaker 23 (the bug hunt on issue 23: workflows)."""

from __future__ import annotations

import pytest

from tasks.models import Failure, Task, Workflow
from tasks.workflows import chain, group, step
from tests.helpers import drain_one_by_one
from tests.helpers.task_paths import NOOP

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_task_depending_on_a_groups_callback_runs_after_it() -> None:
    # depends_on=[callback] joins the group's workflow (remaining + 1); the callback is released only
    # when its workflow's remaining reaches 1, which now needs the dependant final, which waits for
    # the callback: neither ever runs, and the workflow stays RUNNING.
    done = group([step(NOOP), step(NOOP)], then=step(NOOP)).enqueue()
    assert done.callback_id is not None
    after = Task.objects.enqueue(NOOP, depends_on=[done.callback_id])
    finished = drain_one_by_one()
    assert finished[-2:] == [done.callback_id, after.id], finished
    row = Workflow.objects.get(pk=done.id)
    assert (row.status, row.remaining) == ("SUCCESSFUL", 0)


def test_a_requeued_dependant_waits_for_its_requeued_parent() -> None:
    # The how-to: "Dependants already cancelled stay cancelled: requeue them too if they should run."
    # Doing so in a chain a -> b -> c whose b failed: c comes back READY, not AWAITING, and runs
    # before b (its parent, requeued too) has even started again.
    done = chain(step(NOOP), step(NOOP), step(NOOP), pipe=False).enqueue()
    a, b, c = done.task_ids
    (task,) = Task.objects.claim("w1", limit=1)
    assert task.id == a
    assert Task.objects.complete_many("w1", [(task.id, task.token, "null")])
    (task,) = Task.objects.claim("w1", limit=1)
    assert task.id == b
    assert Task.objects.fail(Failure(task.id, task.token, "E", "boom", retry=False), "w1") is not None
    assert dict(Task.objects.filter(pk__in=[b, c]).values_list("id", "status")) == {b: "FAILED", c: "CANCELLED"}
    Task.objects.filter(pk__in=[b, c]).requeue()
    # c waits for b again.
    assert Task.objects.get(pk=c).status == "AWAITING"
    assert drain_one_by_one() == [b, c]
