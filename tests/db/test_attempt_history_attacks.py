"""Attacks on a task's attempts table (tasks/web/attempts.py, issue 41): one task through every way
an attempt can end, in one history (failed, snoozed, crashed, returned unstarted, cancelled by its
handler, requeued several times, succeeded, run again), and a workflow member: every attempt once, in
order, each with its own outcome and error."""

from __future__ import annotations

import datetime as dt
import re

import pytest
from django.test import Client
from django.utils import timezone

from tasks.models import Failure, Task
from tasks.web import attempts
from tasks.workflows import Step, chain

pytestmark = pytest.mark.django_db

PATH = "tests.testapp.handlers.noop"
QUEUE = "attempts"


def claim(task_id: int, worker: str, *, start: bool = True) -> int:
    Task.objects.filter(pk=task_id).update(run_after=timezone.now() - dt.timedelta(hours=1))
    claimed = Task.objects.claim(worker, limit=1, queues=[QUEUE], ttl=30)
    assert [c.id for c in claimed] == [task_id]
    if start:
        assert Task.objects.start(task_id, worker, claimed[0].token) is not None
    return claimed[0].token


def end(task_id: int, worker: str, message: str, kind: str = "fail", **options: object) -> None:
    token = claim(task_id, worker)
    failure = Failure(task_id, token, "builtins.RuntimeError", message, f"Traceback\n{message}", kind=kind, **options)  # type: ignore[arg-type]
    assert Task.objects.fail(failure, worker)


def crash(task_id: int, worker: str) -> None:
    """A started attempt whose worker died: its lease expires and recovery requeues it, charged."""
    claim(task_id, worker)
    Task.objects.filter(pk=task_id).update(expires_at=timezone.now() - dt.timedelta(seconds=5))
    assert [r.id for r in Task.objects.recover_expired()] == [task_id]


def returned_unstarted(task_id: int, worker: str) -> None:
    claim(task_id, worker, start=False)
    Task.objects.filter(pk=task_id).update(expires_at=timezone.now() - dt.timedelta(seconds=5))
    assert [r.id for r in Task.objects.recover_expired()] == [task_id]


def succeed(task_id: int, worker: str) -> None:
    token = claim(task_id, worker)
    assert Task.objects.complete(task_id, worker, token, {"ok": True})


def table(task_id: int) -> list[tuple[int, str, str | None]]:
    history = attempts.history(Task.objects.get(pk=task_id))
    return [(a.number, a.outcome, (a.error or {}).get("message")) for a in history.attempts]


def test_every_way_an_attempt_ends_in_one_history_each_once_in_order(staff: Client) -> None:
    task_id = Task.objects.enqueue(PATH, queue=QUEUE, max_attempts=5).id
    end(task_id, "w1", "first failure")  # attempt 1
    end(task_id, "w2", "nap", kind="snooze", delay=0)  # no attempt: a snooze takes its own back
    crash(task_id, "w3")  # attempt 2: its worker vanished
    returned_unstarted(task_id, "w4")  # no attempt
    end(task_id, "w1", "second failure", retry=False)  # attempt 3: FAILED
    assert Task.objects.filter(pk=task_id).requeue() == 1  # Retry
    succeed(task_id, "w2")  # attempt 4
    assert Task.objects.filter(pk=task_id).requeue() == 1  # Run again
    end(task_id, "w5", "stop here", kind="cancel")  # attempt 5: the handler cancels
    assert Task.objects.filter(pk=task_id).requeue() == 1  # Retry a cancelled task
    end(task_id, "w1", "last failure", retry=False)  # attempt 6
    rows = table(task_id)
    assert rows[1][1].startswith("Lost its worker")  # charged or not: the recovery's call (issue 38)
    assert [(n, o) for n, o, _ in rows] == [
        (1, "Failed"),
        (2, rows[1][1]),
        (3, "Failed"),
        (4, "Successful"),
        (5, "Cancelled"),
        (6, "Failed"),
    ]
    assert [m for _, _, m in rows] == ["first failure", rows[1][2], "second failure", None, "stop here", "last failure"]
    page = staff.get(f"/dashboard/tasks/{task_id}/").content.decode()
    for message in ("first failure", "second failure", "stop here", "last failure"):
        assert page.count(message) >= 1
    assert page.count('<tr data-attempt="') == 6
    assert [int(n) for n in re.findall(r'<tr data-attempt="(\d+)"', page)] == [1, 2, 3, 4, 5, 6]


def test_a_workflow_member_lists_its_attempts_and_its_dependency_apart() -> None:
    workflow = chain(Step(PATH, queue=QUEUE, max_attempts=3), Step(PATH, queue=QUEUE)).enqueue()
    first, second = sorted(Task.objects.filter(workflow_id=workflow.id).values_list("pk", flat=True))
    end(first, "w1", "member failure")
    end(first, "w2", "member failure again", retry=False)
    assert Task.objects.get(pk=first).status == "FAILED"
    assert [(n, o) for n, o, _ in table(first)] == [(1, "Failed"), (2, "Failed")]
    dependant = Task.objects.get(pk=second)
    history = attempts.history(dependant)
    assert history.attempts == []  # it never ran; its cancellation is an event, not an attempt
    assert dependant.status == "CANCELLED" and len(history.events) == len(dependant.errors)


def test_dropped_entries_after_a_success_and_run_again_keep_the_success() -> None:
    task_id = Task.objects.enqueue(PATH, queue=QUEUE, max_attempts=14).id
    succeed(task_id, "w1")  # attempt 1
    assert Task.objects.filter(pk=task_id).requeue() == 1  # Run again
    for number in range(1, 13):  # attempts 2..13; two entries dropped
        end(task_id, "w1", f"failure {number}")
    task = Task.objects.get(pk=task_id)
    assert task.errors_dropped == 2
    rows = table(task_id)
    assert len(rows) == 13
    assert rows[0][:2] == (1, "Successful")
    assert rows[1] == (2, "Failed", "failure 1")
