"""The zombie a durable step is fenced against, with real processes: a ``run_worker`` paused
(SIGSTOP) inside a step, past its lease; another worker takes the task over and enters the same
step; the paused one wakes (SIGCONT) and completes its step first. Its step's writes and its result
must roll back together (tasks/lifecycle/steps.py): the step committed once, by the worker that held
the task, and the stored result is that worker's. DBOS and Absurd document that this overlap records
the step twice (or the zombie's); here it cannot."""

from __future__ import annotations

import os
import signal

import pytest

from tasks.models import Task, TaskStep
from tests.helpers import wait_until
from tests.helpers.workers import Workers
from tests.testapp.models import Effect, Gate

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def test_a_worker_paused_inside_a_step_past_its_lease_has_the_whole_step_rolled_back(workers: Workers) -> None:
    task_id = Task.objects.enqueue(
        "tests.testapp.handlers.step_then_wait", kwargs={"gate": "zombie"}, max_attempts=5
    ).id
    inside = Effect.objects.filter(task_id=task_id, phase="inside").order_by("pk")
    stale = workers.start("stale", "--concurrency", "1", "--no-scheduler")
    # Inside the step's function: what it wrote so far is in the step's open transaction.
    [stale_token] = wait_until(
        lambda: list(inside.values_list("token", flat=True)), 60, what="the first worker in the step"
    )
    os.kill(stale.pid, signal.SIGSTOP)
    try:
        # Its lease lapses; the other worker recovers the task, claims it and enters the same step.
        workers.start("fresh", "--concurrency", "1", "--no-scheduler")
        wait_until(lambda: inside.count() == 2, 60, what="the second worker in the step")
        fresh_token = inside.values_list("token", flat=True)[1]
        assert fresh_token != stale_token
        Gate.objects.create(key=f"zombie:{stale_token}", open=True)
    finally:
        os.kill(stale.pid, signal.SIGCONT)
    # The paused worker wakes in its step, finishes it first and meets the fence; then it drains and stops.
    stale.send_signal(signal.SIGTERM)
    assert stale.wait(60) == 0, workers.log("stale")
    assert "outcome REJECTED (fencing)" in workers.log("stale"), workers.log("stale")[-3000:]
    assert not TaskStep.objects.filter(task_id=task_id).exists()  # nothing of the zombie's step stayed
    Gate.objects.create(key=f"zombie:{fresh_token}", open=True)
    task = wait_until(lambda: Task.objects.filter(pk=task_id, status="SUCCESSFUL").first(), 60, what="the task")
    fresh_pid = workers.procs["fresh"].pid
    assert list(Effect.objects.filter(task_id=task_id, phase="charge").values_list("token", "pid")) == [
        (fresh_token, fresh_pid)
    ]
    [stored] = TaskStep.objects.filter(task_id=task_id)
    assert (stored.name, stored.token, stored.result) == ("charge", fresh_token, {"pid": fresh_pid})
    assert task.token == fresh_token and task.return_value == {"pid": fresh_pid}
