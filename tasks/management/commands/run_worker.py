from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from django.core.management.base import CommandError, CommandParser
from django.db import connections

from tasks.backends.placement import misrouted
from tasks.lifecycle.routing import queues_by_database
from tasks.management.commands._common import (
    LongRunningCommand,
    configure_logging,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    queue_names,
)
from tasks.worker import Worker, check_worker_name


def worker_name(value: str) -> str:
    try:
        return check_worker_name(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


class Command(LongRunningCommand):
    help = "Run a task worker: claim tasks under a lease, run them, heartbeat, finish."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--queues", type=queue_names, help="comma-separated queue names (default: default)")
        target = parser.add_mutually_exclusive_group()
        target.add_argument("--backend", help="serve this django.tasks LeaseBackend alias: its database and its QUEUES")
        target.add_argument(
            "--database",
            help="database alias to serve, only queues routed to it (default: the one the queues are routed to)",
        )
        parser.add_argument("--concurrency", type=positive_int, help="executor threads")
        parser.add_argument(
            "--async-concurrency",
            type=non_negative_int,
            help="async def handlers run at once on the event loop (0: on the threads instead)",
        )
        parser.add_argument("--batch-size", type=positive_int, help="tasks claimed per statement at most")
        parser.add_argument("--ttl", type=positive_float, help="lease of a claimed task, seconds")
        parser.add_argument("--poll-interval", type=positive_float, help="fallback poll, seconds")
        parser.add_argument("--shutdown-grace", type=non_negative_float, help="seconds to let tasks finish")
        parser.add_argument("--recovery-interval", type=positive_float, help="seconds between recovery rounds")
        parser.add_argument("--no-recovery", action="store_true", help="do not run the recovery controller here")
        parser.add_argument("--no-scheduler", action="store_true", help="do not run the periodic-task scheduler here")
        parser.add_argument("--max-tasks", type=positive_int, help="exit after claiming this many tasks")
        parser.add_argument(
            "--worker-id",
            type=worker_name,
            help="the worker's name (default host:pid); each start holds its leases under name:random",
        )

    def handle(
        self,
        *,
        queues: list[str] | None,
        backend: str | None,
        database: str | None,
        concurrency: int | None,
        async_concurrency: int | None,
        batch_size: int | None,
        ttl: float | None,
        poll_interval: float | None,
        shutdown_grace: float | None,
        recovery_interval: float | None,
        no_recovery: bool,
        no_scheduler: bool,
        max_tasks: int | None,
        worker_id: str | None,
        verbosity: int,
        **options: Any,
    ) -> None:
        configure_logging(verbosity)
        if database is not None and database not in connections:
            raise CommandError(f"--database: no database {database!r} in DATABASES")
        explicit = None
        if backend is not None:
            explicit, allowed = backend_target(backend)
            if queues is None:
                if not allowed:
                    raise CommandError(f"--backend {backend}: its QUEUES allows any name; say which with --queues")
                queues = allowed
            elif allowed and set(queues) - set(allowed):
                outside = ", ".join(sorted(set(queues) - set(allowed)))
                raise CommandError(f"--backend {backend}: not among its QUEUES: {outside} (use --database instead)")
        queues = queues or ["default"]
        using = explicit or served_database(queues, database)
        worker = Worker(
            queues=queues,
            using=using,
            concurrency=concurrency,
            async_concurrency=async_concurrency,
            batch_size=batch_size,
            ttl=ttl,
            poll_interval=poll_interval,
            shutdown_grace=shutdown_grace,
            recovery=not no_recovery,
            recovery_interval=recovery_interval,
            scheduler=not no_scheduler,
            max_tasks=max_tasks,
            worker_id=worker_id,
            hard_exit_after=None,
        )
        if self.main_program:
            # Past the grace period, the hand-back and a TTL's worth of retries, the process ends anyway.
            worker.hard_exit_after = worker.shutdown_grace + 2 * worker.ttl + 5
        try:
            worker.run()
        except BaseException:
            if not self.main_program:
                raise
            # The worker's own thread raised (a bug): what it held was handed back on its way out. Task
            # code may have left non-daemon threads behind, which would keep the interpreter (and a
            # worker that serves nothing) alive for ever: the process ends now, as a failure.
            logging.getLogger("tasks.worker").critical("worker %s failed; exiting", worker.id, exc_info=True)
            logging.shutdown()
            os._exit(1)
        connections.close_all()
        if self.main_program:
            # Task code may have left non-daemon threads behind; they must not keep a stopped worker
            # alive. Everything of the worker's own is written and closed by now. Called in-process
            # (call_command), the command returns instead: the caller's process is not ours to end.
            logging.shutdown()
            os._exit(0)


def served_database(queues: list[str], database: str | None) -> str:
    """The database a worker for ``queues`` serves: ``--database``, or the one they are routed to.
    A queue routed elsewhere is refused: its tasks are never in the database this worker reads."""
    homes = queues_by_database(queues)
    if database is None:
        if len(homes) > 1:
            spread = "; ".join(f"{alias}: {', '.join(names)}" for alias, names in homes.items())
            raise CommandError(f"--queues live in several databases ({spread}): run one worker per --database")
        return next(iter(homes))
    elsewhere = misrouted(queues, database)
    if elsewhere:
        listed = ", ".join(f"{queue} (routed to {alias})" for queue, alias in elsewhere.items())
        raise CommandError(f"--database {database}: these queues live in another database: {listed}")
    return database


def backend_target(alias: str) -> tuple[str | None, list[str]]:
    """The database (None: routed by queue) and the queues of a LeaseBackend alias."""
    from tasks.backends.backend import LeaseBackend
    from tasks.compat import InvalidTaskBackend, task_backends

    try:
        backend = task_backends[alias]
    except InvalidTaskBackend as exc:
        raise CommandError(f"--backend: {exc}") from None
    if not isinstance(backend, LeaseBackend):
        raise CommandError(f"--backend {alias}: {type(backend).__name__} is not a LeaseBackend; nothing to serve")
    if backend.using not in connections:
        raise CommandError(f"--backend {alias}: its database {backend.using!r} is not in DATABASES")
    return (backend.using if backend.explicit_database else None), sorted(backend.queues)
