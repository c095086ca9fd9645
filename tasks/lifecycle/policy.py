"""A task's retry policy: which exceptions are retried, after how long, and how many failures end it.

Where a policy comes from, most specific first (each field is taken from the first source that sets it):

1. the enqueue: ``Task.objects.enqueue(path, max_attempts=..., retry_on=[...], backoff="app.mod.fn")``,
   or a django.tasks backend's ``OPTIONS["retry"][task_path]``; stored on the row (``retry_policy``,
   dotted paths: a row outlives the process that enqueued it);
2. the handler itself: :func:`retry_policy` on the function (under ``@task`` for a django.tasks Task);
3. the task's queue: ``LEASING_TASKS["RETRY_POLICIES"][queue]``;
4. the defaults: every exception retried, ``MAX_ATTEMPTS``, ``BACKOFF_BASE`` / ``BACKOFF_MAX``.

The decision is here, in two halves. The worker's (:func:`decide`, called by tasks/worker/handlers.py
when an attempt fails, outside any transaction, for a backoff is user code) says whether the
exception is retried, after how long, under which limit. The database's (``RETRYABLE``, in
``FAIL_SQL`` under the row lock) retries a failure the worker called retryable while the task's
failures stay under that limit, at the database clock plus the delay, or plus :func:`backoff_sql`'s
default backoff. A backoff function returns seconds (a number >= 0) or None for the default backoff;
one that raises or returns anything else is logged and the default backoff is used.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from django.utils.module_loading import import_string

from tasks.conf import get_settings
from tasks.exceptions import Discard, NotATask, TaskPathRefused

logger = logging.getLogger("tasks.worker")

#: The attribute :func:`retry_policy` sets on a handler.
ATTRIBUTE = "leasing_retry_policy"
#: The keys of a policy given as a mapping (settings, a backend's OPTIONS, a row).
KEYS = frozenset({"max_attempts", "retry_on", "backoff"})
#: The longest delay a snooze or a backoff may ask for (a year): an interval the database can add.
MAX_DELAY = 365 * 24 * 3600.0

Backoff = Callable[[int, BaseException], float | None]


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """``max_attempts``: failures before FAILED. ``retry_on``: exception classes that are retried
    (others fail the task at once); None retries every exception. ``backoff(attempt, exception)``:
    seconds before the next attempt (None: the default backoff)."""

    max_attempts: int | None = None
    retry_on: tuple[type[BaseException], ...] | None = None
    backoff: Backoff | None = None

    def over(self, fallback: RetryPolicy | None) -> RetryPolicy:
        """This policy, its unset fields taken from ``fallback``."""
        if fallback is None:
            return self
        return RetryPolicy(
            self.max_attempts if self.max_attempts is not None else fallback.max_attempts,
            self.retry_on if self.retry_on is not None else fallback.retry_on,
            self.backoff if self.backoff is not None else fallback.backoff,
        )

    def retries(self, exc: BaseException) -> bool:
        return self.retry_on is None or isinstance(exc, self.retry_on)

    def delay(self, attempt: int, exc: BaseException) -> float | None:
        """Seconds before the next attempt, or None for the default backoff."""
        if self.backoff is None:
            return None
        try:
            seconds = self.backoff(attempt, exc)
        except Exception:
            logger.exception("the backoff function %r raised; the default backoff is used", self.backoff)
            return None
        if seconds is None:
            return None
        try:
            return checked_delay(seconds, what="a backoff")
        except ValueError as problem:
            logger.error("the backoff function %r: %s; the default backoff is used", self.backoff, problem)
            return None


def checked_delay(seconds: Any, *, what: str) -> float:
    """``seconds`` as a delay the database can add to its clock, or ValueError saying why not."""
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        raise ValueError(f"{what} must be a number of seconds, not {seconds!r}")
    if not math.isfinite(seconds) or not 0 <= seconds <= MAX_DELAY:
        raise ValueError(f"{what} must be from 0 to {MAX_DELAY:g} seconds, not {seconds!r}")
    return float(seconds)


def dotted_path(value: Any) -> str:
    """A class or module-level function as its import path (a string is taken as one)."""
    if isinstance(value, str):
        return value
    module, name = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
    if not module or not name or "<" in name or "." in name:
        raise ValueError(f"{value!r} has no import path: give a module-level class or function, or its dotted path")
    return f"{module}.{name}"


def retry_policy(
    *,
    max_attempts: int | None = None,
    retry_on: Iterable[type[BaseException]] | None = None,
    backoff: Backoff | None = None,
) -> Callable[[Any], Any]:
    """A handler's own retry policy (put it under ``@task`` for a django.tasks Task)::

    @retry_policy(retry_on=[ConnectionError], max_attempts=5, backoff=lambda attempt, exc: 10 * attempt)
    def sync_account(account_id): ...
    """
    problems = policy_problems(
        {"max_attempts": max_attempts, "retry_on": None if retry_on is None else list(retry_on), "backoff": backoff}
    )
    if problems:
        raise ValueError("retry_policy: " + "; ".join(problems))
    policy = RetryPolicy(max_attempts, None if retry_on is None else tuple(retry_on), backoff)

    def attach(handler: Any) -> Any:
        try:
            setattr(handler, ATTRIBUTE, policy)
        except (AttributeError, TypeError):  # above @task: a frozen django.tasks Task; its function carries it
            setattr(handler.func, ATTRIBUTE, policy)
        return handler

    return attach


def handler_policy(target: Any) -> RetryPolicy | None:
    """The policy :func:`retry_policy` put on a handler (or on a django.tasks Task's function)."""
    policy = getattr(target, ATTRIBUTE, None)
    if policy is None:
        policy = getattr(getattr(target, "func", None), ATTRIBUTE, None)
    return policy if isinstance(policy, RetryPolicy) else None


def policy_problems(spec: Any, *, paths_only: bool = False) -> list[str]:
    """What is wrong with a policy mapping (``paths_only``: retry_on and backoff as dotted paths, as
    settings and rows hold them; a path is imported to check it)."""
    if not isinstance(spec, Mapping):
        return ["must be a mapping with any of 'max_attempts', 'retry_on', 'backoff'"]
    problems = []
    unknown = set(spec) - KEYS
    if unknown:
        problems.append(f"has unknown keys {sorted(unknown)} (it takes {', '.join(sorted(KEYS))})")
    limit = spec.get("max_attempts")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        problems.append(f"'max_attempts' must be a whole number of at least 1, not {limit!r}")
    retry_on = spec.get("retry_on")
    if retry_on is not None:
        if isinstance(retry_on, str | bytes) or not isinstance(retry_on, Iterable):
            problems.append("'retry_on' must be a list of exception classes or their dotted paths")
        else:
            for entry in retry_on:
                kind = _resolved(entry) if isinstance(entry, str) else entry
                if paths_only and not isinstance(entry, str):
                    problems.append(f"'retry_on' takes dotted paths here, not {entry!r}")
                elif not (isinstance(kind, type) and issubclass(kind, BaseException)):
                    problems.append(f"'retry_on': {entry!r} is not an exception class (or its importable path)")
    backoff = spec.get("backoff")
    if backoff is not None:
        target = _resolved(backoff) if isinstance(backoff, str) else backoff
        if paths_only and not isinstance(backoff, str):
            problems.append(f"'backoff' takes a dotted path here, not {backoff!r}")
        elif not callable(target):
            problems.append(f"'backoff': {backoff!r} is not a function (or its importable path)")
    return problems


def _resolved(path: str) -> Any:
    try:
        return import_string(path)
    except ImportError:
        return None


# Dotted paths the worker has imported (a policy is read at every failure).
_imported: dict[str, Any] = {}


def _imported_path(path: str) -> Any:
    try:
        return _imported[path]
    except KeyError:
        pass
    try:
        value = import_string(path)
    except ImportError:
        logger.error("retry policy: %r does not import; ignored", path)
        value = None
    _imported[path] = value
    return value


def from_mapping(spec: Mapping[str, Any] | None) -> RetryPolicy | None:
    """A stored or configured policy (dotted paths) as a :class:`RetryPolicy`; paths that do not
    import are left out (logged once)."""
    if not spec:
        return None
    retry_on = spec.get("retry_on")
    classes = None
    if retry_on is not None:
        classes = tuple(
            kind
            for kind in (_imported_path(p) if isinstance(p, str) else p for p in retry_on)
            if isinstance(kind, type) and issubclass(kind, BaseException)
        )
    backoff = spec.get("backoff")
    function = _imported_path(backoff) if isinstance(backoff, str) else backoff
    limit = spec.get("max_attempts")
    return RetryPolicy(limit if isinstance(limit, int) else None, classes, function if callable(function) else None)


def stored(
    *, max_attempts: int | None = None, retry_on: Iterable[Any] | None = None, backoff: Any = None
) -> dict[str, Any] | None:
    """An enqueue's explicit policy as the row keeps it (dotted paths), or None when it gives none."""
    spec: dict[str, Any] = {}
    if max_attempts is not None:
        spec["max_attempts"] = max_attempts
    if retry_on is not None:
        if isinstance(retry_on, str | bytes) or not isinstance(retry_on, Iterable):
            raise ValueError("retry_on must be a list of exception classes or their dotted paths")
        spec["retry_on"] = [dotted_path(entry) for entry in retry_on]
    if backoff is not None:
        spec["backoff"] = dotted_path(backoff)
    if not spec:
        return None
    problems = policy_problems(spec, paths_only=True)
    if problems:
        raise ValueError("retry policy " + "; ".join(problems))
    return spec


# -- the decision ----------------------------------------------------------------------------------

#: Raised by a handler, never retried: a path that will not import, or not be admitted, next time
#: either (ImportError, NotATask, TaskPathRefused), and Discard, which says so.
NEVER_RETRIED: tuple[type[BaseException], ...] = (ImportError, NotATask, TaskPathRefused, Discard)


def effective(row_policy: Mapping[str, Any] | None, queue: str, target: Any) -> RetryPolicy | None:
    """An attempt's retry policy: its row's (the enqueue's), over its handler's (``target``, when it
    resolved), over its queue's (``LEASING_TASKS["RETRY_POLICIES"]``). None: the defaults."""
    found = from_mapping(row_policy)
    own = handler_policy(target) if target is not None else None
    if own is not None:
        found = own if found is None else found.over(own)
    queues = get_settings().RETRY_POLICIES
    if queues and queue in queues:
        configured = from_mapping(queues[queue])
        found = configured if found is None else found.over(configured)
    return found


@dataclass(frozen=True, slots=True)
class Decision:
    """The worker's half of a failure's fate: ``retry``; ``delay``, seconds (None: the default
    backoff, computed by the database); ``max_attempts``, the limit that applies when it is not the
    row's (None: the row's)."""

    retry: bool
    delay: float | None = None
    max_attempts: int | None = None


def decide(
    exc: BaseException,
    found: RetryPolicy | None,
    *,
    attempt: int,
    row_max_attempts: int,
    explicit_max_attempts: int | None,
    backoff: bool = True,
) -> Decision | None:
    """Whether ``exc`` is retried under ``found`` (:func:`effective`), after how long and under which
    limit; None when no policy applies (the defaults: retried, the default backoff, the row's limit).
    ``backoff`` False: no delay is computed (the backoff function is not called)."""
    if isinstance(exc, NEVER_RETRIED):
        return Decision(False)
    if found is None:
        return None
    if not found.retries(exc):
        return Decision(False)
    limit = None if explicit_max_attempts is not None or found.max_attempts == row_max_attempts else found.max_attempts
    return Decision(True, found.delay(attempt, exc) if backoff else None, limit)


def backoff_sql(exponent: str) -> str:
    """Capped exponential backoff with 50-100 % jitter, as an interval (computed in the database)."""
    return (
        "make_interval(secs => LEAST(%(backoff_max)s, %(backoff_base)s * power(2, GREATEST(" + exponent + ", 0)))"
        " * (0.5 + random() / 2))"
    )


#: The database's half, in FAIL_SQL (``d``: a failure the worker sent; ``t``: its row, locked): a
#: failure the worker called retryable is retried while the task's failures stay under the limit.
RETRYABLE = "(d.kind = 'fail' AND d.retry AND t.failures + 1 < COALESCE(d.max_attempts, t.max_attempts))"
