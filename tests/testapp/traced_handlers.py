"""Handlers for the tracing tests (tests/db/test_tracing.py): each opens a span of its own while it
runs, so a test can see that the attempt's span is current inside the handler (thread and coroutine)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from opentelemetry import trace

from tasks.compat import task
from tasks.runtime import Cancel, Snooze, current_task


def _tracer() -> trace.Tracer:
    # Asked each time: a tracer kept from an earlier test's provider would export nowhere.
    return trace.get_tracer("tests.traced_handlers")


def inner(label: str = "inner") -> str:
    """A span of the handler's own, as an instrumented library would make."""
    with _tracer().start_as_current_span(label):
        return label


def fails_first(message: str = "first attempt fails") -> int:
    """Raises on its first attempt, succeeds on the next."""
    attempt = current_task().attempt
    with _tracer().start_as_current_span(f"inner attempt {attempt}"):
        if attempt == 1:
            raise ValueError(message)
        return attempt


def always_fails(message: str) -> None:
    raise LookupError(message)


def sleeps(seconds: float) -> None:
    time.sleep(seconds)


def snoozes_once(seconds: float = 0.05) -> str:
    """Snoozes on its first run (the checkpoint remembers it: snoozes are not attempts), then succeeds."""
    run = current_task()
    if not (run.progress or {}).get("snoozed"):
        assert run.checkpoint({"snoozed": True})
        raise Snooze(seconds)
    return "woke"


def cancels(reason: str) -> None:
    raise Cancel(reason)


async def async_inner(label: str = "async inner") -> str:
    await asyncio.sleep(0)
    with _tracer().start_as_current_span(label):
        await asyncio.sleep(0.01)
    return label


async def async_fails(message: str) -> None:
    await asyncio.sleep(0)
    raise KeyError(message)


@task()
def dj_inner(label: str) -> str:
    return inner(label)


def noop(**kwargs: Any) -> None:
    return None


def _stored(value: Any) -> Any:
    with _tracer().start_as_current_span(f"inside {value}"):
        return value


def _refused(value: Any) -> Any:
    raise KeyError(value)


def stepped_and_waiting(event: str) -> Any:
    """Durable steps (tasks/steps.py): one stored, a wait for ``event``, then one whose function raises."""
    from tasks.steps import step, wait_for_event

    step("reserve", _stored, "reserved")
    payload = wait_for_event(event)
    step("ship", _refused, payload)
