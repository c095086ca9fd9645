"""One exception root for the task queue (``LeasingError`` → ``TaskError``); the docstring is the
default message. Some classes here are only ever *recorded* (their import path is stored in a task's
error entries), so that ``TaskError.exception_class`` of a recorded attempt imports a real class."""

from __future__ import annotations

import datetime as dt
from typing import Any

from leasing.exceptions import LeasingError
from tasks.compat import InvalidTask


class TaskError(LeasingError):
    """A task queue operation failed."""


class ArchivedTask(TaskError):
    """A task read from tasks_finished (moved out of tasks_task once finished) was to be saved or
    deleted: that row is history, read-only (docs/explanation/finished-storage.md)."""


class TaskNotFinished(TaskError):
    """A delete named a task that has not finished (AWAITING, BLOCKED, READY or RUNNING): only a
    finished task (SUCCESSFUL, FAILED, CANCELLED) is deleted, and nothing was. ``unfinished`` holds
    (id, status) of those found, in id order."""

    def __init__(self, unfinished: list[tuple[int, str]]) -> None:
        self.unfinished = unfinished
        shown = ", ".join(f"task {task_id} is {status}" for task_id, status in unfinished[:10])
        more = f" and {len(unfinished) - 10} more" if len(unfinished) > 10 else ""
        super().__init__(
            f"{shown}{more}: only finished tasks (SUCCESSFUL, FAILED or CANCELLED) are deleted; cancel"
            f" {'it' if len(unfinished) == 1 else 'them'} first"
        )


class TaskRunAgain(TaskError):
    """A delete confirmed for finished tasks found some of them run again meanwhile (an operator's
    rerun brought them back and they finished again): nothing was deleted, so that no result the
    operator has not seen goes with them. ``found`` holds (id, status) of those, in id order."""

    def __init__(self, found: list[tuple[int, str]]) -> None:
        self.found = found
        shown = ", ".join(f"task {task_id} ran again and is {status}" for task_id, status in found[:10])
        more = f" and {len(found) - 10} more" if len(found) > 10 else ""
        super().__init__(f"{shown}{more} while the delete was confirmed: look at the new run, then delete again")


class TaskLeaseLost(TaskError):
    """This worker no longer holds the task: it expired, was recovered, cancelled or taken over."""


class StepMismatch(TaskError):
    """A durable step's stored sequence does not fit the code that resumes it: the handler called a
    different step at a position an earlier attempt recorded (tasks/steps.py)."""


class ChildTaskFailed(TaskError):
    """A child task this one waited for (``tasks.steps.wait_for_task``) ended FAILED or CANCELLED:
    ``status`` says which, ``error`` is its last error entry (exception class path, message), if any."""

    def __init__(self, task_id: int, status: str, error: dict[str, Any] | None) -> None:
        reason = f": {error.get('exception_class_path')}: {error.get('message')}" if error else ""
        super().__init__(f"child task {task_id} ended {status}{reason}")
        self.task_id = task_id
        self.status = status
        self.error = error


class ChildTaskTimeout(TaskError, TimeoutError):
    """A child task this one waited for (``tasks.steps.wait_for_task``) had not ended by the wait's
    timeout. The child goes on; what it ends with reaches no later attempt of this wait."""

    def __init__(self, task_id: int) -> None:
        super().__init__(f"child task {task_id} had not ended within the wait's timeout")
        self.task_id = task_id


class UnknownHandler(TaskError):
    """The task's handler path does not name an importable callable."""


class NotATask(UnknownHandler, InvalidTask):
    """The task came through a django.tasks backend, but its path names no django.tasks Task."""


class UnstorableResult(TaskError, ValueError):
    """The handler returned a value that cannot be stored as JSON (NaN, infinity, NUL, a lone surrogate, an object)."""


class TaskTimeout(TaskError, TimeoutError):
    """The attempt ran past its timeout and was abandoned; its late result is refused."""


class TaskWaitTimeout(TaskError, TimeoutError):
    """A caller's wait for a task to finish (``Task.objects.wait``, a result's ``wait()``) ran out of
    time; the task itself goes on, untouched."""

    def __init__(self, task_id: int, status: str, timeout: float) -> None:
        super().__init__(f"task {task_id} is still {status} after {timeout:g}s; it goes on (only the wait ended)")
        self.task_id = task_id
        self.status = status


class EventLoopBlocked(TaskError):
    """The attempt blocked the worker's event loop (a blocking call in async code) longer than
    LEASING_TASKS["ASYNC_BLOCK_LIMIT"]; it was abandoned and the loop replaced."""


class WorkerShutdown(TaskError):
    """The attempt was interrupted by its worker shutting down; it is not counted as a failure."""


class UnstorableOutcome(TaskError):
    """The database refused to store this attempt's outcome; the attempt is recorded as failed instead."""


class TaskPathRefused(TaskError):
    """The task's path is not one the JSON API may run (see LEASING_TASKS["API_TASKS"] and ["API_TASK_PATTERNS"])."""


class DependencyFailed(TaskError):
    """A task this one depends on failed or was cancelled: it was cancelled without running (the
    ``on_parent_failure="cancel"`` policy of tasks.workflows)."""


class Snooze(TaskError):
    """Raised by a handler: run the task again in ``seconds`` (on the database clock). Not a failed
    attempt: the attempt is not charged (``attempts`` and ``failures`` are unchanged), no error is
    recorded, and ``snoozes`` counts it. A keyed task gives its concurrency slot up while it sleeps."""

    def __init__(self, seconds: float | dt.timedelta) -> None:
        if isinstance(seconds, dt.timedelta):
            seconds = seconds.total_seconds()
        super().__init__(f"snoozed for {seconds!r}s")
        self.seconds = seconds


class Discard(TaskError):
    """Raised by a handler: fail the task for good now, attempts left or not (the reason is the
    recorded error's message)."""


class Cancel(TaskError):
    """Raised by a handler: end the task CANCELLED with this reason (recorded as the last error
    entry, kind ``cancel``); its workflow dependants are settled as for any cancel."""
