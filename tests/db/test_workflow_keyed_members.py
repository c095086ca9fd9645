"""A keyed workflow member whose finish admits another task of its key.

The finishing statement's row trigger raises ``leasing.workflow_settle``; its statement triggers then
fire in name order, so ``tasks_concurrency_updated_rows`` admits the key's next BLOCKED task first,
with a nested UPDATE whose own ``tasks_workflow_settle`` consumes the flag (and finds nothing of its
own to settle). The outer statement's ``tasks_workflow_settle`` then sees no flag: the member's
finish is never counted, its dependants never released, and its workflow stays RUNNING forever.

Found by breaker 23 (the bug hunt on issue 23: workflows)."""

from __future__ import annotations

import pytest

from tasks.models import Task, Workflow
from tasks.workflows import chain, group, step
from tests.helpers import drain_one_by_one
from tests.helpers.task_paths import NOOP

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_group_of_keyed_members_releases_its_callback() -> None:
    keyed = step(NOOP).options(concurrency_key="k", concurrency_limit=1)
    done = group([keyed, keyed, keyed], then=step(NOOP)).enqueue()
    finished = drain_one_by_one()
    row = Workflow.objects.get(pk=done.id)
    statuses = dict(Task.objects.filter(workflow_id=done.id).values_list("id", "status"))
    # Every member ran and the callback after them; the workflow ended.
    assert statuses == dict.fromkeys(done.task_ids, "SUCCESSFUL"), (statuses, row.remaining)
    assert finished[-1] == done.callback_id
    assert (row.status, row.remaining) == ("SUCCESSFUL", 0)


def test_a_keyed_chain_step_finishing_beside_a_blocked_task_of_its_key_releases_the_next_step() -> None:
    # Another task of the key waits BLOCKED behind the chain's first step.
    first = step(NOOP).options(concurrency_key="k", concurrency_limit=1)
    done = chain(first, step(NOOP)).enqueue()
    other = Task.objects.enqueue(NOOP, concurrency_key="k", concurrency_limit=1)
    assert Task.objects.get(pk=other.id).status == "BLOCKED"
    (task,) = Task.objects.claim("w1", limit=1)
    assert task.id == done.task_ids[0]
    assert Task.objects.complete_many("w1", [(task.id, task.token, "null")])
    # The finish admitted the other task of the key, and released the chain's second step.
    assert Task.objects.get(pk=other.id).status == "READY"
    assert Task.objects.get(pk=done.task_ids[1]).status == "READY"
    assert Workflow.objects.get(pk=done.id).remaining == 1


def test_requeueing_a_member_beside_a_keyed_task_reopens_the_workflow() -> None:
    # One statement requeues a finished member and a finished keyed task (the admin's "requeue"
    # action on both rows): the keyed row's row trigger moves it READY -> BLOCKED with a nested
    # UPDATE, whose statement triggers consume the flag the member's row trigger had raised.
    done = chain(step(NOOP)).enqueue()
    keyed = Task.objects.enqueue(NOOP, concurrency_key="k", concurrency_limit=1)
    assert sorted(drain_one_by_one()) == sorted([done.task_ids[0], keyed.id])
    assert Workflow.objects.get(pk=done.id).status == "SUCCESSFUL"
    assert Task.objects.filter(pk__in=[done.task_ids[0], keyed.id]).requeue() == 2
    assert Task.objects.get(pk=done.task_ids[0]).status == "READY"
    row = Workflow.objects.get(pk=done.id)
    # The member is unfinished again: its workflow is open and counts it.
    assert (row.status, row.remaining, row.finished_at) == ("RUNNING", 1, None)


def test_a_keyed_chain_step_alone_on_its_key_releases_the_next_step() -> None:
    # Nothing else of the key waits: the admission's UPDATE matches no row, yet its statement
    # triggers run, and the flag goes with them.
    done = chain(step(NOOP).options(concurrency_key="solo", concurrency_limit=5), step(NOOP)).enqueue()
    assert drain_one_by_one() == done.task_ids
    row = Workflow.objects.get(pk=done.id)
    assert (row.status, row.remaining) == ("SUCCESSFUL", 0)
