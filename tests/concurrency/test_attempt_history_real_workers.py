"""Issue 41's attempts table attacked with real worker processes: one task's attempts end by a
SIGKILL (recovery charges or excuses it), a SIGTERM during the long handler (handed back at
shutdown), a timeout, an operator's cancel while it runs, a Retry, and a success. Every attempt
appears once, in order, with its own worker, outcome and error, and every entry that ends an attempt
carries the position of that attempt in ``worker_ids``. Waits poll the database; nothing sleeps."""

from __future__ import annotations

import os
import signal

import pytest

from tasks.models import Task, TaskStatus
from tasks.web import attempts
from tests.helpers import wait_until
from tests.helpers.workers import Workers
from tests.testapp.models import Gate

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.one_stack]

GATE = "attempts-41"


def started_by(workers: Workers, name: str, task_id: int) -> None:
    """Wait until ``name``'s process runs the task's handler (the attempt started)."""
    worker_id = workers.ids[name]
    wait_until(
        lambda: Task.objects.filter(
            pk=task_id, status=TaskStatus.RUNNING, holder=worker_id, attempt_started=True
        ).exists(),
        60,
        what=f"{name} to start the task",
    )


def test_every_way_a_real_worker_ends_an_attempt_one_row_each_in_order(workers: Workers) -> None:
    Gate.objects.create(key=GATE, open=False)
    task_id = Task.objects.enqueue("tests.testapp.handlers.block", kwargs={"gate": GATE}, max_attempts=8).id

    # 1: SIGKILLed mid-handler; recovery (here, the test's own rounds) ends the attempt.
    doomed = workers.start("doomed41", "--no-recovery")
    started_by(workers, "doomed41", task_id)
    os.kill(doomed.pid, signal.SIGKILL)
    doomed.wait(10)

    def recovered() -> bool:
        Task.objects.recover_expired()
        return not Task.objects.filter(pk=task_id, status=TaskStatus.RUNNING).exists()

    wait_until(recovered, 30, interval=0.2, what="recovery of the killed worker's attempt")

    # 2: SIGTERM while the handler blocks: handed back at shutdown (no grace).
    stopping = workers.start("stopping41", "--no-recovery", "--shutdown-grace", "0")
    started_by(workers, "stopping41", task_id)
    stopping.send_signal(signal.SIGTERM)
    assert stopping.wait(30) == 0, workers.log("stopping41")

    # 3: an operator cancels the running attempt (its worker's late result is refused), then Retry.
    Task.objects.filter(pk=task_id).update(timeout=1.0)
    workers.start("steady41")
    started_by(workers, "steady41", task_id)
    assert Task.objects.filter(pk=task_id).cancel() == 1
    assert Task.objects.filter(pk=task_id).requeue() == 1

    # 4: the same worker times out the handler (timeout 1 s, gate closed), 5: succeeds once the gate opens.
    wait_until(
        lambda: any(
            e.get("exception_class_path", "").endswith("TaskTimeout") for e in Task.objects.get(pk=task_id).errors
        ),
        60,
        what="the timeout's failure",
    )
    Gate.objects.filter(key=GATE).update(open=True)
    wait_until(lambda: Task.objects.get(pk=task_id).status == TaskStatus.SUCCESSFUL, 60, what="the success")

    task = Task.objects.get(pk=task_id)
    history = attempts.history(task)
    rows = [(a.number, a.worker, a.outcome, (a.error or {}).get("kind")) for a in history.attempts]
    ids = workers.ids
    assert [r[0] for r in rows] == list(range(1, len(task.worker_ids) + 1))
    assert rows[0][1] == ids["doomed41"] and rows[0][2].startswith("Lost its worker"), rows
    assert rows[1][1:] == (ids["stopping41"], "Handed back at shutdown", "shutdown"), rows
    assert rows[2][1:] == (ids["steady41"], "Cancelled", "cancel"), rows
    assert rows[3][1:3] == (ids["steady41"], "Failed"), rows
    assert rows[3][3] == "failure" and (history.attempts[3].error or {})["exception_class_path"].endswith("TaskTimeout")
    # Any more attempts between (the timeout's retries while the gate was closed) failed the same way;
    # the last one succeeded.
    assert all(r[2] == "Failed" for r in rows[3:-1]), rows
    assert rows[-1][1:3] == (ids["steady41"], "Successful"), rows
    # Each ending entry names its attempt's place, and the events are only what ended no attempt.
    for attempt in history.attempts:
        if attempt.error is not None:
            assert attempt.error["position"] == attempt.number
            assert task.worker_ids[attempt.error["position"] - 1] == attempt.error["worker"]
    assert all(not attempts.ends_an_attempt(e) for e in history.events), history.events
