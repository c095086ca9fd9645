"""A queue name is checked the same way wherever a task is enqueued (issue 38, item 7): empty, over 100
characters, with a NUL (PostgreSQL text cannot hold one) or a lone surrogate, it is a ValueError before
anything is written, from Task.objects.enqueue, bulk_enqueue and a workflow's steps (an import path or
a django.tasks Task) alike. A workflow step used to take ``queue=""`` for "default" and to send a NUL
to the database (DataError, after the workflow row was on its way)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tasks.lifecycle.values import validate_queue
from tasks.models import Task, TaskDependency, Workflow
from tasks.workflows import Workflow as Flow
from tasks.workflows import chain, group, step
from tests.helpers.task_paths import NOOP

pytestmark = pytest.mark.django_db

BAD = ["", "mail\x00", "\ud800", "q" * 101]


def enqueues(queue: str) -> list[tuple[str, Callable[[], Any]]]:
    from tests.testapp.handlers import add

    def graph() -> Any:
        flow = Flow("graph")
        first = flow.add(step(NOOP))
        flow.add(step(NOOP).options(queue=queue), after=[first])
        return flow.enqueue()

    return [
        ("enqueue", lambda: Task.objects.enqueue(NOOP, queue=queue)),
        ("bulk_enqueue", lambda: Task.objects.bulk_enqueue(NOOP, [{}, {}], queue=queue)),
        ("chain step", lambda: chain(step(NOOP), step(NOOP).options(queue=queue)).enqueue()),
        ("group callback", lambda: group([step(NOOP)], then=step(NOOP).options(queue=queue)).enqueue()),
        ("graph step", graph),
        ("django.tasks step", lambda: chain(step(add, 1, 2).options(queue=queue)).enqueue()),
    ]


@pytest.mark.parametrize("queue", BAD, ids=["empty", "nul", "surrogate", "too-long"])
def test_a_bad_queue_name_is_a_value_error_and_writes_nothing(queue: str) -> None:
    with pytest.raises(ValueError, match=r"^queue must"):
        validate_queue(queue)
    for name, enqueue in enqueues(queue):
        with pytest.raises(ValueError, match=r"^queue must"):
            enqueue()
        assert not Task.objects.exists(), name
        assert not Workflow.objects.exists() and not TaskDependency.objects.exists(), name


def test_a_step_without_a_queue_still_goes_to_default_and_a_named_one_to_its_queue() -> None:
    done = chain(step(NOOP), step(NOOP).options(queue="mail")).enqueue()
    assert list(Task.objects.filter(pk__in=done.task_ids).order_by("id").values_list("queue", flat=True)) == [
        "default",
        "mail",
    ]
