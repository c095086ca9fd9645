"""Task handlers used by the tests (plain callables and django.tasks tasks)."""

from __future__ import annotations

import os
import time
from typing import Any

from django.tasks import task

from tasks.runtime import current_task


def noop(**kwargs: Any) -> None:
    return None


def _effect(phase: str) -> None:
    from tests.testapp.models import Effect

    run = current_task()
    Effect.objects.create(task_id=run.id, token=run.token, attempt=run.attempt, phase=phase, pid=os.getpid())


def record(**kwargs: Any) -> int:
    """One effect row per execution."""
    _effect("done")
    return os.getpid()


def block(gate: str, **kwargs: Any) -> dict[str, Any]:
    """Record the start, wait until the test opens ``gate``, record the end."""
    from tests.testapp.models import Gate

    _effect("started")
    deadline = time.monotonic() + 120
    while not Gate.objects.filter(key=gate, open=True).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"gate {gate} never opened")
        time.sleep(0.02)
    _effect("finished")
    return {"pid": os.getpid(), "token": current_task().token}


def slow_first(gate: str, **kwargs: Any) -> dict[str, Any]:
    """Attempt 1 waits for the gate (past any short timeout); later attempts return at once."""
    from tests.testapp.models import Gate

    run = current_task()
    if run.attempt == 1:
        deadline = time.monotonic() + 120
        while not Gate.objects.filter(key=gate, open=True).exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        return {"attempt": 1, "late": True}
    return {"attempt": run.attempt}


def fail_until(succeed_on: int, **kwargs: Any) -> str:
    run = current_task()
    if run.attempt < succeed_on:
        raise ValueError(f"attempt {run.attempt} fails on purpose")
    return f"succeeded on attempt {run.attempt}"


def resume(**kwargs: Any) -> dict[str, Any]:
    """Checkpoints, then fails on the first attempt; the retry resumes from the checkpoint."""
    run = current_task()
    start = (run.progress or {}).get("step", 0)
    if run.attempt == 1:
        run.checkpoint({"step": 3})
        raise RuntimeError("crash after step 3")
    return {"resumed_from": start, "attempt": run.attempt}


@task(priority=0)
def add(a: int, b: int) -> int:
    return a + b


@task(takes_context=True)
def context_info(context: Any, label: str) -> dict[str, Any]:
    context.checkpoint({"label": label})
    return {"attempt": context.attempt, "token": context.token, "label": label, "progress": context.progress}


@task()
async def async_double(n: int) -> int:
    return n * 2


@task()
def explode() -> None:
    raise KeyError("boom")
