from __future__ import annotations

from leasing.exceptions import LeasingError


class TaskError(LeasingError):
    """A task queue operation failed."""


class TaskLeaseLost(TaskError):
    """This worker no longer holds the task: it expired, was recovered, cancelled or taken over."""


class UnknownHandler(TaskError):
    """The task's handler path does not name an importable callable."""
