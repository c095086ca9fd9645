"""Handler failures in Sentry, with the task they belong to (the ``sentry`` extra).

    import sentry_sdk
    from tasks.worker.sentry import LeasingIntegration

    sentry_sdk.init(dsn=..., integrations=[LeasingIntegration()])

Every attempt whose handler raises is sent as an event of its exception, tagged with the task
(``leasing.task.id``, ``leasing.task.path``, ``leasing.queue``, ``leasing.attempt``,
``leasing.worker``, and ``leasing.retryable``: whether its retry policy retries that exception; the
attempts left decide the rest) and with a "leasing task" context (max attempts, the backend alias,
the token of the attempt). What a handler decides is not an error and is not sent: a snooze, a
cancel, a discard. Nothing is sent unless the integration is in the active client.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

from tasks.exceptions import Discard

if TYPE_CHECKING:
    from sentry_sdk.integrations import Integration

    from tasks.lifecycle.values import Failure
    from tasks.runtime import Execution

#: Whether sentry_sdk can be imported at all (the extra is installed): checked once.
AVAILABLE = importlib.util.find_spec("sentry_sdk") is not None

#: The integration's class, made when a project first imports it (``LeasingIntegration``, below):
#: sentry_sdk is imported then, not with the worker (it was a sixth of a worker's start-up: every
#: process paid it, with Sentry or without). None: no client can have the integration.
_made: type | None = None


def _integration_class() -> type:
    global _made
    if _made is None:
        if AVAILABLE:
            from sentry_sdk.integrations import Integration as base
        else:  # without the extra, a name that can be subclassed and is never registered

            class base:  # type: ignore[no-redef]
                identifier = ""

        class LeasingIntegration(base):
            """Sends handler failures to Sentry with their task (the module doc)."""

            identifier = "django_leasing"

            @staticmethod
            def setup_once() -> None:
                """Nothing to patch: the worker calls :func:`report` where an attempt fails."""

        LeasingIntegration.__module__ = __name__
        LeasingIntegration.__qualname__ = "LeasingIntegration"
        _made = LeasingIntegration
    return _made


if TYPE_CHECKING:

    class LeasingIntegration(Integration):
        """Sends handler failures to Sentry with their task (the module doc)."""

        identifier = "django_leasing"

        @staticmethod
        def setup_once() -> None: ...

else:

    def __getattr__(name: str) -> Any:
        if name == "LeasingIntegration":
            return _integration_class()
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def report(execution: Execution, exc: BaseException, failure: Failure) -> None:
    """Send ``exc``, the failure of ``execution``'s handler, to the active Sentry client if it has
    :class:`LeasingIntegration`; otherwise nothing."""
    if _made is None or not AVAILABLE or isinstance(exc, Discard):
        return  # nobody made the integration: no client has it
    import sentry_sdk

    client = sentry_sdk.get_client()
    if not client.is_active() or client.get_integration(_made) is None:
        return
    task = execution.task
    tags: dict[str, Any] = {
        "leasing.task.id": task.id,
        "leasing.task.path": task.task_path,
        "leasing.queue": task.queue,
        "leasing.attempt": execution.attempt,
        "leasing.worker": execution.worker_id,
        "leasing.retryable": failure.retry,
    }
    with sentry_sdk.new_scope() as scope:
        for name, value in tags.items():
            scope.set_tag(name, str(value))  # Sentry indexes tags as text
        scope.set_context(
            "leasing task",
            {
                "id": task.id,
                "path": task.task_path,
                "queue": task.queue,
                "attempt": execution.attempt,
                "max_attempts": task.max_attempts,
                "token": task.token,
                "backend": task.backend_alias,
                "database": execution.using,
            },
        )
        sentry_sdk.capture_exception(exc)
