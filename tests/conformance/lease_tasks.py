"""django.tasks Tasks for this backend's own tests (test_lease_backend.py): not ported from Django."""

from __future__ import annotations

import time
from typing import Any

from tasks.compat import TaskContext, task


def _when(value: Any) -> str | None:
    return None if value is None else value.isoformat()


def context_report(context: TaskContext) -> dict[str, Any]:
    """What the running task sees of its own result."""
    result = context.task_result
    return {
        "attempt": context.attempt,
        "attempts": result.attempts,
        "status": str(result.status),
        "worker_ids": list(result.worker_ids),
        "started_at": _when(result.started_at),
        "last_attempted_at": _when(result.last_attempted_at),
        "finished_at": _when(result.finished_at),
        "errors": [e.exception_class_path for e in result.errors],
        "task": {
            "priority": result.task.priority,
            "queue_name": result.task.queue_name,
            "run_after": _when(result.task.run_after),
            "backend": result.task.backend,
        },
    }


@task(takes_context=True)
def report(context: TaskContext) -> dict[str, Any]:
    return context_report(context)


@task(takes_context=True)
def fail_first_attempt(context: TaskContext) -> dict[str, Any]:
    if context.attempt == 1:
        raise ValueError("attempt 1 fails on purpose")
    return context_report(context)


def _wait_for_gate(gate: str) -> None:
    from tests.testapp.models import Gate

    deadline = time.monotonic() + 120
    # Open, or gone (a test's teardown empties the table): either way, return.
    while Gate.objects.filter(key=gate, open=False).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"gate {gate} never opened")
        time.sleep(0.02)


@task()
def wait_for_gate(gate: str) -> str:
    _wait_for_gate(gate)
    return "gate opened"


@task(takes_context=True)
def block_first_attempt(context: TaskContext, gate: str) -> dict[str, Any]:
    if context.attempt == 1:
        _wait_for_gate(gate)
    return context_report(context)


@task()
def echo(value: Any) -> Any:
    return value


@task()
def return_bytes() -> bytes:
    return b"bytes are normalised to text"


@task()
def return_nan() -> float:
    return float("nan")


@task()
def return_undecodable_bytes() -> bytes:
    return b"\xff\xfe"


def not_a_task() -> str:
    """A plain callable: runs for ``Task.objects.enqueue``, refused for a backend's row."""
    return "ran"
