"""Handlers that decide their own outcome (issue 24): snooze, discard, cancel, retry policies."""

from __future__ import annotations

import os
import time
from typing import Any

from tasks.compat import task
from tasks.models import Task
from tasks.runtime import Cancel, Discard, Snooze, current_task, retry_policy


class Transient(Exception):
    """Retried by the policies below."""


class Permanent(Exception):
    """Not retried by the policies below."""


def _record_run() -> dict[str, Any]:
    """Append what the row says at this run's start (its snoozes so far, its wake time, this claim's
    grant time, on the database clock) to the task's progress, which survives snoozes."""
    run = current_task()
    row = Task.objects.values("snoozes", "run_after", "acquired_at", "snoozed_at", "attempts").get(pk=run.id)
    progress = dict(run.progress or {"runs": []})
    progress["runs"] = [
        *progress["runs"],
        {key: value.isoformat() if hasattr(value, "isoformat") else value for key, value in row.items()},
    ]
    assert run.checkpoint(progress)
    return row


def snooze_times(times: int, seconds: float, **kwargs: Any) -> int:
    """Snooze ``times`` times for ``seconds`` each, then succeed with the number of runs."""
    row = _record_run()
    if row["snoozes"] < times:
        raise Snooze(seconds)
    return int(row["snoozes"]) + 1


def discard_now(**kwargs: Any) -> None:
    raise Discard("the input can never work")


def cancel_with(reason: str, **kwargs: Any) -> None:
    raise Cancel(reason)


def raise_in_turn(kinds: list[str], **kwargs: Any) -> str:
    """Attempt n raises ``kinds[n-1]`` (Transient, Permanent, ValueError); past the list, succeeds."""
    attempt = current_task().attempt
    if attempt <= len(kinds):
        raise {"Transient": Transient, "Permanent": Permanent, "ValueError": ValueError}[kinds[attempt - 1]](
            f"attempt {attempt}"
        )
    return f"succeeded on attempt {attempt}"


def ten_seconds_per_attempt(attempt: int, exc: BaseException) -> float:
    return 10.0 * attempt


@retry_policy(retry_on=[Transient], max_attempts=4)
def picky(kinds: list[str], **kwargs: Any) -> str:
    return raise_in_turn(kinds)


@retry_policy(max_attempts=2, backoff=lambda attempt, exc: 0.01)
def always_fails(**kwargs: Any) -> None:
    raise Transient("again")


@retry_policy(backoff=lambda attempt, exc: 1000.0 + attempt)
def slow_backoff(**kwargs: Any) -> None:
    raise Transient("later")


@retry_policy(backoff=lambda attempt, exc: 1 / 0)
def broken_backoff(**kwargs: Any) -> None:
    raise Transient("the backoff itself fails")


# -- django.tasks Tasks ---------------------------------------------------------------------------


@task()
def dj_snooze(times: int, seconds: float) -> int:
    return snooze_times(times, seconds)


@task()
def dj_cancel(reason: str) -> None:
    raise Cancel(reason)


@task()
def dj_discard() -> None:
    raise Discard("no use trying again")


@task()
@retry_policy(retry_on=[Transient], max_attempts=3, backoff=lambda attempt, exc: 0.01)
def dj_picky(kinds: list[str]) -> str:
    return raise_in_turn(kinds)


# -- for the worker-process tests -----------------------------------------------------------------


def snooze_then_finish(seconds: float, **kwargs: Any) -> dict[str, Any]:
    """The first run snoozes for ``seconds``; the next returns. Each run records an effect."""
    from tests.testapp.handlers import _effect

    _effect("started")
    if Task.objects.get(pk=current_task().id).snoozes == 0:
        raise Snooze(seconds)
    return {"token": current_task().token}


def gated_outcome(gate: str, outcome: str, **kwargs: Any) -> str:
    """The first run (no earlier effect) waits for ``gate``, then snoozes, cancels or discards;
    any later run returns at once."""
    from tests.testapp.handlers import _effect, _wait_for_gate
    from tests.testapp.models import Effect

    first = not Effect.objects.filter(task_id=current_task().id).exists()
    _effect("started")
    if first:
        _wait_for_gate(gate)
        if outcome == "snooze":
            raise Snooze(60)
        if outcome == "cancel":
            raise Cancel("too late")
        raise Discard("too late")
    return "ran again"


async def async_outcome(outcome: str, **kwargs: Any) -> str:
    """An ``async def`` handler (run on the worker's event loop) deciding its outcome."""
    from asgiref.sync import sync_to_async

    snoozes = await sync_to_async(lambda: Task.objects.get(pk=current_task().id).snoozes, thread_sensitive=False)()
    if outcome == "snooze" and snoozes == 0:
        raise Snooze(0.2)
    if outcome == "cancel":
        raise Cancel("async cancel")
    if outcome == "transient":
        raise Transient("async")
    return f"woke after {snoozes} snooze(s)"


def quick_backoff(attempt: int, exc: BaseException) -> float:
    """A retry due a fifth of a second later: it comes back behind a claimer's positions."""
    return 0.2


def fair_mix(mode: str, **kwargs: Any) -> str:
    """One effect row per execution (its phase: what it did). ``retry``: the first attempt raises
    (retried after quick_backoff); ``snooze``: the first run snoozes 0.2 s; ``plain``: succeeds."""
    from tests.testapp.models import Effect

    run = current_task()
    if kwargs.get("seconds"):
        time.sleep(kwargs["seconds"])  # simulated work, not a wait: a kill may land here, before any effect
    first = not Effect.objects.filter(task_id=run.id).exists()
    phase = "done"
    if first and mode == "retry":
        phase = "failed"
    elif first and mode == "snooze":
        phase = "snoozed"
    Effect.objects.create(task_id=run.id, token=run.token, attempt=run.attempt, phase=phase, pid=os.getpid())
    if phase == "failed":
        raise Transient(f"attempt {run.attempt} fails on purpose")
    if phase == "snoozed":
        raise Snooze(0.2)
    return mode
