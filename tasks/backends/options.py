"""``@task(...)`` options: the queue's per-task options given where the task is defined.

Django 6.1 (and the ``django-tasks`` backport from 0.12) pass every keyword of ``@task(...)`` that
it does not know to the backend's ``task_class``. ``LeaseBackend.task_class`` is :class:`LeaseTask`,
Django's Task with these fields more::

    @task(max_attempts=3, retry_on=[TimeoutError], backoff="billing.retry.backoff", timeout=5,
          rate_key="smtp", rate_limit="10/s", concurrency_key="invoice:{customer_id}",
          concurrency_limit=2, fair_key="{customer_id}")
    def send_invoice(customer_id, invoice_id): ...

``tasks.backends.task`` is the same decorator with every option in its signature, for a type checker
(django-stubs types Django's ``task`` without them): ``from tasks.backends import task``.

Keys (``concurrency_key``, ``rate_key``, ``fair_key``, ``dedup_key``) are ``str.format`` templates
filled with the call's arguments, as in the backend's OPTIONS. Every option is checked when the
module defining the task is imported: a wrong one raises ``InvalidTask`` naming the task and the
option, and nothing is enqueued with it.

Where an option comes from, first that sets it (docs/howto/django-tasks.md, "Task options"):

1. the call: ``send_invoice.using(max_attempts=5).enqueue(...)`` (``using`` takes these options too);
2. the decorator: ``@task(max_attempts=3)``;
3. the backend: ``TASKS[alias]["OPTIONS"]`` (``retry``, ``concurrency``, ``rate_limits``, ``unique``,
   ``debounce``, ``fair`` keyed by task path; ``max_attempts`` and ``timeout`` for all its tasks);
4. the settings: ``LEASING_TASKS["RETRY_POLICIES"][queue]``, then ``MAX_ATTEMPTS``.

The retry fields also hold when the worker runs a row of the task's path that was enqueued some other
way (``Task.objects.enqueue(path)``): they are the handler's own policy, over a ``@retry_policy`` on the
function.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, overload

from asgiref.sync import sync_to_async
from django.db import DEFAULT_DB_ALIAS, connections

from tasks.compat import DEFAULT_TASK_BACKEND_ALIAS, DEFAULT_TASK_QUEUE_NAME, InvalidTask, TaskResult, task_backends
from tasks.compat import Task as DjangoTask
from tasks.compat import task as framework_task
from tasks.lifecycle import policy
from tasks.models import Task

if TYPE_CHECKING:
    from tasks.lifecycle.policy import RetryPolicy

#: The fields :class:`LeaseTask` adds to Django's Task.
OPTION_FIELDS = (
    "max_attempts",
    "retry_on",
    "backoff",
    "timeout",
    "concurrency_key",
    "concurrency_limit",
    "rate_key",
    "rate_limit",
    "dedup_key",
    "unique_for",
    "debounce",
    "max_wait",
    "fair_key",
)


#: Celery's task methods, and what to write instead (an AttributeError that says so).
CELERY_HABITS = {
    "delay": "call .enqueue(*args, **kwargs)",
    "apply_async": "call .using(run_after=..., queue_name=..., priority=...).enqueue(*args, **kwargs)",
    "s": "write step(task, *args) from tasks.workflows",
    "si": "write step(task, *args) in a chain(..., pipe=False) from tasks.workflows",
    "signature": "write step(task, *args) from tasks.workflows",
    "map": "enqueue a group([step(task, x) for x in items]) from tasks.workflows",
    "starmap": "enqueue a group([step(task, *x) for x in items]) from tasks.workflows",
    "chunks": "enqueue a group of steps, or Task.objects.bulk_enqueue",
    "retry": "raise an exception to retry (the retry policy decides), or raise Snooze(seconds) to run again later",
    "AsyncResult": "call .get_result(id), then result.wait(timeout=...)",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class LeaseTask(DjangoTask):
    """A ``django.tasks`` Task with this queue's options (see the module doc)."""

    #: Failed attempts allowed before the task is FAILED.
    max_attempts: int | None = None
    #: Exception classes (or their dotted paths) that are retried; any other fails the task at once.
    retry_on: tuple[type[BaseException] | str, ...] | None = None
    #: ``f(attempt, exception) -> seconds`` (a module-level function) or its dotted path.
    backoff: Callable[[int, BaseException], float | None] | str | None = None
    #: Seconds an attempt may run before it is timed out.
    timeout: float | None = None
    concurrency_key: str | None = None
    concurrency_limit: int | None = None
    rate_key: str | None = None
    #: "14/s", "100/min", "5/10s" or a (count, seconds) pair.
    rate_limit: str | tuple[int, float] | None = None
    #: The key of a window: with ``unique_for``, or with ``debounce`` (and ``max_wait``).
    dedup_key: str | None = None
    unique_for: float | dt.timedelta | None = None
    debounce: float | dt.timedelta | None = None
    max_wait: float | dt.timedelta | None = None
    fair_key: str | None = None

    def __post_init__(self) -> None:
        if self.retry_on is not None and not isinstance(self.retry_on, tuple):
            if isinstance(self.retry_on, str | bytes) or not isinstance(self.retry_on, Iterable):
                raise InvalidTask(
                    f"@task options of {self.module_path}: retry_on must be a list of exception classes or their paths"
                )
            object.__setattr__(self, "retry_on", tuple(self.retry_on))
        DjangoTask.__post_init__(self)  # the backend's validate_task: Django's checks, then the options'

    def __getattr__(self, name: str) -> Any:
        # Only names the dataclass does not have get here: a Celery habit gets its counterpart.
        instead = CELERY_HABITS.get(name)
        if instead is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        raise AttributeError(
            f"{self.module_path}.{name}: a django.tasks Task has no Celery {name}(); {instead}"
            " (docs/howto/coming-from-celery.md)"
        )

    def using(self, **changes: Any) -> LeaseTask:
        """A copy with other defaults: Django's (``priority``, ``queue_name``, ``run_after``,
        ``backend``) and this queue's options (None leaves one as it is, as Django's do)."""
        unknown = set(changes) - {"priority", "queue_name", "run_after", "backend", *OPTION_FIELDS}
        if unknown:
            raise TypeError(f"using() got unexpected keyword arguments: {', '.join(sorted(unknown))}")
        return dataclasses.replace(self, **{name: value for name, value in changes.items() if value is not None})

    def options(self) -> dict[str, Any]:
        """The options this task sets (None for those it leaves to the backend and the settings)."""
        return {name: getattr(self, name) for name in OPTION_FIELDS}

    @property
    def leasing_retry_policy(self) -> RetryPolicy | None:
        """The handler's own retry policy (what ``policy.handler_policy`` reads): these fields, over
        a ``@retry_policy`` put on the function."""
        own = getattr(self.func, policy.ATTRIBUTE, None)
        if self.max_attempts is None and self.retry_on is None and self.backoff is None:
            return own if isinstance(own, policy.RetryPolicy) else None
        mine = policy.from_mapping(self.stored_policy())
        assert mine is not None
        return mine.over(own if isinstance(own, policy.RetryPolicy) else None)

    def stored_policy(self) -> dict[str, Any] | None:
        """The retry fields as a row stores them (dotted paths), or None when none is set."""
        return policy.stored(max_attempts=self.max_attempts, retry_on=self.retry_on, backoff=self.backoff)


