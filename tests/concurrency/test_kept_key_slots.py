"""A key's limit bounds its handlers running, timeouts included (issue 20, item 7).

Reported: limit 1, handlers of 5 s, ``timeout=1``: the database never counted more than one, yet five
handlers of the key ran at once, because a timed-out thread cannot be stopped and its slot went to
the next task. Now a timed-out attempt keeps its slot until its handler returns, or until its worker
is known dead (tasks/lifecycle/concurrency.py). Spans are read on the database clock from the handlers' own
start and end marks.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest

from tasks.models import ConcurrencyHold, Task, TaskStatus
from tests.concurrency.test_concurrency_keys import SPAN, all_finished, max_overlap
from tests.helpers import wait_until
from tests.helpers.workers import Workers
from tests.testapp.models import Effect, Gate

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.one_stack]


def serial(n: int, key: str, **kwargs: Any) -> list[int]:
    options: dict[str, Any] = {"concurrency_key": key, "concurrency_limit": 1, "timeout": 0.5, "max_attempts": 1}
    return [Task.objects.enqueue(SPAN, kwargs=kwargs, **options).id for _ in range(n)]


def ended(task_ids: list[int]) -> int:
    return Effect.objects.filter(task_id__in=task_ids, phase="ended").count()


def test_timed_out_handlers_of_a_serial_key_never_run_side_by_side(workers: Workers) -> None:
    ids = serial(4, "serial", seconds=1.5)
    workers.start("w", "--concurrency", "4")
    wait_until(lambda: all_finished(ids) and ended(ids) == 4, 60, 0.1, what="every handler to return")
    rows = Task.objects.filter(pk__in=ids)
    assert set(rows.values_list("status", flat=True)) == {TaskStatus.FAILED}
    assert all(row.errors[-1]["exception_class_path"] == "tasks.exceptions.TaskTimeout" for row in rows)
    assert max_overlap("serial") == 1  # before: 4 (every handler ran at once)
    wait_until(lambda: not ConcurrencyHold.objects.exists(), 10, what="the last kept slot to be given back")


def test_a_kept_slot_goes_when_its_worker_is_known_dead(workers: Workers) -> None:
    Gate.objects.create(key="stuck")
    stuck, waiting = serial(2, "k", gate="stuck")
    doomed = workers.start("doomed", "--concurrency", "2", "--no-recovery")
    wait_until(lambda: Task.objects.get(pk=stuck).status == TaskStatus.FAILED, 30, what="the timeout to be recorded")
    # Its handler still waits at the gate: the slot is kept, the next task of the key waits.
    assert list(ConcurrencyHold.objects.values_list("task_id", "reason")) == [(stuck, "timeout")]
    assert Task.objects.get(pk=waiting).status == TaskStatus.BLOCKED

    os.kill(doomed.pid, signal.SIGKILL)
    doomed.wait(10)
    Gate.objects.filter(key="stuck").update(open=True)  # the second task must not wait on it
    workers.start("rescuer", "--concurrency", "2")
    # Presumed dead after 2 x TTL of silence; recovery then gives the slot back and admits the next.
    wait_until(lambda: Task.objects.get(pk=waiting).status == TaskStatus.SUCCESSFUL, 30, what="the next task")
    assert not ConcurrencyHold.objects.exists()
    assert Effect.objects.filter(task_id=stuck, phase="ended").count() == 0  # killed mid-handler
