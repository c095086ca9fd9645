"""A ``django.tasks`` backend on this queue.

    TASKS = {"default": {"BACKEND": "tasks.backends.LeaseBackend",
                         "QUEUES": ["default", "mail"],          # optional: allowed queue names
                         "OPTIONS": {"max_attempts": 3, "timeout": None}}}

    @task(priority=10)
    def send_invoice(invoice_id): ...

    result = send_invoice.enqueue(7)             # a row in tasks_task, run by ``manage.py run_worker``
    result.refresh(); result.status, result.return_value, result.errors, result.attempts

Tasks that take a context get a :class:`LeaseTaskContext`: ``context.attempt``, and this queue's
``context.checkpoint(progress)`` / ``context.progress`` / ``context.token``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from django.db import DEFAULT_DB_ALIAS
from django.tasks import Task as DjangoTask
from django.tasks import TaskContext, TaskResult, TaskResultStatus
from django.tasks.backends.base import BaseTaskBackend
from django.tasks.base import TaskError
from django.tasks.exceptions import TaskResultDoesNotExist
from django.tasks.signals import task_enqueued, task_finished, task_started
from django.utils.json import normalize_json

from tasks.models import Task, TaskStatus

if TYPE_CHECKING:
    from tasks.runtime import Execution

_STATUS = {
    TaskStatus.READY: TaskResultStatus.READY,
    TaskStatus.RUNNING: TaskResultStatus.RUNNING,
    TaskStatus.SUCCESSFUL: TaskResultStatus.SUCCESSFUL,
    TaskStatus.FAILED: TaskResultStatus.FAILED,
    TaskStatus.CANCELLED: TaskResultStatus.FAILED,
}


@dataclass(frozen=True, slots=True, kw_only=True)
class LeaseTaskContext(TaskContext):  # type: ignore[misc]
    """Django's task context plus this queue's checkpoints and fencing token."""

    execution: Execution

    @property
    def attempt(self) -> int:
        return self.execution.attempt

    @property
    def token(self) -> int:
        return self.execution.token

    @property
    def progress(self) -> Any:
        return self.execution.progress

    def checkpoint(self, progress: Any) -> bool:
        return self.execution.checkpoint(progress)

    def check(self) -> None:
        self.execution.check()


class LeaseBackend(BaseTaskBackend):
    supports_defer = True
    supports_async_task = True
    supports_get_result = True
    supports_priority = True

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        self.using = self.options.get("database", DEFAULT_DB_ALIAS)
        self.max_attempts = self.options.get("max_attempts")
        self.timeout = self.options.get("timeout")

    def enqueue(self, task: DjangoTask, args: Any, kwargs: Any) -> TaskResult:
        self.validate_task(task)
        enqueued = Task.objects.db_manager(self.using).enqueue(
            task.module_path,
            args=list(args),
            kwargs=dict(kwargs),
            queue=task.queue_name,
            priority=task.priority,
            run_after=task.run_after,
            max_attempts=self.max_attempts,
            timeout=self.timeout,
        )
        result = self.get_result(str(enqueued.id))
        if enqueued.created:
            # The result describes the task as enqueued, even if a fast worker has already begun it.
            for name, value in (
                ("status", TaskResultStatus.READY),
                ("started_at", None),
                ("finished_at", None),
                ("last_attempted_at", None),
                ("errors", []),
                ("worker_ids", []),
            ):
                object.__setattr__(result, name, value)
        task_enqueued.send(type(self), task_result=result)
        return result

    def get_result(self, result_id: str) -> TaskResult:
        try:
            row = Task.objects.db_manager(self.using).get(pk=int(result_id))
        except (ValueError, Task.DoesNotExist):
            raise TaskResultDoesNotExist(result_id) from None
        return self.result_from_row(row)

    def result_from_row(self, row: Task) -> TaskResult:
        from django.utils.module_loading import import_string

        task = import_string(row.task_path)
        if not isinstance(task, DjangoTask):
            raise TaskResultDoesNotExist(f"task {row.pk} does not run a django.tasks Task")
        result: TaskResult = TaskResult(
            task=task,
            id=str(row.pk),
            status=_STATUS[TaskStatus(row.status)],
            enqueued_at=row.enqueued_at,
            started_at=row.started_at,
            finished_at=row.finished_at,
            last_attempted_at=row.last_attempted_at,
            args=row.args,
            kwargs=row.kwargs,
            backend=self.alias,
            errors=[
                TaskError(exception_class_path=e.get("exception_class_path", ""), traceback=e.get("traceback", ""))
                for e in row.errors
                # A claim returned before its attempt was known to start is not an attempt.
                if e.get("kind") != "returned"
            ],
            worker_ids=list(row.worker_ids),
        )
        if row.status == TaskStatus.SUCCESSFUL:
            object.__setattr__(result, "_return_value", row.return_value)
        return result


def _running_result(task: DjangoTask, execution: Execution, backend_alias: str) -> TaskResult:
    claimed = execution.task
    return TaskResult(
        task=task,
        id=str(claimed.id),
        status=TaskResultStatus.RUNNING,
        enqueued_at=claimed.enqueued_at,
        started_at=None,
        finished_at=None,
        last_attempted_at=None,
        args=claimed.args,
        kwargs=claimed.kwargs,
        backend=backend_alias,
        errors=[],
        worker_ids=list(claimed.worker_ids),
    )


def run_django_task(task: DjangoTask, execution: Execution) -> Any:
    """Run a django.tasks Task for a worker, sending Django's task signals."""
    sender = type(task.get_backend())
    result = _running_result(task, execution, task.backend)
    task_started.send(sender=sender, task_result=result)
    try:
        if task.takes_context:
            context = LeaseTaskContext(task_result=result, execution=execution)
            value = task.call(context, *execution.task.args, **execution.task.kwargs)
        else:
            value = task.call(*execution.task.args, **execution.task.kwargs)
        value = normalize_json(value)
    except BaseException:
        object.__setattr__(result, "status", TaskResultStatus.FAILED)
        task_finished.send(sender=sender, task_result=result)
        raise
    object.__setattr__(result, "status", TaskResultStatus.SUCCESSFUL)
    object.__setattr__(result, "_return_value", value)
    task_finished.send(sender=sender, task_result=result)
    return value
