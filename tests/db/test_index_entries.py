"""The index entries each transition of a plain task writes (issue 59: the bound on the drain). Every
index of ``tasks_task`` whose predicate holds for a row version takes an entry for it; a claim, a
renewal (it changes ``expires_at``, an indexed column) and a finish are not HOT updates, so each
writes one entry to every such index. Read from the catalog, so an index added to the hot path (or
a predicate widened) fails here and is counted on purpose: 5 at the enqueue, 2 at the claim and at
each renewal, 6 at the finish (docs/explanation/benchmarks.md, "The running rows out of the status
and holder indexes")."""

from __future__ import annotations

import pytest
from django.db import connection

from tasks.models import Task
from tests.helpers.task_paths import NOOP

pytestmark = pytest.mark.django_db(transaction=True)


def entered(task_id: int) -> set[str]:
    """The indexes of tasks_task the row's current version is in."""
    names = set()
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT c.relname, pg_get_expr(i.indpred, i.indrelid) FROM pg_index AS i"
            " JOIN pg_class AS c ON c.oid = i.indexrelid WHERE i.indrelid = 'tasks_task'::regclass"
        )
        for name, predicate in cursor.fetchall():
            if predicate is not None:
                cursor.execute(f"SELECT EXISTS (SELECT 1 FROM tasks_task WHERE id = %s AND ({predicate}))", [task_id])
                if not cursor.fetchone()[0]:
                    continue
            names.add(name)
    return names


def test_a_plain_task_writes_thirteen_index_entries_and_two_a_renewal() -> None:
    task = Task.objects.enqueue(NOOP, queue="entries")
    assert entered(task.id) == {
        "tasks_task_pkey",
        "tasks_task_claim_idx",
        "tasks_task_state_idx",
        "tasks_task_queue_newest_idx",
        "tasks_task_path_newest_idx",
    }
    [claimed] = Task.objects.claim("w", limit=1, queues=["entries"], ttl=60)
    running = {"tasks_task_pkey", "tasks_task_running_exp_idx"}
    assert entered(task.id) == running
    Task.objects.heartbeat_detail("w", [(claimed.id, claimed.token)], ttl=60, stats={}, running=1)
    assert entered(task.id) == running
    Task.objects.finish_start_claim("w", [(claimed.id, claimed.token, "null", None)], limit=0, queues=["entries"])
    assert Task.objects.get(pk=task.id).status == "SUCCESSFUL"
    assert entered(task.id) == {
        "tasks_task_pkey",
        "tasks_task_state_idx",
        "tasks_task_prune_idx",
        "tasks_task_queue_newest_idx",
        "tasks_task_path_newest_idx",
        "tasks_task_holder_state_idx",
    }
