"""A ``django.tasks`` backend on this queue.

    TASKS = {"default": {"BACKEND": "tasks.backends.LeaseBackend",
                         "QUEUES": ["default", "mail"],          # optional: allowed queue names
                         "OPTIONS": {"max_attempts": 3, "timeout": None, "database": "default"}}}

    @task(priority=10)
    def send_invoice(invoice_id): ...

    result = send_invoice.enqueue(7)             # a row in tasks_task, run by ``manage.py run_worker``
    result.refresh(); result.status, result.return_value, result.errors, result.attempts

Concurrency keys (tasks/lifecycle/concurrency.py): django.tasks fixes a Task's options, so the backend maps
task paths to a key and a limit in its OPTIONS. The key is a ``str.format`` template filled with
the call's arguments, so one task can be limited per customer, per account, ...:

    "OPTIONS": {"concurrency": {"billing.tasks.send_invoice": {"key": "invoice:{customer_id}", "limit": 2}}}

A task waiting for a slot (BLOCKED in this queue) is READY to django.tasks.

Rate limits (tasks/lifecycle/ratelimits.py) are mapped the same way, the key a template too:

    "OPTIONS": {"rate_limits": {"mail.tasks.send": {"key": "smtp", "limit": "14/s"},
                                "api.tasks.call": {"key": "customer:{customer_id}", "limit": "100/min"}}}

Fair queues (``LEASING_TASKS["FAIR_QUEUES"]``): claims take turns between keys (tenants). The backend
maps task paths to a key template the same way:

    "OPTIONS": {"fair": {"billing.tasks.send_invoice": "{customer_id}"}}

Tasks that take a context get a :class:`LeaseTaskContext`: ``context.attempt``, and this queue's
``context.checkpoint(progress)`` / ``context.progress`` / ``context.token``.

A row remembers the backend alias that enqueued it and the Task's own ``run_after``, so a result
read back (``get_result``, ``refresh``, the signals a worker sends) carries the task as it was
enqueued: ``.using()`` values included. The worker runs such a row only if its path names a
django.tasks Task (:class:`~tasks.exceptions.NotATask` otherwise).

Several databases (tasks/lifecycle/routing.py): a backend with ``OPTIONS["database"]`` keeps every task in
that database, whatever ``LEASING_TASKS["QUEUE_DATABASES"]`` says (an explicit choice wins, as
``db_manager(alias)`` does); a backend without it puts each task in the database its queue is
routed to. Result ids are the task's id, suffixed ``@alias`` when the task lives elsewhere than the
backend's own database (ids are unique per database only), so ``get_result`` finds it again.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from django.core import checks
from django.db import DEFAULT_DB_ALIAS, connections, transaction
from django.utils.module_loading import import_string

from leasing.routing import known_databases
from tasks.backends.option_checks import (
    OPTION_CHECKS,
    OPTIONS,
    concurrency_problems,
    fair_problems,
    rate_limit_problems,
    retry_problems,
    task_option_problems,
    window_spec_problems,
)
from tasks.backends.options import LeaseTask, LeaseTaskResult
from tasks.compat import (
    BaseTaskBackend,
    InvalidTask,
    InvalidTaskBackend,
    TaskContext,
    TaskError,
    TaskResult,
    TaskResultDoesNotExist,
    TaskResultStatus,
    normalize_json,
    task_backends,
    task_enqueued,
)
from tasks.compat import Task as DjangoTask
from tasks.lifecycle import policy
from tasks.lifecycle.routing import queue_database
from tasks.models import Task, TaskStatus
from tasks.models.task_enqueue import announce_enqueued

if TYPE_CHECKING:
    import datetime as dt

    from tasks.runtime import Execution

_STATUS = {
    # Waiting for a concurrency slot: not yet runnable, but not started either.
    TaskStatus.BLOCKED: TaskResultStatus.READY,
    TaskStatus.AWAITING: TaskResultStatus.READY,
    TaskStatus.READY: TaskResultStatus.READY,
    TaskStatus.RUNNING: TaskResultStatus.RUNNING,
    TaskStatus.SUCCESSFUL: TaskResultStatus.SUCCESSFUL,
    TaskStatus.FAILED: TaskResultStatus.FAILED,
    # django.tasks has no cancelled state: a cancelled task will not run again, like a failed one.
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

    async def acheckpoint(self, progress: Any) -> bool:
        return await self.execution.acheckpoint(progress)

    def check(self) -> None:
        self.execution.check()


class LeaseBackend(BaseTaskBackend):
    #: ``@task(...)`` takes this queue's options (tasks/backends/options.py).
    task_class = LeaseTask
    supports_defer = True
    supports_async_task = True
    supports_get_result = True
    supports_priority = True

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        #: Set by OPTIONS["database"]: then every task of this backend lives there, routed or not.
        self.explicit_database = "database" in self.options
        self.using = self.options.get("database", DEFAULT_DB_ALIAS)
        self.max_attempts = self.options.get("max_attempts")
        self.timeout = self.options.get("timeout")
        spec = self.options.get("concurrency") or {}
        # A malformed mapping is reported by the system check (tasks.E012); it limits nothing.
        self.concurrency: dict[str, dict[str, Any]] = spec if not concurrency_problems(spec) else {}
        rates = self.options.get("rate_limits") or {}
        # A malformed mapping is reported by the system check (tasks.E015); it limits nothing.
        self.rate_limits: dict[str, dict[str, Any]] = rates if not rate_limit_problems(rates) else {}
        unique = self.options.get("unique") or {}
        debounce = self.options.get("debounce") or {}
        # A malformed mapping, or a path in both, is reported by the system check (tasks.E014); it applies
        # nothing.
        usable = not window_spec_problems(unique, "unique") and not window_spec_problems(debounce, "debounce")
        usable = usable and not set(unique) & set(debounce)
        self.unique: dict[str, dict[str, Any]] = unique if usable else {}
        self.debounce: dict[str, dict[str, Any]] = debounce if usable else {}
        retry = self.options.get("retry") or {}
        # A malformed mapping is reported by the system check (tasks.E013); it applies nothing.
        self.retry: dict[str, dict[str, Any]] = retry if not retry_problems(retry) else {}
        fair = self.options.get("fair") or {}
        # A malformed mapping is reported by the system check (tasks.E014); it keys nothing.
        self.fair: dict[str, str] = fair if not fair_problems(fair) else {}

    def validate_task(self, task: DjangoTask) -> None:
        """Django's checks, then those of a :class:`LeaseTask`'s options: ``InvalidTask`` naming the
        task and each option that is wrong, when the module defining it is imported."""
        super().validate_task(task)
        if isinstance(task, LeaseTask):
            problems = task_option_problems(task)
            if problems:
                raise InvalidTask(f"@task options of {task.module_path}: " + "; ".join(problems))

    def concurrency_of(self, task: DjangoTask, args: Any, kwargs: Any) -> tuple[str | None, int | None]:
        """The concurrency key (its template filled with the call's arguments) and limit of a call: the
        task's own (``@task(concurrency_key=..., concurrency_limit=...)``), else OPTIONS["concurrency"]'s."""
        if isinstance(task, LeaseTask) and task.concurrency_key is not None:
            return _filled("concurrency", task.concurrency_key, task, args, kwargs), task.concurrency_limit
        return self._keyed(self.concurrency, "concurrency", task, args, kwargs)

    def rate_of(self, task: DjangoTask, args: Any, kwargs: Any) -> tuple[str | None, Any]:
        """The rate key (its template filled with the call's arguments) and rate limit of a call: the
        task's own, else OPTIONS["rate_limits"]'s."""
        if isinstance(task, LeaseTask) and task.rate_key is not None:
            return _filled("rate", task.rate_key, task, args, kwargs), task.rate_limit
        return self._keyed(self.rate_limits, "rate", task, args, kwargs)

    def _keyed(
        self, options: dict[str, dict[str, Any]], kind: str, task: DjangoTask, args: Any, kwargs: Any
    ) -> tuple[str | None, Any]:
        entry = options.get(task.module_path)
        if entry is None:
            return None, None
        return _filled(kind, entry["key"], task, args, kwargs), entry["limit"]

    def windows_of(self, task: DjangoTask, args: Any, kwargs: Any) -> dict[str, Any]:
        """The enqueue arguments of a call's window (OPTIONS["unique"] or ["debounce"]), its key
        template filled with the call's arguments: ``dedup_key`` with ``unique_for``, or with
        ``debounce`` and ``max_wait``; nothing for a path in neither. The task's own window
        (``@task(dedup_key=..., unique_for=...)`` or ``debounce=``) wins over OPTIONS'."""
        if isinstance(task, LeaseTask) and task.dedup_key is not None:
            key = _filled("dedup", task.dedup_key, task, args, kwargs)
            if task.unique_for is not None:
                return {"dedup_key": key, "unique_for": task.unique_for}
            return {"dedup_key": key, "debounce": task.debounce, "max_wait": task.max_wait}
        if (entry := self.unique.get(task.module_path)) is not None:
            return {"dedup_key": _filled("unique", entry["key"], task, args, kwargs), "unique_for": entry["for"]}
        if (entry := self.debounce.get(task.module_path)) is not None:
            return {
                "dedup_key": _filled("debounce", entry["key"], task, args, kwargs),
                "debounce": entry["delay"],
                "max_wait": entry.get("max_wait"),
            }
        return {}

    def fair_key_of(self, task: DjangoTask, args: Any, kwargs: Any) -> str | None:
        """The fair key (its template filled with the call's arguments) of a call, if the task has one:
        its own (``@task(fair_key=...)``), else OPTIONS["fair"]'s."""
        own = task.fair_key if isinstance(task, LeaseTask) else None
        template = own if own is not None else self.fair.get(task.module_path)
        return None if template is None else _filled("fair", template, task, args, kwargs)

    def enqueue(self, task: DjangoTask, args: Any, kwargs: Any) -> TaskResult:
        self.validate_task(task)
        # Django's own normalisation (what every django.tasks backend accepts, with its errors:
        # TypeError "Unsupported type" ...); the queue then refuses what jsonb cannot hold (NaN,
        # infinity, NUL, lone surrogates) with a ValueError before anything is written.
        args = normalize_json(args)
        kwargs = normalize_json(kwargs)
        concurrency_key, concurrency_limit = self.concurrency_of(task, args, kwargs)
        rate_key, rate_limit = self.rate_of(task, args, kwargs)
        window = self.windows_of(task, args, kwargs)
        fair_key = self.fair_key_of(task, args, kwargs)
        own_policy: dict[str, Any] = {}
        own_timeout = None
        if isinstance(task, LeaseTask):
            own_policy = {"max_attempts": task.max_attempts, "retry_on": task.retry_on, "backoff": task.backoff}
            own_timeout = task.timeout
        # task_enqueued is sent before the row is committed, so before any worker can start the
        # task: it always precedes task_started. (Inside the caller's transaction, the task and the
        # signal stand or fall with it: a rolled-back enqueue runs nothing, though it was signalled.)
        using = self.using if self.explicit_database else queue_database(task.queue_name)
        with transaction.atomic(using=using, savepoint=False):
            enqueued = Task.objects.db_manager(using).enqueue(
                task.module_path,
                args=args,
                kwargs=kwargs,
                queue=task.queue_name,
                priority=task.priority,
                run_after=task.run_after,
                # @task(max_attempts=, retry_on=, backoff=) is stored as the enqueue's own, over
                # OPTIONS["retry"] (both win over the handler's); @retry_policy on the function is a
                # default the row shows from the start.
                **own_policy,
                default_max_attempts=getattr(policy.handler_policy(task), "max_attempts", None) or self.max_attempts,
                retry_policy=self.retry.get(task.module_path),
                timeout=own_timeout if own_timeout is not None else self.timeout,
                backend_alias=self.alias,
                concurrency_key=concurrency_key,
                concurrency_limit=concurrency_limit,
                rate_key=rate_key,
                rate_limit=rate_limit,
                **window,
                fair_key=fair_key,
            )
            if not enqueued.created:
                # A window's duplicate, or an enqueue folded into the key's waiting debounced task: the
                # result is that task's, and nothing new was enqueued (no signal).
                existing = Task.objects.db_manager(using).find(enqueued.id)  # moved: tasks_finished
                if existing is not None:
                    return self.result_from_row(existing)
            # The result describes the task as enqueued (the insert returns what it needs).
            result: TaskResult = LeaseTaskResult(
                task=task,
                id=self.result_id(enqueued.id, using),
                status=TaskResultStatus.READY,
                enqueued_at=enqueued.enqueued_at,
                started_at=None,
                finished_at=None,
                last_attempted_at=None,
                args=args,
                kwargs=kwargs,
                backend=self.alias,
                errors=[],
                worker_ids=[],
            )
            if enqueued.created:
                task_enqueued.send(type(self), task_result=result)
        if enqueued.created:
            announce_enqueued(using, [enqueued.id])  # after task_enqueued, which precedes any start
        return result

    def result_id(self, task_id: int, using: str) -> str:
        """The id of the result of task ``task_id`` in database ``using`` (see the module doc)."""
        return str(task_id) if using == self.using else f"{task_id}@{using}"

    def get_result(self, result_id: str) -> TaskResult:
        try:
            number, _, using = str(result_id).partition("@")
            using = using or self.using
            if using not in known_databases():
                raise ValueError(using)
            row = Task.objects.db_manager(using).find(int(number))
        except (ValueError, TypeError, OverflowError):
            raise TaskResultDoesNotExist(result_id) from None
        if row is None:
            raise TaskResultDoesNotExist(result_id)
        return self.result_from_row(row)

    def result_from_row(self, row: Task) -> TaskResult:
        return task_result(row, default_alias=self.alias)

    def check(self, **kwargs: Any) -> list[checks.CheckMessage]:
        errors: list[checks.CheckMessage] = []
        unknown = set(self.options) - OPTIONS
        if unknown:
            errors.append(
                checks.Error(
                    f"TASKS[{self.alias!r}]['OPTIONS'] has unknown keys: {', '.join(sorted(unknown))}",
                    hint=f"LeaseBackend takes {', '.join(sorted(OPTIONS))}.",
                    id="tasks.E010",
                )
            )
        for option, problems_of, hint, check_id in OPTION_CHECKS:
            for problem in problems_of(self.options.get(option, {})):
                message = f"TASKS[{self.alias!r}]['OPTIONS'][{option!r}] {problem}"
                errors.append(checks.Error(message, hint=hint, id=check_id))
        both = set(self.options.get("unique") or {}) & set(self.options.get("debounce") or {})
        if isinstance(self.options.get("unique"), dict) and isinstance(self.options.get("debounce"), dict) and both:
            errors.append(
                checks.Error(
                    f"TASKS[{self.alias!r}]['OPTIONS'] names task paths in both 'unique' and 'debounce': "
                    f"{', '.join(sorted(both))}",
                    hint="A key is either unique for a period or debounced.",
                    id="tasks.E014",
                )
            )
        if self.using not in connections:
            errors.append(
                checks.Error(
                    f"TASKS[{self.alias!r}]['OPTIONS']['database'] names no database: {self.using!r}",
                    id="tasks.E011",
                )
            )
        return errors


def _filled(kind: str, template: str, task: DjangoTask, args: Any, kwargs: Any) -> str:
    """A key template of OPTIONS[kind] filled with a call's arguments; ValueError when they do not fit."""
    try:
        # OverflowError: a character past U+10FFFF ({0:c}), an integer no float holds ({0:e}).
        return str(template).format(*args, **kwargs)
    except (KeyError, IndexError, ValueError, AttributeError, TypeError, OverflowError) as exc:
        raise ValueError(
            f"the {kind} key template {template!r} of {task.module_path} does not fit the call's "
            f"arguments: {type(exc).__name__}: {exc}"
        ) from None


def enqueued_task(
    task: DjangoTask, *, backend: str, queue_name: str, priority: int, run_after: dt.datetime | None
) -> DjangoTask:
    """``task`` as it was enqueued: what ``.using()`` changed, re-applied from its row.

    Built without validating again: the row was validated when it was enqueued, and a result must
    describe the stored task even if the backend's QUEUES changed since or its alias is not
    configured in this process (validation would also inspect the function's signature each time).
    """
    if (task.backend, task.queue_name, task.priority, task.run_after) == (backend, queue_name, priority, run_after):
        return task
    clone = object.__new__(type(task))
    for field in dataclasses.fields(task):
        object.__setattr__(clone, field.name, getattr(task, field.name))
    for name, value in (("backend", backend), ("queue_name", queue_name), ("priority", priority)):
        object.__setattr__(clone, name, value)
    object.__setattr__(clone, "run_after", run_after)
    return clone


def task_errors(entries: list[dict[str, Any]], *, up_to_token: int | None = None) -> list[TaskError]:
    """The stored error entries as django.tasks sees them: one per attempt that began and failed
    (a claim returned before its attempt was known to start is not an attempt). ``up_to_token``:
    only the entries of that attempt and earlier ones (tokens only grow)."""
    return [
        TaskError(exception_class_path=e.get("exception_class_path", ""), traceback=e.get("traceback", ""))
        for e in entries
        if e.get("kind") != "returned"
        and (up_to_token is None or not isinstance(e.get("token"), int) or e["token"] <= up_to_token)
    ]


def stand_in(path: str, *, backend: str, queue_name: str, priority: int, run_after: dt.datetime | None) -> DjangoTask:
    """A Task named ``path`` for a task enqueued through a backend whose code no longer imports as
    a Task (removed, renamed, replaced by something else): its result, and the ``task_finished``
    of the attempt that could not run, still need a Task, and receivers read its ``module_path``.
    Calling it raises ImportError."""
    module, _, name = path.rpartition(".")

    def unavailable(*args: Any, **kwargs: Any) -> Any:
        raise ImportError(f"{path} does not name a django.tasks Task")

    unavailable.__module__, unavailable.__name__, unavailable.__qualname__ = module, name, name
    task = object.__new__(DjangoTask)
    for field, value in (
        ("func", unavailable),
        ("priority", priority),
        ("backend", backend),
        ("queue_name", queue_name),
        ("run_after", run_after),
        ("takes_context", False),
    ):
        object.__setattr__(task, field, value)
    return task


def _home_database(alias: str) -> str:
    """The database of backend ``alias``: its result ids are bare there, ``id@alias`` elsewhere."""
    try:
        backend = task_backends[alias]
    except InvalidTaskBackend:  # a backend since removed from TASKS
        return DEFAULT_DB_ALIAS
    return backend.using if isinstance(backend, LeaseBackend) else DEFAULT_DB_ALIAS


def task_result(row: Task, *, default_alias: str, task: DjangoTask | None = None) -> TaskResult:
    """A stored task as a django.tasks TaskResult (``task``: the Task object, when already known)."""
    if task is None:
        alias = row.backend_alias or default_alias
        try:
            imported = import_string(row.task_path)
        except ImportError as exc:
            if not row.backend_alias:
                raise TaskResultDoesNotExist(f"task {row.pk}: {row.task_path} does not import ({exc})") from None
            imported = None
        if isinstance(imported, DjangoTask):
            task = enqueued_task(
                imported,
                backend=alias,
                queue_name=row.queue,
                priority=row.priority,
                run_after=row.task_run_after if row.backend_alias else imported.run_after,
            )
        elif row.backend_alias:  # it was a Task when it was enqueued
            task = stand_in(
                row.task_path, backend=alias, queue_name=row.queue, priority=row.priority, run_after=row.task_run_after
            )
        else:
            raise TaskResultDoesNotExist(f"task {row.pk} does not run a django.tasks Task")
    home = _home_database(row.backend_alias or default_alias)
    result: TaskResult = LeaseTaskResult(
        task=task,
        id=str(row.pk) if (row._state.db or DEFAULT_DB_ALIAS) == home else f"{row.pk}@{row._state.db}",
        status=_STATUS[TaskStatus(row.status)],
        enqueued_at=row.enqueued_at,
        started_at=row.started_at,
        finished_at=row.finished_at,
        last_attempted_at=row.last_attempted_at,
        args=row.args,
        kwargs=row.kwargs,
        backend=row.backend_alias or default_alias,
        errors=task_errors(row.errors),
        worker_ids=list(row.worker_ids),
    )
    if row.status == TaskStatus.SUCCESSFUL:
        object.__setattr__(result, "_return_value", row.return_value)
    return result


def sender_for(alias: str) -> type[BaseTaskBackend]:
    """The signals' sender: the class of the backend that enqueued the task (LeaseBackend when
    that alias is not configured in this process)."""
    try:
        return type(task_backends[alias])
    except InvalidTaskBackend:
        return LeaseBackend
