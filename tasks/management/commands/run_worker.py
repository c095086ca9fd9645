from __future__ import annotations

import logging
import os
from typing import Any

from django.core.management.base import BaseCommand, CommandParser
from django.db import connections

from tasks.management.commands._common import (
    configure_logging,
    non_negative_float,
    positive_float,
    positive_int,
    queue_names,
)
from tasks.worker import Worker


class Command(BaseCommand):
    help = "Run a task worker: claim tasks under a lease, run them, heartbeat, finish."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--queues", type=queue_names, default=["default"], help="comma-separated queue names")
        parser.add_argument("--concurrency", type=positive_int, help="executor threads")
        parser.add_argument("--batch-size", type=positive_int, help="tasks claimed per statement at most")
        parser.add_argument("--ttl", type=positive_float, help="lease of a claimed task, seconds")
        parser.add_argument("--poll-interval", type=positive_float, help="fallback poll, seconds")
        parser.add_argument("--shutdown-grace", type=non_negative_float, help="seconds to let tasks finish")
        parser.add_argument("--recovery-interval", type=positive_float, help="seconds between recovery rounds")
        parser.add_argument("--no-recovery", action="store_true", help="do not run the recovery controller here")
        parser.add_argument("--no-scheduler", action="store_true", help="do not run the periodic-task scheduler here")
        parser.add_argument("--max-tasks", type=positive_int, help="exit after claiming this many tasks")
        parser.add_argument("--worker-id", help="default: host:pid:random")

    def handle(
        self,
        *,
        queues: list[str],
        concurrency: int | None,
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
        worker = Worker(
            queues=queues,
            concurrency=concurrency,
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
        # Past the grace period, the hand-back and a TTL's worth of retries, the process ends anyway.
        worker.hard_exit_after = worker.shutdown_grace + 2 * worker.ttl + 5
        worker.run()
        # Task code may have left non-daemon threads behind; they must not keep a stopped worker
        # alive. Everything of the worker's own is written and closed by now.
        connections.close_all()
        logging.shutdown()
        os._exit(0)
