"""From a claimed task to its handler and back: resolve the path, call it, and turn whatever comes
out (a value, any exception, something jsonb cannot hold) into an :class:`Outcome`.

Used alike by the executor threads (:mod:`tasks.worker.threads`) and the event loop
(:mod:`tasks.worker.aio`)."""

from __future__ import annotations

import dataclasses
import inspect
import traceback
from inspect import iscoroutinefunction
from typing import Any

from asgiref.sync import async_to_sync
from django.db import connections
from django.utils.module_loading import import_string

from tasks.backends import allowlist
from tasks.compat import normalize_json
from tasks.exceptions import Cancel, NotATask, Snooze, TaskPathRefused, UnstorableResult
from tasks.lifecycle import policy
from tasks.lifecycle.storable import storable_json
from tasks.models import Failure
from tasks.runtime import Execution
from tasks.worker import sentry
from tasks.worker.ledger import Outcome


class HandlerCache:
    """Resolves a task's path to a callable once per process. A path that came through the JSON API
    is checked against the API allow-list first (:mod:`tasks.backends.allowlist`), before anything
    is imported, and again on every call: the lists are settings, and a refusal is not cached.

    It also knows which attempts run on the event loop (:meth:`is_async`), once per path."""

    def __init__(self) -> None:
        self._cache: dict[str, Any] = {}
        self._checked: dict[str, Any] = {}  # API paths whose target passed allowlist.resolve()
        self._kinds: dict[tuple[str, bool], bool] = {}  # (path, via a django.tasks backend) -> async

    def __call__(self, path: str, *, api_origin: bool = False) -> Any:
        if api_origin:
            reason = allowlist.refusal(path)
            if reason is not None:
                raise TaskPathRefused(f"{path!r}: {reason}")
            target = self._checked.get(path)
            if target is None:
                target = self._checked[path] = allowlist.resolve(path)
            return target
        target = self._cache.get(path)
        if target is None:
            target = import_string(path)
            self._cache[path] = target
        return target

    def is_async(self, execution: Execution) -> bool:
        """Whether the attempt's handler is a coroutine function (or a django.tasks Task of one). A
        path that does not resolve goes to a thread, which records why."""
        task = execution.task
        key = (task.task_path, task.backend_alias is not None)
        kind = self._kinds.get(key)
        if kind is not None and not task.api_origin:
            return kind
        try:
            # An API path is checked against the allow-list on every call (the lists are settings).
            target = self(task.task_path, api_origin=task.api_origin)
        except Exception:
            return False
        from tasks.compat import Task as DjangoTask

        if isinstance(target, DjangoTask):
            kind = iscoroutinefunction(target.func)
        else:
            # A path enqueued through a django.tasks backend must be a Task: the thread refuses it.
            kind = task.backend_alias is None and callable(target) and is_coroutine_callable(target)
        self._kinds[key] = kind
        return kind


def close_broken_connections() -> None:
    """Close this thread's connections that met a database error and are no longer usable (checked
    with one round trip, only after an error): a long-lived thread then connects anew instead of
    failing on a connection the server dropped."""
    for connection in connections.all(initialized_only=True):
        if connection.errors_occurred:
            connection.close_if_unusable_or_obsolete()


def exception_path(exc: BaseException) -> str:
    kind = type(exc)
    return f"{kind.__module__}.{kind.__qualname__}"


def failure_from(execution: Execution, exc: BaseException, *, retry: bool = True) -> Failure:
    try:
        text = "".join(traceback.format_exception(exc))
    except Exception:  # a broken __str__/__repr__ must not stop the record
        text = f"<traceback unavailable: {exception_path(exc)}>"
    try:
        message = str(exc)
    except Exception:
        message = f"<str() of the exception failed: {exception_path(exc)}>"
    return Failure(execution.id, execution.token, exception_path(exc), message, text, retry=retry)


def is_coroutine_callable(target: Any) -> bool:
    """A coroutine function, or an object whose ``__call__`` is one (calling either returns a
    coroutine, which must be awaited, not stored as the task's result)."""
    if iscoroutinefunction(target):
        return True
    call = inspect.getattr_static(type(target), "__call__", None)
    return not isinstance(target, type) and iscoroutinefunction(call)


