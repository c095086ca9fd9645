"""Worker names an operator may give, and namesakes that live at once.

Found by breaker 20, item 1 (the bug hunt on issue 20: concurrency keys and worker identity at scale)."""

from __future__ import annotations

import os
import signal

import pytest
from django.core.management import CommandError, call_command

from tasks.models import Task, TaskStatus, Worker
from tests.helpers import wait_until, worker_names
from tests.helpers.workers import Workers
from tests.testapp.models import Effect, Gate

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

QUIET = ("--ttl", "5", "--no-recovery", "--no-scheduler", "--poll-interval", "0.1", "--concurrency", "1")


@pytest.mark.parametrize("name", ["pod:web-0:7", "wörker-日本-🙂", "x" * 190, " padded "])
def test_a_printable_name_of_up_to_190_characters_runs_tasks(name: str) -> None:
    task = Task.objects.enqueue("tests.testapp.handlers.record")
    call_command("run_worker", "--worker-id", name, "--max-tasks", "1", *QUIET)
    row = Task.objects.get(pk=task.id)
    assert row.status == TaskStatus.SUCCESSFUL
    assert worker_names(row.worker_ids) == [name]
    [worker] = Worker.objects.all()
    assert worker.name == name and worker.id.startswith(name + ":") and worker.stopped_at is not None


@pytest.mark.parametrize(
    ("bad", "reason"),
    [("\x00nul", "printable"), ("line\nbreak", "printable"), ("zero\u200bwidth", "printable"), ("   ", "non-empty")],
)
def test_names_that_cannot_be_stored_or_read_are_refused_clearly(bad: str, reason: str) -> None:
    with pytest.raises(CommandError, match=reason):
        call_command("run_worker", "--worker-id", bad, *QUIET)
    assert not Worker.objects.exists()


def test_two_live_namesakes_and_one_sigkilled_never_run_a_task_twice(workers: Workers) -> None:
    """Two processes started with one --worker-id at once (a misconfigured replica set). One is
    SIGKILLed holding a task; the other holds one too. Recovery (in the survivor) must requeue only the
    dead one's task, never the live namesake's, and each task runs to the end once per attempt."""
    Gate.objects.create(key="g")
    ids = [Task.objects.enqueue("tests.testapp.handlers.block", kwargs={"gate": "g"}).id for _ in range(2)]
    victim = workers.start("twin", "--concurrency", "1", "--no-recovery")
    wait_until(lambda: Task.objects.filter(holder=workers.ids["twin"], attempt_started=True).exists(), 30)
    victim_id = workers.ids["twin"]
    workers.procs["twin-victim"] = workers.procs.pop("twin")
    workers.start("twin", "--concurrency", "1")  # the survivor, same name, recovery on
    survivor_id = workers.ids["twin"]
    assert victim_id != survivor_id
    wait_until(lambda: Task.objects.filter(holder=survivor_id, attempt_started=True).exists(), 30)
    survivor_task = Task.objects.get(holder=survivor_id, status=TaskStatus.RUNNING)
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait(10)
    # The victim is presumed dead after 2 x TTL (2 s); recovery requeues its task only.
    wait_until(lambda: Worker.objects.get(pk=victim_id).stopped_at is not None, 30, 0.1, what="presumed dead")
    [victim_task] = [i for i in ids if i != survivor_task.id]
    wait_until(lambda: Task.objects.get(pk=victim_task).status == TaskStatus.READY, 30, 0.1, what="the requeue")
    row = Task.objects.get(pk=survivor_task.id)
    assert (row.status, row.holder, row.token) == (TaskStatus.RUNNING, survivor_id, survivor_task.token)
    assert Worker.objects.get(pk=survivor_id).stopped_at is None
    Gate.objects.filter(key="g").update(open=True)
    wait_until(lambda: Task.objects.filter(pk__in=ids, status=TaskStatus.SUCCESSFUL).count() == 2, 60, 0.1, what="both")
    assert Effect.objects.filter(task_id=survivor_task.id, phase="started").count() == 1
    assert Task.objects.get(pk=survivor_task.id).worker_ids == [survivor_id]
