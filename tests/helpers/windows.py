"""Enqueue under a window (unique_for, debounce) or claim, from a process of its own, released
together with the others by a barrier in the database.

Run by tests/concurrency/test_unique_windows.py as ``tests.helpers.child windows ROLE NAME``. The
child prints ``{"ready": true}``, then for each JSON line it reads (a *round*: ``{"keys": [...],
"calls": n, ...}``) it waits at the barrier (a shared advisory lock the test holds exclusively and
lets go of once every child waits on it), runs the round and prints ``{"results": [...]}``. A line
``{"stop": true}`` ends it.

Roles:

- ``unique``: ``calls`` enqueues per key with ``unique_for``; each result is (key, id, created).
- ``unique-hammer``: enqueues of random keys with ``unique_for`` for ``seconds``; an accepted one
  records its window's start (read in its own transaction, under the key row's lock, so it is its
  own) and is cancelled at once, so that only the window, not an unfinished task, refuses the next.
- ``debounce``: ``calls`` enqueues per key with ``debounce`` / ``max_wait``, each with its own value.
- ``debounce-hammer``: enqueues of one key with a tiny ``debounce`` (and ``max_wait``) for ``seconds``,
  each with its own value; each result is (id, created, value).
- ``claimer``: claims from the round's queue for ``seconds``; each result is (id, token, kwargs).
"""

from __future__ import annotations

import random
import sys
import time
from typing import Any

from django.db import connection, transaction

BARRIER = 724_019  # the advisory lock key the test holds while the children gather


def barrier() -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_lock_shared(%s)", [BARRIER])
        cursor.execute("SELECT pg_advisory_unlock_shared(%s)", [BARRIER])


def run_round(role: str, name: str, spec: dict[str, Any], rng: random.Random) -> list[Any]:
    from tasks.models import Task

    results: list[Any] = []
    queue = spec.get("queue", "windows")
    if role == "unique":
        for i in range(spec["calls"]):
            for key in spec["keys"]:
                got = Task.objects.enqueue(
                    "tests.testapp.handlers.noop",
                    kwargs={"by": name, "i": i},
                    queue=queue,
                    dedup_key=key,
                    unique_for=spec["unique_for"],
                )
                results.append([key, got.id, got.created])
    elif role == "unique-hammer":
        end = time.monotonic() + spec["seconds"]
        while time.monotonic() < end:
            key = rng.choice(spec["keys"])
            with transaction.atomic():
                got = Task.objects.enqueue(
                    "tests.testapp.handlers.noop", queue=queue, dedup_key=key, unique_for=spec["unique_for"]
                )
                accepted_at = None
                if got.created:
                    with connection.cursor() as cursor:
                        cursor.execute("SELECT accepted_at FROM tasks_uniquekey WHERE key = %s", [key])
                        accepted_at = cursor.fetchone()[0].isoformat()
                    Task.objects.filter(pk=got.id).cancel()
            results.append([key, got.id, got.created, accepted_at])
    elif role == "debounce":
        for i in range(spec["calls"]):
            for key in spec["keys"]:
                value = f"{name}-{i}"
                got = Task.objects.enqueue(
                    "tests.testapp.handlers.noop",
                    kwargs={"v": value},
                    queue=queue,
                    dedup_key=key,
                    debounce=spec["debounce"],
                    max_wait=spec.get("max_wait"),
                )
                results.append([key, got.id, got.created, value])
    elif role == "debounce-hammer":
        end = time.monotonic() + spec["seconds"]
        i = 0
        while time.monotonic() < end:
            value = f"{name}-{i}"
            i += 1
            got = Task.objects.enqueue(
                "tests.testapp.handlers.noop",
                kwargs={"v": value},
                queue=queue,
                dedup_key=spec["keys"][0],
                debounce=spec["debounce"],
                max_wait=spec.get("max_wait"),
            )
            results.append([got.id, got.created, value])
    elif role == "claimer":
        end = time.monotonic() + spec["seconds"]
        while time.monotonic() < end:
            for claimed in Task.objects.claim(name, queues=[queue], limit=1, ttl=600):
                results.append([claimed.id, claimed.token, claimed.kwargs])
    else:
        raise SystemExit(f"unknown role {role!r}")
    return results


def main(argv: list[str]) -> int:
    import json

    from tests.helpers import emit

    role, name = argv[0], argv[1]
    rng = random.Random(name)
    emit(ready=True)
    for line in sys.stdin:
        spec = json.loads(line)
        if spec.get("stop"):
            break
        barrier()
        emit(results=run_round(role, name, spec, rng))
    connection.close()
    return 0
