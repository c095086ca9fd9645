"""Durable steps, sleeps and events through a real PgBouncer in transaction pooling (issue 58): two
workers poll through a pool of three server connections, one of them SIGKILLed while tasks sleep and
wait. Each step's write commits exactly once (its fenced transaction is one pooled transaction),
every wait gets the payload sent to its task, every sleeper wakes and finishes, and no server
connection of the pool is left with a setting of ours.

Events to whole workflows go through the pool too, from another process, while a third process
cancels one of the two workflows through it: the share locks of the send and the cancel's row locks
are one pooled transaction each, so every member of the other workflow resumes with the payload once,
and each member of the cancelled one either finished with it or was cancelled, its finish refused and
each of its steps committed at most once."""

from __future__ import annotations

import os
import signal
from collections import Counter
from typing import Any

import pytest
from django.db import connection

from tasks.lifecycle.workflows import WorkflowStatus
from tasks.models import Task, TaskEvent, TaskStep, Workflow
from tasks.steps import send_event
from tasks.workflows import group, step
from tests.concurrency.test_pgbouncer import settings_of_every_server_connection
from tests.helpers import start_manage, wait_until
from tests.helpers.pgbouncer import Bouncer
from tests.helpers.workers import Workers
from tests.testapp.models import Effect

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

H = "tests.testapp.handlers."
WAITERS, SLEEPERS = 30, 20


def suspended_on_the_event(ids: list[int]) -> set[int]:
    """The tasks whose wait has begun (its deadline step stored) and has not got its event."""
    waiting = set(TaskStep.objects.filter(task_id__in=ids, name="wait:go").values_list("task_id", flat=True))
    resolved = set(TaskStep.objects.filter(task_id__in=ids, name="event:go").values_list("task_id", flat=True))
    return waiting - resolved


