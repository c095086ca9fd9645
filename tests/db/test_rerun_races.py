"""rerun_from_step (issue 58) beside the mover, refusals, claims and step fences."""

from __future__ import annotations

import datetime as dt
import threading
from typing import Any

import pytest
from django.db import transaction
from django.utils import timezone

from tasks.exceptions import TaskError
from tasks.models import Task, TaskStep
from tasks.runtime import _set_current
from tasks.steps import rerun_from_step, step
from tests.db.test_finished_lists import days, ended, move, where  # noqa: F401 (days: autouse partitions)
from tests.db.test_finished_rerun_races import rerun_beside_a_held_move
from tests.db.test_steps import attempt
from tests.helpers import wait_until
from tests.helpers.connections import OnItsOwnConnection, waits_for_a_lock

pytestmark = pytest.mark.django_db(transaction=True)

UTC = dt.timezone.utc
QUEUE = "steps"


def stored_step(task_id: int, position: int, name: str) -> None:
    TaskStep.objects.create(
        task_id=task_id,
        position=position,
        name=name,
        attempt=1,
        token=1,
        result={"p": position},
        started_at=timezone.now(),
        completed_at=timezone.now(),
    )


def test_a_rerun_from_a_step_while_the_mover_takes_the_task_reruns_it() -> None:
    """The requeue of a moved task handles this race (restores after the mover's commit); a rerun from
    a step must not answer "no task" (404) for a task that is there, in tasks_finished."""
    task_id = ended("FAILED", at=dt.datetime.now(UTC) - dt.timedelta(hours=3))
    stored_step(task_id, 0, "a")
    stored_step(task_id, 1, "b")

    def rerun() -> Any:
        try:
            return rerun_from_step(task_id, 1)
        except Exception as exc:
            return exc

    result = rerun_beside_a_held_move(task_id, rerun)
    assert result == 1, f"rerun_from_step of a task the mover took meanwhile: {result!r} (where: {where(task_id)})"
    assert where(task_id) == "tasks_task" and Task.objects.get(pk=task_id).status == "READY"


def test_a_refused_rerun_of_a_moved_task_leaves_it_moved_with_its_steps() -> None:
    task_id = ended("SUCCESSFUL")
    stored_step(task_id, 0, "a")
    move(task_id)
    with pytest.raises(ValueError, match="stored steps"):
        rerun_from_step(task_id, 5)
    assert where(task_id) == "tasks_finished"
    assert TaskStep.objects.filter(task_id=task_id).count() == 1


def test_a_rerun_of_a_running_task_is_refused_and_changes_nothing() -> None:
    task_id = Task.objects.enqueue("tests.testapp.handlers.noop", queue=QUEUE).id
    execution = attempt(task_id, "w1")
    _set_current(execution)
    try:
        step("a", lambda: 1)
    finally:
        _set_current(None)
    before = Task.objects.filter(pk=task_id).values().get()
    with pytest.raises(TaskError):
        rerun_from_step(task_id, 0)
    assert Task.objects.filter(pk=task_id).values().get() == before
    assert TaskStep.objects.filter(task_id=task_id).count() == 1


def test_a_rerun_waiting_behind_a_step_s_fence_is_refused_and_the_step_stays() -> None:
    """The step's fence (FOR SHARE to its commit) is taken; the rerun's FOR UPDATE waits, then finds
    the task RUNNING: refused, the step committed."""
    task_id = Task.objects.enqueue("tests.testapp.handlers.noop", queue=QUEUE).id
    execution = attempt(task_id, "w1")
    fenced, release = threading.Event(), threading.Event()

    def run() -> Any:

        _set_current(execution)
        try:

            def body() -> int:
                return 7

            # hold the step's transaction open after the fence: run the fence through a commit hook
            with transaction.atomic():
                pass
            result = step("a", body)
            return result
        finally:
            _set_current(None)

    # Simpler: take the fence's lock by hand on another connection (FOR SHARE as STEP_RECORD_SQL does).
    def hold_share() -> None:
        from django.db import connection

        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute("SELECT id FROM tasks_task WHERE id = %s FOR SHARE", [task_id])
            fenced.set()
            release.wait(60)

    holder = OnItsOwnConnection(hold_share)
    holder.start()
    assert fenced.wait(30)
    operator = OnItsOwnConnection(lambda: rerun_from_step(task_id, 0))
    operator.start()
    operator.ready.wait(30)
    wait_until(lambda: waits_for_a_lock(operator.pid), 30, what="the rerun to wait for the fence")
    release.set()
    holder.outcome()
    with pytest.raises(TaskError):
        operator.outcome()
    assert Task.objects.get(pk=task_id).status == "RUNNING"


def test_a_claim_beside_a_rerun_in_progress_takes_the_task_only_after_it() -> None:
    task_id = Task.objects.enqueue("tests.testapp.handlers.noop", queue=QUEUE).id
    stored_step(task_id, 0, "a")
    stored_step(task_id, 1, "b")
    Task.objects.filter(pk=task_id).update(run_after=timezone.now() + dt.timedelta(hours=1))
    with transaction.atomic():
        assert rerun_from_step(task_id, 1) == 1
        claimer = OnItsOwnConnection(lambda: Task.objects.claim("w9", limit=1, queues=[QUEUE], ttl=30))
        claimer.start()
        assert claimer.outcome() == [], "a claim took a task a rerun holds"
    [claimed] = Task.objects.claim("w9", limit=1, queues=[QUEUE], ttl=30)
    assert claimed.id == task_id
    assert list(TaskStep.objects.filter(task_id=task_id).values_list("name", flat=True)) == ["a"]
