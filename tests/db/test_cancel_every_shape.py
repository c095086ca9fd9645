"""The operator's cancel (CANCEL_SET) through the querysets of every shape the product cancels with
(the API's ``filter(pk=)``, the dashboard's ``filter(pk__in=, status__in=)``, the admin action's
``filter(pk__in=<subquery>)``, a filter on kwargs, a workflow's cancel), each over a RUNNING attempt
that started (with 9, 10 or 30 prior failures), one claimed but not started, a READY, a BLOCKED
(concurrency key) and an AWAITING task (a chain's second step): every one CANCELLED by one statement,
an entry only for the started attempt, the cap and ``errors_dropped`` exact, a second cancel a no-op."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tasks.lifecycle.fragments import MAX_ERRORS
from tasks.lifecycle.states import UNFINISHED
from tasks.models import Task
from tasks.workflows import Step, chain
from tests.db.test_attempt_history_attacks import QUEUE, claim, end, table

pytestmark = pytest.mark.django_db(transaction=True)

PATH = "tests.testapp.handlers.noop"
TAG = {"tag": "cancel-shapes"}

SHAPES: dict[str, Callable[[list[int]], int]] = {
    "api": lambda ids: sum(Task.objects.filter(pk=i).cancel() for i in ids),
    "dashboard": lambda ids: Task.objects.filter(pk__in=ids, status__in=UNFINISHED).cancel(),
    "admin": lambda ids: Task.objects.filter(pk__in=Task.objects.filter(pk__in=ids).values("pk")).cancel(),
    "kwargs": lambda ids: Task.objects.filter(kwargs__contains=TAG).cancel(),
}


def with_failures(prior: int, **options: object) -> int:
    task_id = Task.objects.enqueue(PATH, queue=QUEUE, kwargs=TAG, max_attempts=prior + 5, **options).id  # type: ignore[arg-type]
    for number in range(prior):
        end(task_id, f"w{number}", f"failure {number + 1}")
    return task_id


def errors_of(task_id: int) -> tuple[list[str], int]:
    task = Task.objects.get(pk=task_id)
    return [e["kind"] for e in task.errors], task.errors_dropped


def expected(prior: int, added: int) -> tuple[list[str], int]:
    entries = ["failure"] * prior + ["cancel"] * added
    kept = entries if len(entries) <= MAX_ERRORS else entries[:1] + entries[-(MAX_ERRORS - 1) :]
    return kept, len(entries) - len(kept)


@pytest.mark.parametrize("prior", [9, 10, 30])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_cancel_every_state_through_every_shape(shape: str, prior: int) -> None:
    started = with_failures(prior)
    claim(started, "runner")
    unstarted = with_failures(prior)
    claim(unstarted, "claimer", start=False)
    ready = with_failures(prior)
    holder = Task.objects.enqueue(PATH, queue="elsewhere", kwargs=TAG, concurrency_key="k", concurrency_limit=1).id
    blocked = Task.objects.enqueue(PATH, queue="elsewhere", kwargs=TAG, concurrency_key="k", concurrency_limit=1).id
    flow = chain(Step(PATH, kwargs=TAG, queue="elsewhere"), Step(PATH, kwargs=TAG, queue="elsewhere")).enqueue()
    awaiting = flow.task_ids[1]
    # The awaiting step first: one cancel at a time (the API), its parent's cancel would cancel it too.
    ids = [started, unstarted, ready, holder, blocked, awaiting, flow.task_ids[0]]
    before = dict(Task.objects.filter(pk__in=ids).values_list("pk", "status"))
    assert (before[started], before[unstarted], before[ready]) == ("RUNNING", "RUNNING", "READY")
    assert (before[blocked], before[awaiting]) == ("BLOCKED", "AWAITING")
    assert SHAPES[shape](ids) == len(ids)
    assert set(Task.objects.filter(pk__in=ids).values_list("status", flat=True)) == {"CANCELLED"}
    assert errors_of(started) == expected(prior, 1)
    for task_id in (unstarted, ready):
        assert errors_of(task_id) == expected(prior, 0)
    for task_id in (holder, blocked, *flow.task_ids):
        assert errors_of(task_id) == ([], 0)
    last = Task.objects.get(pk=started).errors[-1]
    assert (last["position"], last["worker"]) == (prior + 1, "runner")
    numbers = [n for n, _, _ in table(started)]
    assert numbers == sorted(set(numbers)) and table(started)[-1][:2] == (prior + 1, "Cancelled")
    assert SHAPES[shape](ids) == 0


@pytest.mark.parametrize("prior", [9, 10, 30])
def test_a_workflows_cancel_of_a_started_member(prior: int) -> None:
    flow = chain(Step(PATH, queue=QUEUE), Step(PATH, queue=QUEUE)).enqueue()
    first, second = flow.task_ids
    Task.objects.filter(pk=first).update(max_attempts=prior + 5)
    for number in range(prior):
        end(first, f"w{number}", f"failure {number + 1}")
    claim(first, "runner")
    assert flow.cancel() == 2
    assert errors_of(first) == expected(prior, 1)
    assert errors_of(second) == ([], 0)
    assert flow.cancel() == 0
