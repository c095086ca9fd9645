"""Application code and handlers for the test helpers' tests (tests/db/test_testing_helpers.py and
the user-style tests): a "view" that enqueues, handlers that write, fail, enqueue more or themselves."""

from __future__ import annotations

from typing import Any

from django.db import IntegrityError

from tasks.compat import task
from tasks.models import Task
from tasks.runtime import current_task
from tests.testapp.models import Effect, Once

PATH = "tests.testapp.testing_handlers."


def _effect(phase: str) -> None:
    run = current_task()
    Effect.objects.create(task_id=run.id, token=run.token, attempt=run.attempt, phase=phase, pid=0)


@task()
def send_welcome(email: str, *, lang: str = "en") -> str:
    """A django.tasks Task, as an application declares one."""
    Once.objects.create(key=f"welcome:{email}", value={"lang": lang})
    return f"sent to {email}"


def sign_up(email: str, *, send: bool = True) -> None:
    """What a view does: its own write, then the task (through the django.tasks backend)."""
    Once.objects.create(key=f"user:{email}")
    if send:
        send_welcome.enqueue(email, lang="fr")


def record(label: str) -> str:
    _effect(label[:20])
    return label


def fail_always(label: str = "") -> None:
    _effect("failed")
    raise ValueError(f"fails on purpose {label}".strip())


def write_then_break(key: str) -> None:
    """Writes a row, then makes a statement fail (a duplicate key): the test's transaction must survive."""
    Once.objects.create(key=key)
    Once.objects.create(key=key)
    raise AssertionError("unreachable: the second insert raises IntegrityError")


def catch_integrity_error(key: str) -> str:
    """Breaks a statement inside its own atomic block and goes on (the usual Django idiom)."""
    from django.db import transaction

    Once.objects.create(key=key)
    try:
        with transaction.atomic():
            Once.objects.create(key=key)
    except IntegrityError:
        return "duplicate caught"
    return "no duplicate?"


def fan_out(n: int) -> list[int]:
    """Enqueues ``n`` children (they run after it, never inside it)."""
    return [Task.objects.enqueue(PATH + "record", args=[f"child {i}"]).id for i in range(n)]


def forever(n: int = 0) -> int:
    """Enqueues itself again: only a limit stops it."""
    Task.objects.enqueue(PATH + "forever", args=[n + 1])
    return n


def checkpointing() -> dict[str, Any]:
    run = current_task()
    if run.attempt == 1:
        assert run.checkpoint({"step": 1}), "the checkpoint was refused"
        raise RuntimeError("first attempt fails after its checkpoint")
    return {"progress": run.progress, "attempt": run.attempt}


async def async_record(label: str) -> str:
    from asgiref.sync import sync_to_async

    run = current_task()
    await sync_to_async(Effect.objects.create)(task_id=run.id, token=run.token, attempt=run.attempt, phase=label, pid=0)
    assert await run.acheckpoint({"label": label})
    return label


def hop(queue: str) -> int:
    """Enqueues ``record`` into another queue (one the run may not have seen yet)."""
    return Task.objects.enqueue(PATH + "record", args=[f"hopped to {queue}"], queue=queue).id
