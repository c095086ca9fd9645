"""The recovery round's repair sweep (tasks/maintenance/repair.py), and every duty of the recovery leader
run the other documented ways: ``recover_tasks --once`` (a cron line) and Celery beat's
``tasks.recover_expired`` (issue 38, items 1 and 3).

The settle no longer strands anything (tests/db/test_workflow_settle_races.py), so a stranded member
is made by hand: a statement that fires no trigger, as a restore or a hand-written fix would."""

from __future__ import annotations

import datetime as dt
import threading
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection, transaction

from tasks.celery import recover_expired
from tasks.conf import get_settings
from tasks.maintenance.partitions import partitions
from tasks.maintenance.recovery import recover_once
from tasks.maintenance.repair import repair_stranded
from tasks.models import ActivityHourMark, BulkOperation, Repair, Task
from tasks.models import Workflow as WorkflowRow
from tasks.workflows import chain, step
from tests.db.test_finished_partitions import drop_partitions
from tests.db.test_history import finished, hour_ago
from tests.db.test_workflow_settle_races import claim_one, finish, run_all, state
from tests.helpers.connections import OnItsOwnConnection

pytestmark = pytest.mark.django_db(transaction=True)

NOOP = "tests.testapp.handlers.noop"


def strand_a_dependant() -> tuple[int, int, int]:
    """chain(A, B) enqueued; A made SUCCESSFUL by a statement that fires no trigger (a restore under
    ``session_replication_role = replica``, a hand-written fix): B waits for a parent that is final,
    and the workflow counts A as unfinished. (An operator's requeue inside REPEATABLE READ, the other
    way a snapshot could hide a finish, fails with a serialization error on the workflow row: it
    strands nothing.)"""
    done = chain(step(NOOP), step("tests.testapp.handlers.echo"), pipe=True).enqueue()
    a, b = done.task_ids
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET LOCAL session_replication_role = replica")
        cursor.execute(
            "UPDATE tasks_task SET status = 'SUCCESSFUL', finished_at = clock_timestamp(), return_value = '7'"
            " WHERE id = %s",
            [a],
        )
    assert state(a, b) == [("SUCCESSFUL", 0), ("AWAITING", 1)]
    return done.id, a, b


def repairs() -> dict[str, int]:
    return dict(Repair.objects.values_list("kind", "count"))


@pytest.mark.repairs
def test_the_sweep_releases_a_member_stranded_behind_final_parents_and_ends_its_workflow() -> None:
    flow, a, b = strand_a_dependant()
    report = recover_once()
    assert report.repairs.dependants == [(b, "READY")]
    assert repairs() == {"dependant": 1}
    assert Repair.objects.get().last_task_id == b
    assert Task.objects.get(pk=b).args[0] == 7, "its parent's result piped in, as the settle does"
    run_all()
    assert state(a, b) == [("SUCCESSFUL", 0), ("SUCCESSFUL", 0)]
    # A's count on the workflow was lost with its settle: the workflow waits for a member that is final.
    assert WorkflowRow.objects.get(pk=flow).status == "RUNNING"
    report = recover_once()
    assert (report.repairs.dependants, report.repairs.workflows) == ([], [flow])
    assert WorkflowRow.objects.get(pk=flow).status == "SUCCESSFUL"
    assert repair_stranded().empty, "a second sweep finds nothing"
    assert repairs() == {"dependant": 1, "workflow": 1}


@pytest.mark.repairs
def test_the_sweep_cancels_a_member_stranded_behind_a_failed_parent() -> None:
    flow, a, b = strand_a_dependant()
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET LOCAL session_replication_role = replica")  # no trigger: a lost settle
        cursor.execute("UPDATE tasks_task SET status = 'FAILED' WHERE id = %s", [a])
    report = repair_stranded()
    assert report.dependants == [(b, "CANCELLED")]
    row = Task.objects.get(pk=b)
    assert row.errors[-1]["exception_class_path"] == "tasks.exceptions.DependencyFailed"
    assert f"task {a}" in row.errors[-1]["message"]
    # B's cancel counted itself on the workflow; A's count was lost with its settle: the same sweep ends it.
    assert report.workflows == [flow]
    assert WorkflowRow.objects.get(pk=flow).status == "FAILED"


def test_the_sweep_leaves_members_that_legitimately_wait() -> None:
    """A chain in progress, a member behind a RUNNING parent, a parent's finish uncommitted: nothing
    to repair."""
    waiting = chain(step(NOOP), step(NOOP), step(NOOP)).enqueue()
    claimed = claim_one(waiting.task_ids[0])
    holding, release = threading.Event(), threading.Event()

    def finish_uncommitted() -> None:
        with transaction.atomic():
            finish(claimed)
            holding.set()
            assert release.wait(60)

    finisher = OnItsOwnConnection(finish_uncommitted)
    finisher.start()
    try:
        assert holding.wait(60)
        assert repair_stranded().empty
    finally:
        release.set()
    finisher.outcome()
    assert repair_stranded().empty
    run_all()
    assert WorkflowRow.objects.get(pk=waiting.id).status == "SUCCESSFUL"
    assert repairs() == {}


