"""How the queue's operations (tasks/models/task_*.py) send their statement: on the database of the
queryset they are called on, as a prepared statement (tasks/lifecycle/prepared.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.db import connections, models

from tasks.lifecycle import prepared
from tasks.lifecycle.routing import queue_database

#: The queryset an operation is called on (``Task.objects``, filtered or routed): its methods are
#: these modules' functions (TaskQuerySet names each in one line).
Tasks = models.QuerySet[Any]

# The base of TaskQuerySet's bases (task_enqueue.py, task_attempts.py, task_actions.py): a QuerySet
# to the type checker, so that their methods may call its own; nothing at run time, where
# TaskQuerySet brings the QuerySet itself.
if TYPE_CHECKING:
    OperationsBase = models.QuerySet[Any]
else:
    OperationsBase = object


def fetch(tasks: Tasks, sql: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
    """The rows of one statement, on ``tasks``'s database."""
    return prepared.rows(connections[tasks.db], sql, params)


def routed_to(tasks: Tasks, queue: str) -> Tasks:
    """``tasks`` on the database holding ``queue``, unless one was chosen explicitly
    (``Task.objects.db_manager(alias)`` / ``.using(alias)``): tasks/lifecycle/routing.py."""
    return tasks if tasks._db is not None else tasks.using(queue_database(queue))  # type: ignore[attr-defined]
