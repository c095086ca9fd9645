from __future__ import annotations

from typing import Any

from django.core.management.base import CommandParser

from tasks.maintenance.recovery import RecoveryController, recover_once
from tasks.management.commands._common import (
    LongRunningCommand,
    configure_logging,
    database_alias,
    positive_float,
    stop_on_signals,
)


class Command(LongRunningCommand):
    help = "Requeue tasks whose lease expired and repair impossible states (leader-elected loop, or --once)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--once", action="store_true", help="one round, without the recovery lease")
        parser.add_argument("--interval", type=positive_float, help="seconds between rounds")
        parser.add_argument(
            "--database", type=database_alias, default="default", help="the database to recover (its own lease)"
        )

    def handle(self, *, once: bool, interval: float | None, database: str, verbosity: int, **options: Any) -> None:
        configure_logging(verbosity)
        if once:
            report = recover_once(using=database)
            self.stdout.write(
                f"requeued {len(report.requeued)}, failed {len(report.failed)}, "
                f"orphans expired {len(report.orphans_expired)}, "
                f"stray leases released {len(report.stray_leases_released)}"
            )
            return
        controller = RecoveryController(interval=interval, using=database)
        with stop_on_signals(controller.stop):
            controller.run()