@pytest.mark.repairs
def test_the_sweep_ends_a_workflow_whose_count_was_lost() -> None:
    done = chain(step(NOOP), step(NOOP)).enqueue()
    run_all()
    WorkflowRow.objects.filter(pk=done.id).update(status="RUNNING", remaining=1, finished_at=None)
    report = repair_stranded()
    assert report.workflows == [done.id]
    row = WorkflowRow.objects.get(pk=done.id)
    assert (row.status, row.remaining, row.failed) == ("SUCCESSFUL", 0, 0)
    assert row.finished_at is not None
    assert repairs() == {"workflow": 1}


@pytest.mark.repairs
def test_repairs_are_in_the_metrics() -> None:
    from tasks.web.metrics import task_metrics

    strand_a_dependant()
    recover_once()
    (family,) = [m for m in task_metrics() if m.name == "tasks_repairs"]
    assert {(s.labels["kind"], s.value) for s in family.samples if s.name == "tasks_repairs_total"} == {
        ("dependant", 1.0),
        ("workflow", 0.0),
    }


# -- every duty, however recovery runs --------------------------------------------------------------


def a_pending_bulk_retry_and_a_finished_hour() -> tuple[int, Any, dt.datetime]:
    (failed,) = Task.objects.bulk_enqueue(NOOP, [{}], queue="bulk")
    Task.objects.filter(pk=failed).update(status="FAILED", finished_at=dt.datetime.now(dt.timezone.utc))
    operation = BulkOperation.objects.request("retry", {"queue": "bulk"}, requested_by="ops")
    hour = hour_ago(2)
    finished(hour)
    return failed, operation, hour


def test_recover_tasks_once_runs_the_bulk_operations_and_counts_the_history() -> None:
    failed, operation, hour = a_pending_bulk_retry_and_a_finished_hour()
    out = StringIO()
    call_command("recover_tasks", "--once", stdout=out)
    operation.refresh_from_db()
    assert operation.status == "DONE", operation.status
    assert Task.objects.get(pk=failed).status == "READY"
    assert ActivityHourMark.objects.filter(hour=hour).exists()
    assert "bulk operations changed 1 tasks" in out.getvalue()


def test_celery_beats_recovery_runs_the_bulk_operations_and_counts_the_history() -> None:
    failed, operation, hour = a_pending_bulk_retry_and_a_finished_hour()
    result = recover_expired()
    operation.refresh_from_db()
    assert operation.status == "DONE"
    assert Task.objects.get(pk=failed).status == "READY"
    assert ActivityHourMark.objects.filter(hour=hour).exists()
    assert result["bulk_changed"] == 1
    assert result["history_hours"] >= 1


def test_a_duty_that_fails_leaves_the_others_running_and_the_cron_line_exits_non_zero() -> None:
    """The history count meets a lock it may not wait for (another session holds tasks_activityhour
    in SHARE mode, as a long export would; this session's lock_timeout is 300 ms): a real database
    error in the middle of ``recover_tasks --once``. The duties before and after it still run (the
    bulk operation ends, the finished tasks' days are created), the hour stays uncounted for the next
    run, and the command fails, naming the duty, so a cron line's owner hears of it."""
    drop_partitions()  # what another test of this database left
    failed, operation, hour = a_pending_bulk_retry_and_a_finished_hour()
    locked, release = threading.Event(), threading.Event()

    def hold() -> None:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("LOCK TABLE tasks_activityhour IN SHARE MODE")
            locked.set()
            release.wait(60)

    holder = OnItsOwnConnection(hold)
    holder.start()
    assert locked.wait(30)
    with connection.cursor() as cursor:
        cursor.execute("SET lock_timeout = '300ms'")
    out = StringIO()
    try:
        with pytest.raises(CommandError, match=r"failed: history: .*lock timeout"):
            call_command("recover_tasks", "--once", stdout=out)
    finally:
        release.set()
        holder.outcome()
        with connection.cursor() as cursor:  # the duty's failure closed the connection, or it is still this one
            cursor.execute("RESET lock_timeout")
    operation.refresh_from_db()
    assert operation.status == "DONE" and Task.objects.get(pk=failed).status == "READY"
    assert not ActivityHourMark.objects.filter(hour=hour).exists()
    assert len(partitions()) == 3 * (1 + get_settings().FINISHED_DAYS_AHEAD)  # the last duty ran
    assert "bulk operations changed 1 tasks" in out.getvalue()
    call_command("recover_tasks", "--once", stdout=StringIO())  # the lock gone, the next run counts it
    assert ActivityHourMark.objects.filter(hour=hour).exists()
    drop_partitions()
