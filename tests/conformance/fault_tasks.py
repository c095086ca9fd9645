"""django.tasks Tasks for the adversarial tests of LeaseBackend (test_lease_backend_faults.py)."""

from __future__ import annotations

import time
from typing import Any

from tasks.compat import TaskContext, task
from tests.conformance.lease_tasks import context_report


@task(takes_context=True)
async def async_report(context: TaskContext) -> dict[str, Any]:
    return context_report(context)


@task(takes_context=True)
async def async_fail_first_attempt(context: TaskContext) -> dict[str, Any]:
    if context.attempt == 1:
        raise ValueError("async attempt 1 fails on purpose")
    return context_report(context)


@task(takes_context=True)
def slow_first_attempt(context: TaskContext, seconds: float) -> dict[str, Any]:
    if context.attempt == 1:
        time.sleep(seconds)  # the task's own work: it overruns its timeout
    return context_report(context)


@task()
def return_deep(depth: int) -> list[Any]:
    """A value nested deeper than any serialiser recurses: it cannot be stored, ever."""
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


UNSTORABLE: dict[str, Any] = {
    "nul in a key": {"before\x00after": 1},
    "lone surrogate in a key": {"\ud800": 1},
    "nul in bytes": b"before\x00after",
    "nan as a key": {float("nan"): 1},
    "infinity deep inside": [[{"x": float("inf")}]],
}


@task()
def return_unstorable(kind: str) -> Any:
    return UNSTORABLE[kind]