def failure_outcome(execution: Execution, exc: BaseException, target: Any = None) -> Outcome:
    """What a handler raised, as an outcome (threads and coroutines alike); ``target``: the handler,
    when it resolved (its own retry policy)."""
    # Anything the handler raises ends the attempt as a recorded outcome: SystemExit,
    # KeyboardInterrupt, GeneratorExit and CancelledError included (the worker's own shutdown
    # never raises inside a handler; its cancellations of coroutines are told apart by
    # ``execution.cancelled_by_worker``). An import error will not import next time, and a
    # refused path will not be admitted next time: neither is retried.
    if isinstance(exc, Snooze | Cancel):
        decision = decided(execution, exc)
        if decision is not None:
            return decision
    retry = not isinstance(exc, policy.NEVER_RETRIED)
    if isinstance(exc, ImportError | NotATask | TaskPathRefused):
        from tasks.backends.running import refused

        refused(execution)  # a backend's task that cannot run here: task_finished says so
    failure = failure_from(execution, exc, retry=retry)
    if retry:
        failure = with_policy(failure, execution, exc, target)
    sentry.report(execution, exc, failure)  # the "sentry" extra: only with LeasingIntegration active
    return Outcome(execution, failure=failure, error=exc)


def decided(execution: Execution, exc: Snooze | Cancel) -> Outcome | None:
    """A snooze or a cancel the handler raised, as an outcome (None: a snooze of a length no
    database can add; it is recorded as the handler's failure instead)."""
    if isinstance(exc, Cancel):
        reason = failure_from(execution, exc, retry=False)
        return Outcome(execution, failure=dataclasses.replace(reason, kind="cancel", traceback=""), error=exc)
    try:
        delay = policy.checked_delay(exc.seconds, what="a snooze")
    except ValueError as problem:
        exc.args = (f"the handler snoozed wrongly: {problem}",)
        return None
    failure = Failure(execution.id, execution.token, exception_path(exc), str(exc), kind="snooze", delay=delay)
    return Outcome(execution, failure=failure)


def effective_policy(execution: Execution, target: Any) -> policy.RetryPolicy | None:
    """The attempt's retry policy (:func:`tasks.lifecycle.policy.effective`)."""
    return policy.effective(execution.task.retry_policy, execution.task.queue, target)


def with_policy(
    failure: Failure, execution: Execution, exc: BaseException, target: Any, *, backoff: bool = True
) -> Failure:
    """A retryable failure under the attempt's retry policy (:func:`tasks.lifecycle.policy.decide`):
    not retried if the exception is not one it retries; the policy's backoff (user code: it runs
    here, on the executor, outside any transaction) and its limit when the row's is not the one that
    applies."""
    task = execution.task
    decision = policy.decide(
        exc,
        effective_policy(execution, target),
        attempt=execution.attempt,
        row_max_attempts=task.max_attempts,
        explicit_max_attempts=(task.retry_policy or {}).get("max_attempts"),
        backoff=backoff,
    )
    if decision is None:
        return failure
    if not decision.retry:
        return dataclasses.replace(failure, retry=False)
    return dataclasses.replace(failure, delay=decision.delay, max_attempts=decision.max_attempts)


def value_outcome(execution: Execution, value: Any) -> Outcome:
    """What a handler returned, as an outcome: stored JSON, or a failure if it cannot be stored."""
    try:
        if execution.django is not None:
            try:
                value = normalize_json(value)  # what django.tasks stores of a return value, with its errors
            except RecursionError:  # nested too deeply: the same every time, like storable_json's verdict
                raise UnstorableResult("not JSON-serialisable: nested too deeply") from None
        return Outcome(execution, value_json=storable_json(value))
    except UnstorableResult as exc:
        exc.args = (f"the return value cannot be stored: {exc}",)
        return Outcome(execution, failure=failure_from(execution, exc, retry=False), error=exc)
    except (TypeError, ValueError) as exc:  # normalize_json refused it: the same every time
        return Outcome(execution, failure=failure_from(execution, exc, retry=False), error=exc)


def call(target: Any, execution: Execution) -> Any:
    """Run the handler on this thread (a coroutine function through async_to_sync)."""
    from tasks.compat import Task as DjangoTask

    if isinstance(target, DjangoTask):
        from tasks.backends.running import run_django_task

        return run_django_task(target, execution)
    if execution.task.backend_alias is not None:
        # Enqueued through a django.tasks backend: only a Task runs (as in Django's other
        # database backends), whatever else the path imports.
        raise NotATask(f"{execution.task.task_path} is not a django.tasks Task")
    if not callable(target):
        raise TypeError(f"{execution.task.task_path} is not callable")
    if is_coroutine_callable(target):
        return async_to_sync(target)(*execution.task.args, **execution.task.kwargs)
    return target(*execution.task.args, **execution.task.kwargs)


async def acall(target: Any, execution: Execution) -> Any:
    """Await the handler on the event loop."""
    from tasks.compat import Task as DjangoTask

    if isinstance(target, DjangoTask):
        from tasks.backends.running import arun_django_task

        return await arun_django_task(target, execution)
    return await target(*execution.task.args, **execution.task.kwargs)