@dataclass(frozen=True, slots=True, kw_only=True)
class LeaseTaskResult(TaskResult):  # type: ignore[misc]  # django-stubs: TaskResult is not frozen there
    """Django's TaskResult, as ``LeaseBackend`` returns it, plus a wait for the task to finish."""

    def wait(self, timeout: float | None = None) -> LeaseTaskResult:
        """Block until the task is final (SUCCESSFUL or FAILED), then :meth:`refresh` this result and
        return it; :class:`~tasks.exceptions.TaskWaitTimeout` after ``timeout`` seconds (None: no
        limit), the task untouched. Woken by the task's finish where its database allows LISTEN,
        polling behind a transaction pooler (tasks/models/task_wait.py)."""
        number, _, using = str(self.id).partition("@")
        home = getattr(task_backends[self.backend], "using", DEFAULT_DB_ALIAS)  # a LeaseBackend's database
        Task.objects.db_manager(using or home).wait(int(number), timeout=timeout)
        self.refresh()
        return self

    async def await_(self, timeout: float | None = None) -> LeaseTaskResult:
        """:meth:`wait` for async code: the wait runs on the event loop, holding no thread, and its
        ``timeout`` counts from the call; cancelled (``asyncio.wait_for``, a client that hung up), it
        lets go of its connection at once (tasks/models/task_await.py). The refresh at the end is one
        short call on a thread of the loop's default executor, its connection closed when it returns."""
        number, _, using = str(self.id).partition("@")
        home = getattr(task_backends[self.backend], "using", DEFAULT_DB_ALIAS)  # a LeaseBackend's database
        await Task.objects.db_manager(using or home).await_final(int(number), timeout=timeout)

        def refresh() -> None:
            try:
                self.refresh()
            finally:
                connections.close_all()  # this thread's own: nothing else will close them

        await sync_to_async(refresh, thread_sensitive=False)()
        return self


def seconds_of(value: float | dt.timedelta | None) -> float | None:
    return value.total_seconds() if isinstance(value, dt.timedelta) else value


@overload
def task(function: Callable[..., Any], /) -> LeaseTask: ...
@overload
def task(
    *,
    priority: int = ...,
    queue_name: str = ...,
    backend: str = ...,
    takes_context: bool = ...,
    max_attempts: int | None = ...,
    retry_on: Iterable[type[BaseException] | str] | None = ...,
    backoff: Callable[[int, BaseException], float | None] | str | None = ...,
    timeout: float | None = ...,
    concurrency_key: str | None = ...,
    concurrency_limit: int | None = ...,
    rate_key: str | None = ...,
    rate_limit: str | tuple[int, float] | None = ...,
    dedup_key: str | None = ...,
    unique_for: float | dt.timedelta | None = ...,
    debounce: float | dt.timedelta | None = ...,
    max_wait: float | dt.timedelta | None = ...,
    fair_key: str | None = ...,
) -> Callable[[Callable[..., Any]], LeaseTask]: ...
def task(
    function: Callable[..., Any] | None = None,
    /,
    *,
    priority: int = 0,
    queue_name: str = DEFAULT_TASK_QUEUE_NAME,
    backend: str = DEFAULT_TASK_BACKEND_ALIAS,
    takes_context: bool = False,
    **options: Any,
) -> LeaseTask | Callable[[Callable[..., Any]], LeaseTask]:
    """Django's ``@task`` with this queue's options in its signature (the module doc): the Task is
    made by the backend's ``task_class``, as Django's decorator makes it."""
    unknown = set(options) - set(OPTION_FIELDS)
    if unknown:
        raise TypeError(f"task() got unexpected keyword arguments: {', '.join(sorted(unknown))}")
    given = {name: value for name, value in options.items() if value is not None}
    decorate = framework_task(  # type: ignore[call-overload]  # django-stubs' task() takes no backend options
        priority=priority, queue_name=queue_name, backend=backend, takes_context=takes_context, **given
    )
    return decorate if function is None else decorate(function)
