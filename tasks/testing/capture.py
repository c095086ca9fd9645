"""What the code under test enqueued, read from the rows it really inserted.

A capture notes the highest task id of each database when it begins; the tasks enqueued since are
the rows above it (ids come from a sequence, so a new row always has a larger one, in a rolled-back
test transaction too). Nothing is patched: whatever inserted the rows (``Task.objects.enqueue``,
``bulk_enqueue``, a workflow, a django.tasks ``Task.enqueue()`` through the LeaseBackend, the JSON
API, a raw ``INSERT``) is seen alike, with the arguments as stored. In a ``TestCase`` the rows are
read inside the test's transaction, on its connection.

::

    capture = EnqueueCapture()
    client.post("/signup/", {"email": "a@example.com"})
    capture.assert_enqueued(send_welcome, args=["a@example.com"])
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from django.db import DEFAULT_DB_ALIAS
from django.db.models import Max

from tasks.compat import Task as DjangoTask
from tasks.compat import normalize_json
from tasks.lifecycle.routing import queue_routes
from tasks.lifecycle.storable import storable_json
from tasks.models import Task

#: What names a task: its import path, the function, or a django.tasks Task.
TaskRef = str | DjangoTask | Any


def task_path(task: TaskRef) -> str:
    """The import path a task is stored under: a path as given, a django.tasks Task's
    ``module_path``, a function's ``module.qualname``."""
    if isinstance(task, str):
        return task
    if isinstance(task, DjangoTask):
        return str(task.module_path)
    module, name = getattr(task, "__module__", None), getattr(task, "__qualname__", None)
    if not callable(task) or not module or not name:
        raise TypeError(f"name a task by its import path, its function or its django.tasks Task, not {task!r}")
    return f"{module}.{name}"


def stored_form(value: Any, what: str) -> Any:
    """``value`` as its row would hold it (tuples become lists ...), to compare with stored arguments."""
    try:
        return json.loads(storable_json(normalize_json(value)))
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{what} {value!r} cannot be stored as a task's arguments: {exc}") from None


def task_databases() -> list[str]:
    """Every database that holds task rows: ``default`` and the targets of QUEUE_DATABASES."""
    return list(dict.fromkeys([DEFAULT_DB_ALIAS, *queue_routes().values()]))


def describe(task: Task) -> str:
    return (
        f"task {task.pk} {task.task_path} args={task.args!r} kwargs={task.kwargs!r} queue={task.queue!r}"
        f" priority={task.priority} [{task.status}]"
    )


class EnqueueCapture:
    """The tasks enqueued since it was made (in ``databases``: by default every database that holds
    tasks; a ``TestCase`` must be allowed to query each, see its ``databases`` attribute)."""

    def __init__(self, databases: Iterable[str] | None = None) -> None:
        if isinstance(databases, str):
            raise TypeError("databases is a list of aliases, not one string")
        self.databases: tuple[str, ...] = tuple(databases) if databases is not None else tuple(task_databases())
        self._marks = {
            alias: Task.objects.using(alias).aggregate(last=Max("id"))["last"] or 0 for alias in self.databases
        }

    @property
    def tasks(self) -> list[Task]:
        """The tasks enqueued since the capture began, database by database (in ``databases``' order),
        oldest first in each; read now, so in their current state."""
        found: list[Task] = []
        for alias, mark in self._marks.items():
            found += Task.objects.using(alias).filter(id__gt=mark).order_by("id")
        return found

    def matching(
        self,
        task: TaskRef | None = None,
        *,
        args: Sequence[Any] | None = None,
        kwargs: dict[str, Any] | None = None,
        queue: str | None = None,
        priority: int | None = None,
    ) -> list[Task]:
        """The captured tasks of ``task`` (None: any) whose arguments equal ``args`` / ``kwargs`` as
        stored and which went to ``queue`` with ``priority`` (each None: any)."""
        path = None if task is None else task_path(task)
        if isinstance(args, str | bytes | dict):
            raise TypeError("args is a list of positional arguments")
        wanted_args = None if args is None else stored_form(list(args), "args")
        wanted_kwargs = None if kwargs is None else stored_form(dict(kwargs), "kwargs")
        return [
            row
            for row in self.tasks
            if (path is None or row.task_path == path)
            and (wanted_args is None or row.args == wanted_args)
            and (wanted_kwargs is None or row.kwargs == wanted_kwargs)
            and (queue is None or row.queue == queue)
            and (priority is None or row.priority == priority)
        ]

    def assert_enqueued(
        self,
        task: TaskRef,
        *,
        args: Sequence[Any] | None = None,
        kwargs: dict[str, Any] | None = None,
        queue: str | None = None,
        priority: int | None = None,
        count: int | None = None,
    ) -> list[Task]:
        """Fail (AssertionError, listing what was enqueued) unless a task of ``task`` with these
        arguments was enqueued since the capture began (``count``: exactly that many). Returns them."""
        if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 0):
            raise ValueError("count must be a whole number, 0 or more")
        found = self.matching(task, args=args, kwargs=kwargs, queue=queue, priority=priority)
        if (count is None and found) or len(found) == count:
            return found
        wanted = _wanted(task_path(task), args=args, kwargs=kwargs, queue=queue, priority=priority)
        expected = "at least one" if count is None else f"exactly {count}"
        raise AssertionError(f"expected {expected} enqueued {wanted}, found {len(found)}.\n{self._listing()}")

    def assert_not_enqueued(
        self,
        task: TaskRef | None = None,
        *,
        args: Sequence[Any] | None = None,
        kwargs: dict[str, Any] | None = None,
        queue: str | None = None,
        priority: int | None = None,
    ) -> None:
        """Fail unless no task of ``task`` (None: no task at all) with these arguments was enqueued."""
        found = self.matching(task, args=args, kwargs=kwargs, queue=queue, priority=priority)
        if found:
            path = "task" if task is None else task_path(task)
            wanted = _wanted(path, args=args, kwargs=kwargs, queue=queue, priority=priority)
            raise AssertionError(f"expected no enqueued {wanted}, found {len(found)}.\n{self._listing()}")

    def _listing(self) -> str:
        tasks = self.tasks
        if not tasks:
            return "Nothing was enqueued since the capture began."
        lines = [f"Enqueued since the capture began ({len(tasks)}):", *(f"  {describe(t)}" for t in tasks[:50])]
        if len(tasks) > 50:
            lines.append(f"  ... and {len(tasks) - 50} more")
        return "\n".join(lines)


def _wanted(path: str, **given: Any) -> str:
    shown = ", ".join(f"{name}={value!r}" for name, value in given.items() if value is not None)
    return f"{path}({shown})" if shown else path


__all__ = ["EnqueueCapture", "task_databases", "task_path"]
