"""Finished tasks kept in ``tasks_finished`` (issue 43; docs/explanation/finished-storage.md), read by id.

Once the maintenance leader moves a finished task out of the hot table ``tasks_task``, every reader
that looks a task up by its id (a ``django.tasks`` result, ``Task.objects.wait``, the task page, the
JSON API's task) finds it here: :meth:`FinishedOperations.find` probes the hot table, then this one.
No gap between the two: under READ COMMITTED each statement takes a new snapshot, so a move that
commits after the first probe is seen by the second, and one that committed before it is seen by
the second too; a task is final before it can be moved, so nothing about it changes meanwhile.

A row read from here is a :class:`~tasks.models.Task` with ``archived`` set: read-only (``save()``
refuses it; ``delete()`` finds no row to delete in ``tasks_task``), as the row is history.

The lookup reads the primary key index of each day partition (``id`` leads it): its cost is the
number of days kept, never the rows in them."""

from __future__ import annotations

from typing import Any

from tasks.models.task_send import OperationsBase

FIND_FINISHED_SQL = "SELECT * FROM tasks_finished WHERE id = %s LIMIT 1"
FINISHED_STATUS_SQL = "SELECT status FROM tasks_finished WHERE id = %s LIMIT 1"
# Which of the ids a statement on tasks_task did not find were moved here (an error's message only:
# no common path pays for it).
MOVED_IDS_SQL = "SELECT id, status FROM tasks_finished WHERE id = ANY(%(ids)s::bigint[]) ORDER BY id"


class FinishedOperations(OperationsBase):
    """A base of TaskQuerySet: its methods are ``Task.objects``'s."""

    def find(self, task_id: int) -> Any:
        """The task (a ``Task``) with this id, wherever it lives (this queryset's database): its row
        in ``tasks_task``, else its row in ``tasks_finished`` (``archived`` set), else None."""
        row = self.model._base_manager.db_manager(self.db).filter(pk=task_id).first()
        if row is not None:
            return row
        for found in self.model._base_manager.db_manager(self.db).raw(FIND_FINISHED_SQL, [task_id]):
            found.archived = True
            return found
        return None
