"""A task's durable steps and events go with it (issue 58). They are keyed by task id with no foreign
key (the mover takes a finished task to tasks_finished and it keeps them), so each statement that
deletes task rows deletes their steps and events too, in the same statement: retention's prune (plain
tasks and a workflow's members), an operator's delete (TaskQuerySet.delete_finished, the admin's page
and its bulk action), the delete of a task kept in tasks_finished, and the retirement of a day of
tasks_finished (before its table is dropped, again by the next retirement when one stopped half-way).
A move keeps them, and a delete rolled back keeps them. Each delete reads the steps' and events'
unique indexes by task id, never the whole table."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.db import connection, transaction
from django.test import Client

from tasks.exceptions import TaskNotFinished
from tasks.lifecycle.operations import DELETE_FINISHED_SQL
from tasks.maintenance import retention
from tasks.maintenance.archive import Archiver
from tasks.maintenance.history import roll_up_hours
from tasks.maintenance.partitions import FORGET_DAY_STEPS_SQL, create_ahead, retire_before
from tasks.models import Task, TaskEvent, TaskStep, Workflow
from tasks.models.finished import DELETE_ARCHIVED_SQL
from tasks.workflows import chain, step
from tests.db.test_finished_partitions import drop_partitions
from tests.helpers.task_paths import NOOP

pytestmark = pytest.mark.django_db(transaction=True)  # DETACH PARTITION ... CONCURRENTLY; second sessions

UTC = dt.timezone.utc
LONG_AGO = dt.datetime(2000, 1, 1, tzinfo=UTC)
URL = "/admin/tasks/task/"


@pytest.fixture(autouse=True)
def no_partitions_left() -> Iterator[None]:
    drop_partitions()
    yield
    drop_partitions()


def with_steps(task_id: int) -> int:
    """Two stored steps and an event for ``task_id``."""
    at = dt.datetime.now(UTC)
    for position in (0, 1):
        TaskStep.objects.create(
            task_id=task_id, position=position, name=f"s{position}", attempt=1, token=1, started_at=at, completed_at=at
        )
    TaskEvent.objects.create(task_id=task_id, name="go", payload={"n": 1}, sent_at=at, delivered=True)
    return task_id


def kept(task_id: int) -> tuple[int, int]:
    """(steps, events) of ``task_id``."""
    return TaskStep.objects.filter(task_id=task_id).count(), TaskEvent.objects.filter(task_id=task_id).count()


class RolledBack(Exception):
    pass


def rolled_back(action: Callable[[], Any]) -> Any:
    """What ``action`` returned inside a transaction that then rolled back."""
    try:
        with transaction.atomic():
            done = action()
            raise RolledBack
    except RolledBack:
        return done


def finished(status: str = "SUCCESSFUL", at: dt.datetime = LONG_AGO) -> int:
    task_id = Task.objects.enqueue(NOOP).id
    Task.objects.filter(pk=task_id).update(status=status, finished_at=at)
    return with_steps(task_id)


def moved(at: dt.datetime, status: str = "SUCCESSFUL") -> int:
    """A finished task with its steps, moved into tasks_finished as the mover moves (one statement)."""
    task_id = finished(status, at)
    with connection.cursor() as cursor:
        cursor.execute(
            "WITH m AS (DELETE FROM tasks_task WHERE id = %s RETURNING *) INSERT INTO tasks_finished SELECT * FROM m",
            [task_id],
        )
    return task_id


def test_retention_prunes_an_old_finished_task_with_its_steps_and_events() -> None:
    old = finished()
    recent = finished(at=dt.datetime.now(UTC))
    waiting = with_steps(Task.objects.enqueue(NOOP).id)
    assert retention.prune({"SUCCESSFUL": dt.timedelta(days=1)}) == {"SUCCESSFUL": 1}
    assert not Task.objects.filter(pk=old).exists()
    assert kept(old) == (0, 0)
    assert kept(recent) == kept(waiting) == (2, 1)


def test_retention_prunes_a_finished_workflow_s_members_with_their_steps() -> None:
    flow = chain(step(NOOP), step(NOOP)).enqueue()
    for _ in flow.task_ids:
        (task,) = Task.objects.claim("w1", limit=1)
        assert Task.objects.complete_many("w1", [(task.id, task.token, "null")])
    for task_id in flow.task_ids:
        with_steps(task_id)
    other = finished(at=dt.datetime.now(UTC))
    Task.objects.filter(pk__in=flow.task_ids).update(finished_at=LONG_AGO)
    Workflow.objects.filter(pk=flow.id).update(finished_at=LONG_AGO)
    assert retention.prune({"SUCCESSFUL": dt.timedelta(days=1)}) == {"SUCCESSFUL": 2}
    assert not Workflow.objects.filter(pk=flow.id).exists()
    assert [kept(task_id) for task_id in flow.task_ids] == [(0, 0), (0, 0)]
    assert kept(other) == (2, 1)


def test_an_operator_s_delete_takes_the_steps_and_a_refused_or_rolled_back_one_keeps_them() -> None:
    doomed, other = finished("FAILED"), finished("CANCELLED")
    running = with_steps(Task.objects.enqueue(NOOP).id)
    Task.objects.claim("w1", limit=1)
    with pytest.raises(TaskNotFinished, match="cancel it first"):  # refused whole: nothing deleted
        Task.objects.filter(pk__in=[doomed, running]).delete_finished()
    assert kept(doomed) == kept(running) == (2, 1)
    assert rolled_back(lambda: (Task.objects.filter(pk=doomed).delete_finished(), kept(doomed))) == (1, (0, 0))
    assert kept(doomed) == (2, 1)
    assert Task.objects.filter(pk=doomed).delete_finished() == 1
    assert kept(doomed) == (0, 0)
    assert kept(other) == kept(running) == (2, 1)


def test_the_admin_s_delete_page_and_bulk_action_take_the_steps(staff: Client) -> None:
    one, two, three, other = (finished() for _ in range(4))
    assert staff.post(f"{URL}{one}/delete/", {"post": "yes"}).status_code == 302
    response = staff.post(URL, {"action": "delete_selected", "_selected_action": [two, three], "post": "yes"})
    assert response.status_code == 302
    assert not Task.objects.filter(pk__in=[one, two, three]).exists()
    assert [kept(task_id) for task_id in (one, two, three)] == [(0, 0)] * 3
    assert kept(other) == (2, 1)


def test_the_delete_of_a_task_kept_in_tasks_finished_takes_its_steps(staff: Client) -> None:
    day = dt.datetime.now(UTC) - dt.timedelta(hours=1)
    create_ahead(1, now=day)
    archived, other = moved(day), moved(day)
    assert staff.post(f"{URL}{archived}/delete/", {"post": "yes"}).status_code == 302
    assert Task.objects.find(archived) is None
    assert kept(archived) == (0, 0)
    assert rolled_back(lambda: (Task.objects.delete_archived([other]), kept(other))) == (1, (0, 0))
    assert kept(other) == (2, 1)
    assert Task.objects.find(other) is not None


def test_the_mover_keeps_the_steps_of_what_it_moves(settings: Any) -> None:
    settings.LEASING_TASKS = {"ARCHIVE_AFTER": "10m"}
    task_id = finished(at=dt.datetime.now(UTC) - dt.timedelta(hours=3))
    roll_up_hours()
    with connection.cursor() as cursor:  # every past hour counted, as if COUNTED_MARGIN ago
        cursor.execute("UPDATE tasks_activityhourmark SET counted_at = counted_at - interval '6 minutes'")
    assert Archiver(interval=0.0).run_for(60.0) == 1
    found = Task.objects.find(task_id)
    assert found is not None and found.archived
    assert kept(task_id) == (2, 1)


DAY = dt.datetime(2020, 1, 1, 12, tzinfo=UTC)


def test_retiring_a_day_takes_the_steps_of_its_tasks_and_no_other_day_s(settings: Any) -> None:
    settings.LEASING_TASKS = {"RETENTION_BATCH_SIZE": 2}  # three tasks: the day in two batches
    create_ahead(1, now=DAY)
    gone = [moved(DAY), moved(DAY), moved(DAY), moved(DAY, "FAILED")]
    next_day = moved(DAY + dt.timedelta(days=1))
    live = finished()
    assert retire_before(DAY + dt.timedelta(hours=12)) == [
        "tasks_finished_successful_20200101",
        "tasks_finished_failed_20200101",
        "tasks_finished_cancelled_20200101",
    ]
    assert [kept(task_id) for task_id in gone] == [(0, 0)] * 4
    assert kept(next_day) == kept(live) == (2, 1)


def test_a_day_detached_but_not_dropped_loses_its_steps_at_the_next_retirement() -> None:
    create_ahead(0, now=DAY, statuses=["FAILED"])
    task_id = moved(DAY, "FAILED")
    other = finished("FAILED")
    with connection.cursor() as cursor:  # a retirement that stopped between its detach and its drop
        cursor.execute("ALTER TABLE tasks_finished_failed DETACH PARTITION tasks_finished_failed_20200101")
    assert kept(task_id) == (2, 1)
    assert retire_before(DAY + dt.timedelta(days=1), statuses=["FAILED"]) == ["tasks_finished_failed_20200101"]
    assert kept(task_id) == (0, 0)
    assert kept(other) == (2, 1)


def plan(statement: str, params: dict[str, Any]) -> str:
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN " + statement, params)
        return "\n".join(row[0] for row in cursor.fetchall())


def test_the_deletes_read_the_steps_and_events_by_their_task_id_indexes() -> None:
    """With steps and events of 5,000 other tasks, each delete probes the unique indexes whose first
    column is task_id: no sequential scan of either table."""
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO tasks_taskstep (task_id, position, name, attempt, token, result, started_at, completed_at)"
            " SELECT -n, p, 's', 1, 1, NULL, now(), now()"
            " FROM generate_series(1, 5000) AS n, generate_series(0, 1) AS p"
        )
        cursor.execute(
            "INSERT INTO tasks_taskevent (task_id, name, payload, sent_at, delivered)"
            " SELECT -n, 'go', NULL, now(), true FROM generate_series(1, 5000) AS n"
        )
        cursor.execute("ANALYZE tasks_taskstep")
        cursor.execute("ANALYZE tasks_taskevent")
    create_ahead(0, now=DAY, statuses=["SUCCESSFUL"])
    statements: dict[str, tuple[str, dict[str, Any]]] = {
        "delete": (DELETE_FINISHED_SQL, {"ids": [1, 2, 3]}),
        "archived": (DELETE_ARCHIVED_SQL, {"ids": [1, 2, 3]}),
        "prune": (
            retention.PRUNE_TASKS_SQL,
            {"status": "SUCCESSFUL", "queue": None, "age": 86400, "after_at": LONG_AGO, "after_id": 0, "limit": 1000},
        ),
        "day": (FORGET_DAY_STEPS_SQL.format(table="tasks_finished_successful_20200101"), {"after": 0, "limit": 1000}),
    }
    for name, (statement, params) in statements.items():
        text = plan(statement, params)
        assert "Seq Scan on tasks_taskstep" not in text and "Seq Scan on tasks_taskevent" not in text, (name, text)
        assert "tasks_taskstep_task_position" in text and "tasks_taskevent_task_name" in text, (name, text)


def test_orphaned_steps_and_events_are_swept_a_batch_at_a_time_and_kept_tasks_keep_theirs() -> None:
    """Rows whose task is in neither table (left before the deletes took them, or by a hand edit) go,
    a batch of task ids per call, from a cursor that goes on where the last batch stopped."""
    day = dt.datetime.now(UTC) - dt.timedelta(hours=1)
    create_ahead(0, now=day)
    live, archived = finished(), moved(day)
    orphans = [with_steps(task_id) for task_id in (archived + 1000, archived + 2000, archived + 3000)]
    TaskEvent.objects.create(task_id=archived + 4000, name="late", sent_at=dt.datetime.now(UTC))  # alone
    lone = archived + 4000
    after: dict[str, int] = {}
    assert retention.sweep_orphans(after, limit=2) == 0  # the live and the moved task: kept
    assert after == {"steps": archived, "events": archived}
    assert retention.sweep_orphans(after, limit=2) == 2 * 2 + 2  # the first two orphans' steps and events
    assert after == {"steps": orphans[1], "events": orphans[1]}
    assert [kept(task_id) for task_id in orphans] == [(0, 0), (0, 0), (2, 1)]
    assert retention.sweep_orphans(after, limit=2) == 2 + 2  # the third's steps; its event and the lone one
    assert after == {"steps": 0, "events": lone}  # the steps' end reached: their next batch starts again
    assert [kept(task_id) for task_id in orphans] == [(0, 0)] * 3
    assert not TaskEvent.objects.filter(task_id=lone).exists()
    assert retention.sweep_orphans(after, limit=2) == 0
    assert after == {"steps": archived, "events": 0}
    assert kept(live) == kept(archived) == (2, 1)


def test_the_leader_s_retention_pass_sweeps_orphans_once_it_completes(settings: Any) -> None:
    settings.LEASING_TASKS = {"RETENTION_BATCH_SIZE": 10}
    live = finished(at=dt.datetime.now(UTC))
    orphan = with_steps(live + 1000)
    pruner = retention.AutoPruner(interval=3600.0)
    pruner.run_for(60.0)
    assert pruner.idle
    assert kept(orphan) == (0, 0)
    assert kept(live) == (2, 1)


def test_the_orphan_sweep_reads_the_indexes() -> None:
    """Each batch reads its table's index from the cursor on, and probes the tasks by primary key: with
    2,000 tasks, their steps and events, no sequential scan of any of them."""
    create_ahead(0, now=DAY)  # a day of tasks_finished, probed by its primary key too
    model = finished()
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO tasks_task SELECT (jsonb_populate_record(NULL::tasks_task, to_jsonb(t)"
            " || jsonb_build_object('id', t.id + n))).* FROM tasks_task AS t, generate_series(1, 2000) AS n"
            " WHERE t.id = %s",
            [model],
        )
        cursor.execute("DELETE FROM tasks_task WHERE id = %s", [model])
        cursor.execute("ANALYZE tasks_task")
        cursor.execute(
            "INSERT INTO tasks_taskstep (task_id, position, name, attempt, token, result, started_at, completed_at)"
            " SELECT %s + n, p, 's', 1, 1, NULL, now(), now()"
            " FROM generate_series(1, 2000) AS n, generate_series(0, 1) AS p",
            [model],
        )
        cursor.execute(
            "INSERT INTO tasks_taskevent (task_id, name, payload, sent_at, delivered)"
            " SELECT %s + n, 'go', NULL, now(), true FROM generate_series(1, 2000) AS n",
            [model],
        )
        cursor.execute("ANALYZE tasks_taskstep")
        cursor.execute("ANALYZE tasks_taskevent")
    for table, index in (("steps", "tasks_taskstep_task_position"), ("events", "tasks_taskevent_task_name")):
        text = plan(retention.ORPHANS_SQL[table], {"after": model + 500, "limit": 1000})
        # (An empty day partition is read whole, as the planner should: no page to probe.)
        scanned = [line for line in text.splitlines() if "Seq Scan" in line and "tasks_finished_" not in line]
        assert not scanned, (table, text)
        assert index in text and "tasks_task_pkey" in text, (table, text)
