"""The task queue's models. A task's lease lives on its own row, so claim, heartbeat and finish are
each one statement (``queryset.py``; the statements themselves are in ``tasks/lifecycle``).

Status names follow ``django.tasks.TaskResultStatus`` (READY, RUNNING, SUCCESSFUL, FAILED) plus
BLOCKED and CANCELLED; ``tasks/lifecycle/states.py`` holds the transition table.

``tasks.models`` keeps every name it had before the package was split: the values and statuses are
re-exported from ``tasks.lifecycle``."""

from tasks.lifecycle.states import (
    FINISHED,
    NOT_RUNNING_STATUSES,
    NOTIFY_CHANNEL,
    UNFINISHED,
    WAITING,
    TaskStatus,
)
from tasks.lifecycle.values import (
    MAX_CONCURRENCY_LIMIT,
    AttemptFate,
    ClaimedTask,
    Enqueued,
    FailOutcome,
    Failure,
    RateRefused,
    Recovered,
    Started,
    validate_concurrency,
)
from tasks.models.bookkeeping import (
    ActivityHour,
    ActivityHourMark,
    ActivityMinute,
    ArchiveProgress,
    ConcurrencyHold,
    ConcurrencyKey,
    ConcurrencyWake,
    GeneratorState,
    RateLimit,
    Repair,
    UniqueKey,
)
from tasks.models.bulk import BulkOperation, BulkOperationQuerySet
from tasks.models.fair_cursor import FairCursor, FairCursorQuerySet, SharedFairCursor
from tasks.models.queue_control import PAUSE_LOCK_TIMEOUT_MS, QueueControl, QueueControlQuerySet
from tasks.models.schedule import Schedule, ScheduleRun, StoredRow, StoredSchedule, StoredScheduleQuerySet
from tasks.models.step import TaskEvent, TaskStep
from tasks.models.task import FAILED_BEFORE, NEVER_FAILED, NOT_RUNNING, Task, TaskQuerySet
from tasks.models.worker import Worker, WorkerQuerySet
from tasks.models.workflow import TaskDependency, Workflow, WorkflowQuerySet

__all__ = [
    "FAILED_BEFORE",
    "FINISHED",
    "MAX_CONCURRENCY_LIMIT",
    "NEVER_FAILED",
    "NOTIFY_CHANNEL",
    "NOT_RUNNING",
    "NOT_RUNNING_STATUSES",
    "PAUSE_LOCK_TIMEOUT_MS",
    "UNFINISHED",
    "WAITING",
    "ActivityHour",
    "ActivityHourMark",
    "ActivityMinute",
    "ArchiveProgress",
    "AttemptFate",
    "BulkOperation",
    "BulkOperationQuerySet",
    "ClaimedTask",
    "ConcurrencyHold",
    "ConcurrencyKey",
    "ConcurrencyWake",
    "Enqueued",
    "FailOutcome",
    "Failure",
    "FairCursor",
    "FairCursorQuerySet",
    "GeneratorState",
    "QueueControl",
    "QueueControlQuerySet",
    "RateLimit",
    "RateRefused",
    "Recovered",
    "Repair",
    "Schedule",
    "ScheduleRun",
    "SharedFairCursor",
    "Started",
    "StoredRow",
    "StoredSchedule",
    "StoredScheduleQuerySet",
    "Task",
    "TaskDependency",
    "TaskEvent",
    "TaskQuerySet",
    "TaskStatus",
    "TaskStep",
    "UniqueKey",
    "Worker",
    "WorkerQuerySet",
    "Workflow",
    "WorkflowQuerySet",
    "validate_concurrency",
]
