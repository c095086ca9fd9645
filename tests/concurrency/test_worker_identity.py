"""A worker's identity is one process's lifetime, whatever name it was started with.

Kubernetes StatefulSets, systemd template units and "restart at once" scripts start a new process
under the name of one that may still be draining. Each start holds its leases under its own id
(``name:suffix``), so the old process's stop record, death or reconcile never reaches the new one's
leases: no task is expired under a live handler and run a second time.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

from tasks.models import Task, TaskStatus, Worker
from tests.helpers import start_manage, wait_until, worker_names
from tests.testapp.models import Effect, Gate

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

# A long TTL (heartbeats 10 s apart) and no recovery thread in the workers: the test runs the
# recovery round itself at the moment that matters, so nothing but the code under test decides.
QUIET = ("--ttl", "30", "--no-recovery", "--no-scheduler", "--poll-interval", "0.1", "--concurrency", "1", "-v", "2")


def started(task_id: int) -> bool:
    return Task.objects.filter(pk=task_id, attempt_started=True).exists()


def test_a_restart_under_the_same_name_keeps_its_leases_when_the_draining_predecessor_stops(
    tmp_path: Path, procs: list
) -> None:
    Gate.objects.create(key="old")
    Gate.objects.create(key="new")
    first = Task.objects.enqueue("tests.testapp.handlers.block", kwargs={"gate": "old"}).id
    old = start_manage(tmp_path / "old.log", "run_worker", "--worker-id", "x", "--shutdown-grace", "60", *QUIET)
    procs.append(old)
    wait_until(lambda: started(first), 30, what="the first task to start under the old process")

    old.send_signal(signal.SIGTERM)  # drains: its task goes on, it claims nothing more
    wait_until(lambda: b"draining" in (tmp_path / "old.log").read_bytes(), 30, what="the old process to drain")
    new = start_manage(tmp_path / "new.log", "run_worker", "--worker-id", "x", *QUIET)
    procs.append(new)
    second = Task.objects.enqueue("tests.testapp.handlers.block", kwargs={"gate": "new"}).id
    wait_until(lambda: started(second), 30, what="the second task to start under the new process")

    old_id, new_id = Task.objects.get(pk=first).holder, Task.objects.get(pk=second).holder
    assert old_id != new_id and worker_names([old_id, new_id]) == ["x", "x"]
    assert set(Worker.objects.filter(name="x").values_list("id", flat=True)) == {old_id, new_id}
    token = Task.objects.get(pk=second).token

    Gate.objects.filter(key="old").update(open=True)
    assert old.wait(30) == 0
    assert Worker.objects.get(pk=old_id).stopped_at is not None  # the old one said it stopped ...
    call_command("recover_tasks", "--once")  # ... and recovery runs right then

    # The new process's lease is untouched: same holder, same token, still live.
    row = Task.objects.get(pk=second)
    assert (row.status, row.holder, row.token) == (TaskStatus.RUNNING, new_id, token)
    assert row.expires_at > timezone.now()
    assert Worker.objects.get(pk=new_id).stopped_at is None

    Gate.objects.filter(key="new").update(open=True)
    wait_until(lambda: Task.objects.get(pk=second).status == TaskStatus.SUCCESSFUL, 30, what="the second task")
    done = Task.objects.get(pk=second)
    assert (done.attempts, done.worker_ids, done.errors) == (1, [new_id], [])
    assert Effect.objects.filter(task_id=second, phase="started").count() == 1
    first_row = Task.objects.get(pk=first)
    assert (first_row.status, first_row.worker_ids) == (TaskStatus.SUCCESSFUL, [old_id])


def test_a_worker_name_that_cannot_be_stored_is_refused_at_start() -> None:
    for bad, reason in (("", "non-empty"), ("x" * 191, "at most 190 characters"), ("tab\there", "printable")):
        with pytest.raises(CommandError, match=reason):
            call_command("run_worker", "--worker-id", bad, *QUIET)
    assert not Worker.objects.exists()
