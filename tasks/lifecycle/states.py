"""A task's statuses; tasks/lifecycle/transitions.py holds what moves a task between them."""

from __future__ import annotations

from typing import Any, TypeVar

from django.db import models
from django.db.models import QuerySet
from django.db.models.functions import Now

NOTIFY_CHANNEL = "leasing_tasks"


class TaskStatus(models.TextChoices):
    #: A workflow member waiting for the tasks it depends on (tasks/lifecycle/workflows.py): it becomes
    #: READY when the last of them is final, or CANCELLED when one failed. django.tasks sees it as READY.
    AWAITING = "AWAITING", "Awaiting"
    #: A task with a ``concurrency_key`` whose key has no free slot: waiting to be admitted to READY
    #: (see tasks/lifecycle/concurrency.py). django.tasks sees it as READY.
    BLOCKED = "BLOCKED", "Blocked"
    READY = "READY", "Ready"
    RUNNING = "RUNNING", "Running"
    SUCCESSFUL = "SUCCESSFUL", "Successful"
    FAILED = "FAILED", "Failed"
    CANCELLED = "CANCELLED", "Cancelled"


UNFINISHED = (TaskStatus.AWAITING, TaskStatus.BLOCKED, TaskStatus.READY, TaskStatus.RUNNING)
#: Waiting to run: admitted (READY) or waiting for a concurrency slot (BLOCKED).
WAITING = (TaskStatus.BLOCKED, TaskStatus.READY)
FINISHED = (TaskStatus.SUCCESSFUL, TaskStatus.FAILED, TaskStatus.CANCELLED)
#: Every status but RUNNING, as a partial index condition: ``status = 'X'`` for any X in it implies it
#: (PostgreSQL proves an equality against an IN list, not against ``<>``).
NOT_RUNNING_STATUSES = (TaskStatus.READY, *FINISHED)


_QS = TypeVar("_QS", bound=QuerySet[Any])


def with_db_clock(queryset: _QS) -> _QS:
    """``queryset`` whose rows carry the database's clock of the statement that reads them (``db_now``):
    a page badges each row Running or Stuck by it (``Task.is_stuck``), in the state the statement's own
    filter selected it in, whatever the web process's clock says by the time it renders."""
    return queryset.annotate(db_now=Now())
