"""Finished tasks kept in ``tasks_finished`` (issue 43; docs/explanation/finished-storage.md), read by id.

Once the maintenance leader moves a finished task out of the hot table ``tasks_task``, every reader
that looks a task up by its id (a ``django.tasks`` result, ``Task.objects.wait``, the task page, the
JSON API's task) finds it here: :meth:`FinishedOperations.find` probes the hot table, then this one.
No gap between the two: under READ COMMITTED each statement takes a new snapshot, so a move that
commits after the first probe is seen by the second, and one that committed before it is seen by
the second too; a task is final before it can be moved, so nothing about it changes meanwhile. The
other way, a rerun (:meth:`FinishedOperations.restore` and its requeue, one transaction) committed
between the two probes is found by a third, of ``tasks_task`` again, which only a miss pays.

A row read from here is a :class:`~tasks.models.Task` with ``archived`` set: read-only (``save()``
refuses it; ``delete()`` finds no row to delete in ``tasks_task``), as the row is history.

The lookup reads the primary key index of each day partition (``id`` leads it): its cost is the
number of days kept, never the rows in them."""

from __future__ import annotations

from typing import Any, TypeVar

from django.db import DEFAULT_DB_ALIAS, connections
from django.db.models import QuerySet
from django.db.models.sql.datastructures import BaseTable

from tasks.lifecycle.states import with_db_clock
from tasks.lifecycle.steps import forget_steps_ctes
from tasks.models.task_send import OperationsBase

_Q = TypeVar("_Q", bound=QuerySet[Any])

#: The partitioned table finished tasks are moved to (migration 0035).
FINISHED_TABLE = "tasks_finished"
#: Its first level: a list partition per final status, each partitioned by day.
STATUS_TABLES = {
    "SUCCESSFUL": f"{FINISHED_TABLE}_successful",
    "FAILED": f"{FINISHED_TABLE}_failed",
    "CANCELLED": f"{FINISHED_TABLE}_cancelled",
}

# A moved task read by id: the finished table's primary key (id) leads each partition's index, so one
# probe per partition; LIMIT 1, the id is unique across them.
FIND_FINISHED_SQL = "SELECT * FROM tasks_finished WHERE id = %s LIMIT 1"
# The same for its status alone (a waiter whose task the mover has taken).
FINISHED_STATUS_SQL = "SELECT status FROM tasks_finished WHERE id = %s LIMIT 1"
# A moved task back into tasks_task, as it is (final: its status, attempts, result and errors kept),
# for an operator's action that changes it: a rerun (the requeue that follows in the same transaction)
# or a delete. One statement: the row leaves tasks_finished and arrives in tasks_task together (the
# columns of both tables are in one order: a test holds them equal). An id not in tasks_finished
# (never moved, restored already by another session: the DELETE waited for it and found it gone) is
# left out of what it returns.
RESTORE_SQL = """
WITH back AS (DELETE FROM tasks_finished WHERE id = ANY(%(ids)s::bigint[]) RETURNING *)
INSERT INTO tasks_task SELECT * FROM back RETURNING id
"""
# An operator's delete of tasks kept in tasks_finished (the admin's delete of a moved task: history
# that must go before its day does, say a customer's data). Its row is deleted from its day partition
# (a dead tuple there until autovacuum or the day's retirement); an id not there is left out. Its
# steps and events go with it (forget_steps_ctes); a restore or the mover keeps them (a move).
DELETE_ARCHIVED_SQL = f"""
WITH deleted AS (DELETE FROM tasks_finished WHERE id = ANY(%(ids)s::bigint[]) RETURNING id),
{forget_steps_ctes("deleted")}
SELECT id FROM deleted
"""
# Which of the ids a statement on tasks_task did not find were moved here (an error's message only:
# no common path pays for it).
MOVED_IDS_SQL = "SELECT id, status FROM tasks_finished WHERE id = ANY(%(ids)s::bigint[]) ORDER BY id"


def archived_ids(ids: list[int], using: str) -> list[tuple[int, str]]:
    """(id, status) of those of ``ids`` kept in tasks_finished (an error message's reading only)."""
    if not ids:
        return []
    with connections[using].cursor() as cursor:
        cursor.execute(MOVED_IDS_SQL, {"ids": ids})
        return [(row[0], row[1]) for row in cursor.fetchall()]


def statuses(ids: list[int], using: str = DEFAULT_DB_ALIAS) -> dict[int, str]:
    """Status per task id wherever the task lives: tasks_task, then tasks_finished for the rest (moved),
    then tasks_task again for those in neither (a rerun brought one back between the two reads; only
    that race pays it). A pruned task is missing."""
    from tasks.models import Task  # the model module imports this one

    found = dict(Task.objects.using(using).filter(pk__in=ids).values_list("pk", "status")) if ids else {}
    if missing := [i for i in ids if i not in found]:
        found.update(archived_ids(missing, using))
        if lost := [i for i in missing if i not in found]:
            found.update(Task.objects.using(using).filter(pk__in=lost).values_list("pk", "status"))
    return found


