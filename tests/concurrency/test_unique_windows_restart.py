"""A unique_for window across a worker that dies and comes back under the same ``--worker-id``: the
window is a row of tasks_uniquekey that no worker statement touches, so the task that opened it is
recovered, claimed by the new process and finishes under the same window, and every enqueue of the key
inside the window (while it runs, once it finished) is answered with that task."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

from tasks.models import Task, TaskStatus, UniqueKey
from tests.helpers import start_manage, wait_until, worker_names
from tests.testapp.models import Gate

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

FAST = ("--ttl", "2", "--recovery-interval", "0.5", "--no-scheduler", "--poll-interval", "0.1", "--concurrency", "1")


def enqueue() -> Any:
    return Task.objects.enqueue(
        "tests.testapp.handlers.block", kwargs={"gate": "nightly"}, dedup_key="nightly", unique_for=600
    )


def window() -> tuple[int, Any, Any]:
    key = UniqueKey.objects.get(key="nightly")
    return key.task_id, key.accepted_at, key.expires_at


def test_a_window_outlives_its_worker_killed_and_restarted_under_the_same_id(tmp_path: Path, procs: list) -> None:
    Gate.objects.create(key="nightly")
    first = enqueue()
    assert first.created
    opened = window()
    old = start_manage(tmp_path / "old.log", "run_worker", "--worker-id", "nightly-worker", *FAST)
    procs.append(old)
    wait_until(lambda: Task.objects.filter(pk=first.id, attempt_started=True).exists(), 60, what="the first start")
    old_holder = Task.objects.get(pk=first.id).holder
    old.send_signal(signal.SIGKILL)
    old.wait(30)

    new = start_manage(tmp_path / "new.log", "run_worker", "--worker-id", "nightly-worker", *FAST)
    procs.append(new)

    def running_again() -> bool:
        task = Task.objects.get(pk=first.id)
        return task.status == TaskStatus.RUNNING and task.holder != old_holder and task.attempt_started

    wait_until(running_again, 90, what="the task recovered and started again by the new process")
    task = Task.objects.get(pk=first.id)
    assert worker_names([old_holder, task.holder]) == ["nightly-worker", "nightly-worker"]
    assert task.attempts == 2, (task.attempts, task.crashes, task.unstarted_returns)
    assert window() == opened  # recovery and the new claim left the window alone
    again = enqueue()
    assert (again.id, again.created) == (first.id, False)

    Gate.objects.filter(key="nightly").update(open=True)
    wait_until(lambda: Task.objects.filter(pk=first.id, status=TaskStatus.SUCCESSFUL).exists(), 60, what="success")
    after = enqueue()  # finished, inside the window: still refused
    assert (after.id, after.created) == (first.id, False)
    assert window() == opened
    assert Task.objects.filter(dedup_key="nightly").count() == 1
