"""Handlers for the benchmarks (importable by worker processes started from the repository root)."""

from __future__ import annotations

import time
from typing import Any

from tasks.runtime import current_task


def noop(**kwargs: Any) -> None:
    return None


def hang_first_attempt(**kwargs: Any) -> int:
    """Blocks on its first attempt (the benchmark kills that worker); returns at once afterwards."""
    run = current_task()
    if run.attempt == 1:
        time.sleep(3600)
    return run.attempt


def pause(seconds: float = 0.3, **kwargs: Any) -> None:
    """Stand-in for a task that is still running when its worker is asked to stop."""
    time.sleep(seconds)


async def sleep_async(seconds: float = 1.0, **kwargs: Any) -> None:
    """The I/O-bound case: a task that waits (an HTTP call, a mail server) without a thread."""
    import asyncio

    await asyncio.sleep(seconds)


def sleep_sync(seconds: float = 1.0, **kwargs: Any) -> None:
    """The same wait, blocking its executor thread (the thread executor's variant)."""
    time.sleep(seconds)


def sustained(at: float, **kwargs: Any) -> None:
    """bench/sustained.py's job: report the pickup latency (now - ``at``, its enqueue wall-clock time),
    do 1 ms of work on the executor thread, report the end."""
    from bench import pickup

    pickup.started(at)
    time.sleep(0.001)
    pickup.ended()


async def sustained_async(at: float, **kwargs: Any) -> None:
    """The same job as a coroutine on the worker's event loop (as the async peers' jobs are)."""
    import asyncio

    from bench import pickup

    pickup.started(at)
    await asyncio.sleep(0.001)
    pickup.ended()
