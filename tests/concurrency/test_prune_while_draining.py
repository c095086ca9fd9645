"""Pruning a large backlog of finished rows while real workers drain the queue: nothing unfinished
is lost, every task runs exactly once, and the pruners (the ``prune_tasks`` command and the recovery
leader's automatic pruning, at once) delete every row past its retention."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection
from django.db.models import Count

from tasks.models import Task, TaskStatus, Worker
from tests.helpers import stop_process, wait_until
from tests.testapp.models import Effect

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.one_stack]

OLD_ROWS = """
INSERT INTO tasks_task (queue, priority, task_path, args, kwargs, status, run_after, enqueued_at, finished_at,
    attempts, max_attempts, errors, worker_ids, renewals, transitions, failures, crashes, shared_crashes,
    unstarted_returns, attempt_started, attempt_isolated, errors_dropped)
SELECT 'default', 0, 'tests.testapp.handlers.noop', '[]', '{}',
       (ARRAY['SUCCESSFUL', 'FAILED', 'CANCELLED'])[1 + i %% 3], now() - interval '10 days',
       now() - interval '10 days', now() - interval '10 days' + make_interval(secs => i), 1, 3, '[]', '[]',
       0, 0, 0, 0, 0, 0, true, false, 0
FROM generate_series(1, %s) AS i
"""
#: Old finished rows (40 batches of the pruner's 500) and tasks drained meanwhile, in the proportion
#: of the 60,000 / 3,000 this test began with.
OLD, WORK = 20_000, 1_000


def test_pruning_while_workers_drain_loses_nothing_unfinished(processes: Any) -> None:
    with connection.cursor() as cursor:
        cursor.execute(OLD_ROWS, [OLD])
        cursor.execute("ANALYZE tasks_task")
    # Unfinished rows that look old in every way a careless pruner could look: never deleted.
    deferred = Task.objects.bulk_enqueue("tests.testapp.handlers.noop", [{}] * 50, queue="later")
    Task.objects.filter(pk__in=deferred).update(
        enqueued_at="2000-01-01T00:00:00Z", run_after="2100-01-01T00:00:00Z", finished_at="2000-01-01T00:00:00Z"
    )
    held = Task.objects.enqueue("tests.testapp.handlers.noop", queue="elsewhere").id
    Task.objects.claim("outside-worker", queues=["elsewhere"], ttl=600)
    Task.objects.filter(pk=held).update(finished_at="2000-01-01T00:00:00Z")

    work = Task.objects.bulk_enqueue("tests.testapp.handlers.record", [{}] * WORK)
    workers = [
        processes("run_worker", "--worker-id", f"w{i}", "--concurrency", "4", "-v", "0", name=f"w{i}") for i in range(2)
    ]
    pruner = processes("prune_tasks", "--older-than", "7d", "--batch-size", "500", name="prune")
    wait_until(
        lambda: not Task.objects.filter(pk__in=work, status__in=["READY", "RUNNING"]).exists(),
        120,
        interval=0.2,
        what="the queue to drain",
    )
    assert pruner.wait(120) == 0
    for proc in workers:
        assert stop_process(proc) == 0

    log = (processes.logs / "prune.log").read_text()
    assert "pruned in" in log, log
    assert not Task.objects.exclude(pk__in=[*work, *deferred, held]).exists(), "every old finished row is gone"
    assert Task.objects.filter(pk__in=work, status=TaskStatus.SUCCESSFUL, attempts=1).count() == WORK
    per_task = Effect.objects.values("task_id").annotate(n=Count("id"))
    assert per_task.count() == WORK and {row["n"] for row in per_task} == {1}
    assert Task.objects.filter(pk__in=deferred, status=TaskStatus.READY).count() == 50
    assert Task.objects.get(pk=held).status == TaskStatus.RUNNING
    assert Worker.objects.filter(name__in=["w0", "w1"]).count() == 2  # just stopped: kept for a week