def test_steps_sleeps_and_events_through_pgbouncer_with_a_kill(bouncer_pool_of_3: Bouncer, workers: Workers) -> None:
    dbname = connection.settings_dict["NAME"]
    pooled: dict[str, Any] = {"DATABASE_URL": bouncer_pool_of_3.url(dbname), "DATABASE_POOLED": "true"}
    waiters = [Task.objects.enqueue(H + "event_waiter", kwargs={"event": "go"}).id for _ in range(WAITERS)]
    sleepers = [Task.objects.enqueue(H + "sleeper", kwargs={"seconds": 1.0}).id for _ in range(SLEEPERS)]
    workers.start("sw-0", "--concurrency", "4", **pooled)
    workers.start("sw-1", "--concurrency", "4", **pooled)
    # Half the waiters suspended: their events go now, the rest after the kill.
    wait_until(lambda: len(suspended_on_the_event(waiters)) >= WAITERS // 2, 120, what="half the waits to begin")
    first = sorted(suspended_on_the_event(waiters))
    for task_id in first:
        assert send_event(task_id, "go", {"to": task_id})
    os.kill(workers.procs["sw-0"].pid, signal.SIGKILL)
    workers.procs["sw-0"].wait(30)
    workers.start("sw-2", "--concurrency", "4", **pooled)
    wait_until(
        lambda: len(suspended_on_the_event(waiters)) + len(first) >= WAITERS, 120, what="every other wait to begin"
    )
    for task_id in sorted(set(waiters) - set(first)):
        assert send_event(task_id, "go", {"to": task_id})
    every = [*waiters, *sleepers]
    wait_until(
        lambda: not Task.objects.filter(pk__in=every).exclude(status="SUCCESSFUL").exists(),
        180,
        what="every task to finish",
    )

    # Each step's write committed once, whatever attempt, kill or wake came between.
    runs = Counter(Effect.objects.filter(task_id__in=every).values_list("task_id", "phase"))
    expected = {(t, phase): 1 for t in waiters for phase in ("before-event", "after-event")}
    expected |= {(t, phase): 1 for t in sleepers for phase in ("before-sleep", "after-sleep")}
    assert dict(runs) == expected
    for task in Task.objects.filter(pk__in=waiters):
        assert task.return_value == {"payload": {"to": task.id}}, (task.id, task.return_value)
    steps = Counter(TaskStep.objects.filter(task_id__in=every).values_list("name", flat=True))
    assert steps == {
        "before": WAITERS + SLEEPERS, "wait:go": WAITERS, "event:go": WAITERS, "after": WAITERS + SLEEPERS,
        "nap": SLEEPERS,
    }  # fmt: skip

    for proc in workers.procs.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in workers.procs.values():
        proc.wait(60)
    # Every server connection of the pool, each read in a transaction of its own.
    assert set(settings_of_every_server_connection(bouncer_pool_of_3, dbname).values()) == {("0", "0")}


MEMBERS = 12
FINAL = ("SUCCESSFUL", "CANCELLED")


def test_workflow_events_and_a_workflow_cancel_through_pgbouncer(
    bouncer_pool_of_3: Bouncer, workers: Workers, tmp_path: Any
) -> None:
    dbname = connection.settings_dict["NAME"]
    pooled: dict[str, Any] = {"DATABASE_URL": bouncer_pool_of_3.url(dbname), "DATABASE_POOLED": "true"}

    def through_the_pool(name: str, code: str) -> Any:
        return start_manage(tmp_path / f"{name}.log", "shell", "-c", code, **pooled)

    def ended(proc: Any, name: str) -> None:
        assert proc.wait(120) == 0, (tmp_path / f"{name}.log").read_text()

    send = "from tasks.steps import send_workflow_event as send\n"
    sent = group([step(H + "event_waiter", event="go") for _ in range(MEMBERS)], name="sent").enqueue()
    # Half the members of the other wait for "go", half for "later".
    halves = [step(H + "event_waiter", event="go" if n % 2 else "later") for n in range(MEMBERS)]
    raced = group(halves, name="raced").enqueue()
    members = [*sent.task_ids, *raced.task_ids]
    workers.start("ew-0", "--concurrency", "4", **pooled)
    workers.start("ew-1", "--concurrency", "4", **pooled)
    wait_until(
        lambda: TaskStep.objects.filter(task_id__in=members, name__startswith="wait:").count() == 2 * MEMBERS,
        120,
        what="every member to wait",
    )
    early = sorted(raced.task_ids[1::2])
    # Stored for every unfinished member (a member waiting for "later" would read it at a wait for
    # "go"); only the members waiting for it are made due.
    ended(through_the_pool("go", send + f"assert send({raced.id}, 'go', 1) == {sorted(raced.task_ids)}"), "go")
    wait_until(
        lambda: Task.objects.filter(pk__in=early, status="SUCCESSFUL").count() == len(early),
        120,
        what="the members that got 'go' to finish",
    )

    # Both through the pool at once: "later" to the half still waiting, and the cancel of their workflow
    # (whichever commits first, the other finds it); and "go" to every member of the first workflow.
    sender = through_the_pool("later", send + f"send({raced.id}, 'later', 2)\nsend({sent.id}, 'go', 3)")
    cancel = f"from tasks.models import Workflow\nprint('CANCELLED', Workflow.objects.filter(pk={raced.id}).cancel())"
    canceller = through_the_pool("cancel", cancel)
    ended(sender, "later")
    ended(canceller, "cancel")
    wait_until(
        lambda: not Task.objects.filter(pk__in=members).exclude(status__in=FINAL).exists(),
        180,
        what="every member to finish or be cancelled",
    )

    after = Counter(Effect.objects.filter(task_id__in=members, phase="after-event").values_list("task_id", flat=True))
    for task in Task.objects.filter(pk__in=sent.task_ids):
        assert (task.status, task.return_value, task.attempts) == ("SUCCESSFUL", {"payload": 3}, 1)
        assert after[task.id] == 1
    events = dict(TaskEvent.objects.filter(task_id__in=sent.task_ids, name="go").values_list("task_id", "payload"))
    assert events == dict.fromkeys(sent.task_ids, 3)
    raced_tasks = {task.id: task for task in Task.objects.filter(pk__in=raced.task_ids)}
    for task_id in early:
        assert (raced_tasks[task_id].status, raced_tasks[task_id].return_value) == ("SUCCESSFUL", {"payload": 1})
        assert after[task_id] == 1
    for task_id in raced.task_ids[0::2]:
        task = raced_tasks[task_id]
        assert task.status in FINAL
        if task.status == "SUCCESSFUL":
            assert (after[task_id], task.return_value) == (1, {"payload": 2})
        else:
            # Cancelled while it waited, or while it ran on after its event: a step that committed
            # before the cancel stays (once); the finish was refused. That no step commits after a
            # cancel (its fence) is tests/db/test_workflow_events.py's, on two connections.
            assert after[task_id] <= 1 and task.return_value is None, (task_id, after[task_id], task.return_value)
    # Whatever the order: each step of each member committed at most once.
    phases = Counter(Effect.objects.filter(task_id__in=members).values_list("task_id", "phase"))
    assert max(phases.values()) == 1, phases
    assert Workflow.objects.get(pk=sent.id).status == WorkflowStatus.SUCCESSFUL
    cancelled = sum(task.status == "CANCELLED" for task in raced_tasks.values())
    assert Workflow.objects.get(pk=raced.id).status == (
        WorkflowStatus.CANCELLED if cancelled else WorkflowStatus.SUCCESSFUL
    )
    print(f"raced: {cancelled} cancelled; {(tmp_path / 'cancel.log').read_text()[-60:]!r}")

    for proc in workers.procs.values():
        proc.send_signal(signal.SIGTERM)
    for proc in workers.procs.values():
        proc.wait(60)
    assert set(settings_of_every_server_connection(bouncer_pool_of_3, dbname).values()) == {("0", "0")}
