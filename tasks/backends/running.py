"""A django.tasks Task run by a worker: the attempt's TaskResult, ``task_started`` before the call,
the context a task that takes one gets, and the stand-in for a task that cannot run here.
``task_finished`` is the worker's (:mod:`tasks.worker.signals`), once the attempt's end is stored."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tasks.backends.backend import LeaseTaskContext, enqueued_task, sender_for, stand_in, task_errors
from tasks.compat import BaseTaskBackend, TaskError, TaskResult, TaskResultStatus, task_started
from tasks.compat import Task as DjangoTask
from tasks.models import Task

if TYPE_CHECKING:
    from tasks.runtime import Execution


@dataclass(slots=True)
class DjangoRun:
    """An attempt of a django.tasks Task in a worker: the task as enqueued, and the result its
    ``task_started`` signal (and context) carried. ``task_finished`` follows once the attempt's end
    is stored (:mod:`tasks.worker.signals`), exactly once."""

    task: DjangoTask
    sender: type[BaseTaskBackend]
    result: TaskResult
    finish_sent: bool = False


def refused(execution: Execution) -> None:
    """A task enqueued through a backend that cannot run here (its path does not import, or names
    no Task): it was unable to start, and its ``task_finished`` will say so (FAILED)."""
    claimed = execution.task
    if claimed.backend_alias is None or execution.django is not None:
        return
    task = stand_in(
        claimed.task_path,
        backend=claimed.backend_alias,
        queue_name=claimed.queue,
        priority=claimed.priority,
        run_after=claimed.task_run_after,
    )
    result: TaskResult = TaskResult(
        task=task,
        id=str(claimed.id),
        status=TaskResultStatus.FAILED,
        enqueued_at=claimed.enqueued_at,
        started_at=execution.started_at,
        finished_at=None,
        last_attempted_at=execution.last_attempted_at,
        args=claimed.args,
        kwargs=claimed.kwargs,
        backend=claimed.backend_alias,
        errors=[],
        worker_ids=[*claimed.worker_ids, execution.worker_id],
    )
    execution.django = DjangoRun(task=task, sender=sender_for(claimed.backend_alias), result=result)


def run_django_task(task: DjangoTask, execution: Execution) -> Any:
    """Run a django.tasks Task for a worker; sends ``task_started`` (``task_finished`` is the
    worker's, once the outcome is stored). Returns the raw return value."""
    task, args, kwargs = start_django_task(task, execution)
    return task.call(*args, **kwargs)


async def arun_django_task(task: DjangoTask, execution: Execution) -> Any:
    """:func:`run_django_task` on the worker's event loop: the start (a read for a retry, the
    ``task_started`` receivers) runs on the loop's database threads, the task's coroutine on the loop."""
    from asgiref.sync import sync_to_async

    task, args, kwargs = await sync_to_async(start_django_task, thread_sensitive=False)(task, execution)
    return await task.acall(*args, **kwargs)


def start_django_task(task: DjangoTask, execution: Execution) -> tuple[DjangoTask, list[Any], dict[str, Any]]:
    """Build the TaskResult of this attempt and send ``task_started``; returns what to call."""
    claimed = execution.task
    alias = claimed.backend_alias or task.backend
    task = enqueued_task(
        task,
        backend=alias,
        queue_name=claimed.queue,
        priority=claimed.priority,
        run_after=claimed.task_run_after if claimed.backend_alias else task.run_after,
    )
    started_at = execution.started_at
    errors: list[TaskError] = []
    if claimed.attempts:
        # An earlier attempt began: the first start and the earlier errors are on the row (the
        # claim does not read them, to keep the hot path light; retries are rare).
        stored = Task.objects.using(execution.using).filter(pk=claimed.id).values_list("started_at", "errors").first()
        if stored is not None:
            started_at = stored[0] or started_at
            errors = task_errors(stored[1])
    result: TaskResult = TaskResult(
        task=task,
        id=str(claimed.id),
        status=TaskResultStatus.RUNNING,
        enqueued_at=claimed.enqueued_at,
        started_at=started_at,
        finished_at=None,
        last_attempted_at=execution.last_attempted_at,
        args=claimed.args,
        kwargs=claimed.kwargs,
        backend=alias,
        errors=errors,
        # This attempt counts as soon as it runs (its start marker may follow a few ms later), so
        # that ``context.attempt == task_result.attempts`` inside the task.
        worker_ids=[*claimed.worker_ids, execution.worker_id],
    )
    run = DjangoRun(task=task, sender=sender_for(alias), result=result)
    execution.django = run
    task_started.send(sender=run.sender, task_result=result)
    if task.takes_context:
        return task, [LeaseTaskContext(task_result=result, execution=execution), *result.args], dict(result.kwargs)
    return task, list(result.args), dict(result.kwargs)
