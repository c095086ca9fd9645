from __future__ import annotations

from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import CommandError, CommandParser

from tasks.maintenance.scheduler import Scheduler, schedule_status
from tasks.management.commands._common import (
    LongRunningCommand,
    configure_logging,
    database_alias,
    positive_float,
    stop_on_signals,
)


class Command(LongRunningCommand):
    help = (
        "Run the periodic-task scheduler (leader-elected: one instance enqueues, the others stand by). "
        "Workers run one in a thread unless --no-scheduler; run this where no worker runs."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--ttl", type=positive_float, help="scheduler lease TTL, seconds (SCHEDULER_TTL)")
        parser.add_argument("--instance-id", help="holder id of this instance (default host:pid:random)")
        parser.add_argument("--once", action="store_true", help="one round if no other scheduler leads, then exit")
        parser.add_argument(
            "--database",
            type=database_alias,
            default="default",
            help="run the schedules whose queue is routed to this database (its lease lives there)",
        )
        parser.add_argument("--list", dest="list_schedules", action="store_true", help="print the schedules, then exit")

    def handle(
        self,
        *,
        ttl: float | None,
        instance_id: str | None,
        once: bool,
        list_schedules: bool,
        database: str,
        verbosity: int,
        **options: Any,
    ) -> None:
        configure_logging(verbosity)
        try:
            scheduler = Scheduler(ttl=ttl, holder=instance_id, using=database)
        except ImproperlyConfigured as exc:
            raise CommandError(str(exc)) from None
        if list_schedules:
            for entry in schedule_status(scheduler.schedules, using=database):
                next_run = entry["next_run"].isoformat(timespec="seconds") if entry["next_run"] else "-"
                kind = (" [stored]" if entry["kind"] == "stored" else "") + (" (paused)" if entry["paused"] else "")
                self.stdout.write(
                    f"{entry['name']}: {entry['definition'].get('task')} {entry['every'] or '(not declared)'}{kind};"
                    f" next {next_run}; enqueued {entry['enqueued']}, skipped {entry['skipped']}"
                )
            return
        # Nothing declared is fine: schedules stored at runtime (admin, API) may come; until one is,
        # the scheduler looks for them without taking the lease.
        if once:
            led = scheduler.run_once()
            self.stdout.write("ran one round" if led else "another scheduler leads: nothing done")
            return
        with stop_on_signals(scheduler.stop):
            scheduler.run()