class StatusPartition(BaseTable):
    """One final status's partition of ``tasks_finished`` under a query's alias, its ``status``
    column the constant it holds: ``(SELECT id, queue, ..., 'FAILED'::varchar AS status, ... FROM
    tasks_finished_failed) AS "tasks_task"``. PostgreSQL flattens the subquery and puts the constant
    in every condition on ``status``: one that holds is dropped, one that contradicts it (a filter on
    another status) folds the branch to nothing, and neither is checked on a row. ``tasks_finished
    WHERE status = s`` reads the same day partitions, but keeps the condition (PostgreSQL does not
    drop a condition that a partition's bound implies) and checks it on each row: an index-only scan
    of ``(holder, id)`` became a heap read per entry, 25,000 buffers for an admin count of 10,001
    at 10 M retained instead of 1,400."""

    def __init__(self, status: str, alias: str) -> None:
        super().__init__(STATUS_TABLES[status], alias)
        self.status = status

    def as_sql(self, compiler: Any, connection: Any) -> tuple[str, tuple[str | int, ...]]:
        from tasks.models import Task  # the model module imports this one

        quote = connection.ops.quote_name
        columns = ", ".join(
            f"'{self.status}'::varchar AS {quote('status')}" if field.column == "status" else quote(field.column)
            for field in Task._meta.concrete_fields
        )
        # The alias as column references name it: Django 5.2 leaves a subquery's alias (U0) bare,
        # 6.x quotes every one (quote_name_unless_alias, deprecated there, became quote_name).
        alias = getattr(compiler, "quote_name", None) or compiler.quote_name_unless_alias
        return f"(SELECT {columns} FROM {quote(self.table_name)}) {alias(self.table_alias)}", ()

    def relabeled_clone(self, change_map: dict[str | None, str]) -> StatusPartition:
        # (BaseTable's passes the table's name where this class takes the status.)
        alias = change_map.get(self.table_alias) or self.table_alias
        assert alias is not None  # an initial alias, never None
        return self.__class__(self.status, alias)


def in_finished(queryset: _Q, status: str | None = None) -> _Q:
    """``queryset`` (of Task, filtered as it is) read from ``tasks_finished`` instead of ``tasks_task``:
    the same columns and conditions, the table swapped under its alias
    (``FROM "tasks_finished" "tasks_task"``, so every column reference stays as compiled); with
    ``status``, from that status's partition (:class:`StatusPartition`: a condition on the status
    is decided once, not on each row). Filters, annotations and slices may follow, and it may
    serve inside another query (``pk__in=``, ``Exists``: the alias is registered under the table
    read, so the outer query's relabelling finds it); a lookup through another table may not (Task
    has none). Rows it returns are Tasks: callers mark them ``archived`` (:func:`archived`)."""
    moved = queryset.all()
    query = moved.query
    alias = query.get_initial_alias()
    table = BaseTable(FINISHED_TABLE, alias) if status is None else StatusPartition(status, alias)
    # (A clone shares table_map's lists with its original: new lists, not removes and appends.)
    swapped = query.alias_map[alias].table_name
    query.table_map[swapped] = [a for a in query.table_map[swapped] if a != alias]
    query.table_map[table.table_name] = [*query.table_map.get(table.table_name, []), alias]
    query.alias_map[alias] = table
    return moved


def archived(rows: Any) -> list[Any]:
    """``rows`` (Tasks read from tasks_finished) marked as history."""
    found = list(rows)
    for row in found:
        row.archived = True
    return found


class FinishedOperations(OperationsBase):
    """A base of TaskQuerySet: its methods are ``Task.objects``'s."""

    def restore(self, ids: list[int]) -> list[int]:
        """Move those of ``ids`` kept in tasks_finished back into tasks_task, unchanged (RESTORE_SQL);
        their ids. For an action that changes them next, in the caller's transaction: rolled back
        with it when the action is refused, so a task is restored only when it is rerun."""
        if not ids:
            return []
        with connections[self.db].cursor() as cursor:
            cursor.execute(RESTORE_SQL, {"ids": sorted(set(ids))})
            return [row[0] for row in cursor.fetchall()]

    def delete_archived(self, ids: list[int]) -> int:
        """Delete those of ``ids`` kept in tasks_finished (DELETE_ARCHIVED_SQL); how many."""
        if not ids:
            return 0
        with connections[self.db].cursor() as cursor:
            cursor.execute(DELETE_ARCHIVED_SQL, {"ids": sorted(set(ids))})
            return len(cursor.fetchall())

    def find(self, task_id: int) -> Any:
        """The task (a ``Task``) with this id, wherever it lives (this queryset's database): its row
        in ``tasks_task``, else its row in ``tasks_finished`` (``archived`` set), else None. A row of
        tasks_task carries the database's clock at its read (``db_now``: Task.is_stuck judges by it)."""
        live = with_db_clock(self.model._base_manager.db_manager(self.db).all())
        row = live.filter(pk=task_id).first()
        if row is not None:
            return row
        for found in self.model._base_manager.db_manager(self.db).raw(FIND_FINISHED_SQL, [task_id]):
            found.archived = True
            return found
        # In neither: a rerun brought it back to tasks_task between the two probes (its restore and
        # requeue commit together), or there is no such task. Only a miss pays this probe.
        return live.filter(pk=task_id).first()
