#!/usr/bin/env python
"""django-absurd's side of bench/peer_zombie.py: the schema, the enqueue, or a worker.

    python bench/peer_zombie_absurd.py migrate DATABASE_URL --log-dir DIR
    python bench/peer_zombie_absurd.py enqueue DATABASE_URL --workflows 200 --backlog 8 --seed 1 --log-dir DIR
    python bench/peer_zombie_absurd.py worker DATABASE_URL --name a1 --claim-timeout 2 --log-dir DIR

Run by bench/peer_zombie.py under the separate environment of bench/requirements.txt (``pip install
django-absurd``, which brings ``absurd-sdk``); not imported by the project. A plain script with
minimal Django settings (``django_absurd`` installed, its ``AbsurdBackend`` as the ``django.tasks``
backend): ``migrate`` installs Absurd's schema and provisions the queue, ``enqueue`` calls
``stepped.enqueue(...)``, keeping at most ``--backlog`` runs pending (0: all at once), and a worker
is ``manage.py absurd_worker`` (``call_command``).

A task ``stepped`` of K steps, each ``get_absurd_context().step(f"part-{n}", fn)`` (django-absurd's
documented way, "Wrap work in steps and a retry resumes instead of redoing") where ``fn`` writes an
effect row through Django's connection (autocommit, as ``Model.objects.create`` would), sleeps, then
calls the counting "external service" (a line appended to a file) with the key
``<task id>-part-<n>``. A step longer than half the claim timeout heartbeats every 0.5 s
(``context.heartbeat()``, what Absurd offers a long step), so only a pause or a kill lets a claim
expire. Each execution logs ``begin``/``call``/``end`` lines (bench/peer_zombie.py counts them).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
import uuid
from pathlib import Path
from typing import Any

# Run as a script, bench/ would come first on sys.path and bench/tasks.py would shadow the project's
# ``tasks`` package, whose compat module is the one place that imports Django's task framework.
sys.path[0] = str(Path(__file__).resolve().parents[1])

_log_fd: int | None = None


def log(*fields: object) -> None:
    """One line per event, appended to this process's file in one write (survives SIGKILL)."""
    assert _log_fd is not None
    os.write(_log_fd, (" ".join(str(f) for f in (*fields, os.getpid(), f"{time.time():.6f}")) + "\n").encode())


def stepped(wf: int, steps: int, slow: float, sleep: list[float]) -> int:
    """The task (rebound to a ``django.tasks`` Task by ``setup``, so that django-absurd's worker finds it
    at ``__main__.stepped``)."""
    from django.db import connection
    from django_absurd import get_absurd_context

    context = get_absurd_context()
    task_id = context.absurd_ctx.task_id
    exec_id = uuid.uuid4().hex[:12]  # this run of the task (the first, or a retry's)
    log("begin", wf, exec_id)

    def part(n: int, seconds: float) -> int:
        with connection.cursor() as cursor:
            cursor.execute(
                "INSERT INTO peer_effect (wf, step, exec, pid) VALUES (%s, %s, %s, %s)", (wf, n, exec_id, os.getpid())
            )
        # A kill or a pause lands inside the step (its write made) as often as between steps.
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            time.sleep(min(left, 0.5))
            if seconds > 1.0 and left > 0.5:
                context.heartbeat()
        log("call", f"{task_id}-part-{n}", wf, n, exec_id)
        return n

    for n in range(steps):
        seconds = slow if n == 1 and slow else random.uniform(*sleep)
        context.step(f"part-{n}", lambda n=n, seconds=seconds: part(n, seconds))
    log("end", wf, exec_id)
    return steps


def setup(url: str) -> None:
    import django
    import environ
    from django.conf import settings

    settings.configure(
        INSTALLED_APPS=["django_absurd"],
        DATABASES={"default": environ.Env.db_url_config(url)},
        TASKS={
            "default": {
                "BACKEND": "django_absurd.backends.AbsurdBackend",
                "OPTIONS": {"DEFAULT_MAX_ATTEMPTS": 100},
            }
        },
        USE_TZ=True,
    )
    django.setup()
    from tasks.compat import task

    global stepped
    stepped = task(stepped)  # type: ignore[assignment]


def main() -> int:
    global _log_fd
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["migrate", "enqueue", "worker"])
    parser.add_argument("url")
    parser.add_argument("--name", default="a0")
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--claim-timeout", type=int, default=2)
    parser.add_argument("--log-dir", required=True)
    parser.add_argument("--workflows", type=int, default=200)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--sleep", type=float, nargs=2, default=[0.1, 0.5])
    parser.add_argument("--backlog", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
    _log_fd = os.open(Path(args.log_dir) / f"events-{os.getpid()}.txt", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    setup(args.url)
    from django.core.management import call_command

    if args.command == "migrate":
        call_command("migrate", verbosity=0)
    elif args.command == "enqueue":
        from django.db import connection

        rng = random.Random(args.seed)
        task: Any = stepped
        i = 0
        while i < args.workflows:
            room = args.workflows - i
            if args.backlog:
                with connection.cursor() as cursor:
                    cursor.execute("SELECT count(*) FROM absurd.r_default WHERE state = 'pending'")
                    room = min(room, args.backlog - cursor.fetchone()[0])
            for _ in range(max(room, 0)):
                # One task in ten has a slow second step (1-4 s, about the pause), as ours.
                slow = rng.uniform(1, 4) if i % 10 == 0 else 0.0
                task.enqueue(wf=i, steps=args.steps, slow=slow, sleep=args.sleep)
                i += 1
            if room <= 0:
                time.sleep(0.05)
        print("enqueued", flush=True)
    else:
        call_command(
            "absurd_worker", queue="default", concurrency=args.concurrency, claim_timeout=args.claim_timeout,
            poll_interval=0.25, worker_id=args.name,
        )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
