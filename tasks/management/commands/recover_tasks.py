from __future__ import annotations

from typing import Any

from django.core.management.base import CommandError, CommandParser

from tasks.maintenance.recovery import ONCE_BUDGET, RecoveryController, maintain_once
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
        parser.add_argument(
            "--once",
            action="store_true",
            help="one round of every duty of the recovery leader (recovery and its repairs, bulk operations,"
            " history, retention, the mover, keyless adoption, partitions), without the recovery lease: for a"
            " cron line; a duty that fails does not stop the others, and the command then exits with status 1",
        )
        parser.add_argument(
            "--budget",
            type=positive_float,
            default=ONCE_BUDGET,
            help=f"with --once: seconds shared by the duties after recovery (default {ONCE_BUDGET:g})",
        )
        parser.add_argument("--interval", type=positive_float, help="seconds between rounds")
        parser.add_argument(
            "--database", type=database_alias, default="default", help="the database to recover (its own lease)"
        )

    def handle(
        self, *, once: bool, budget: float, interval: float | None, database: str, verbosity: int, **options: Any
    ) -> None:
        configure_logging(verbosity)
        if once:
            done = maintain_once(using=database, budget=budget)
            report = done.recovery
            self.stdout.write(
                f"requeued {len(report.requeued)}, failed {len(report.failed)}, "
                f"orphans expired {len(report.orphans_expired)}, "
                f"stray leases released {len(report.stray_leases_released)}, "
                f"repaired {len(report.repairs.dependants) + len(report.repairs.workflows)}; "
                f"bulk operations changed {done.bulk_changed} tasks, "
                f"history hours counted {len(done.history.counted) if done.history else 0}, "
                f"pruned {done.pruned}, archived {done.archived}, keyless rows adopted {done.keyless_adopted}"
            )
            if done.errors:
                # the other duties ran; a cron line's exit status tells its owner one did not
                raise CommandError("failed: " + "; ".join(done.errors))
            return
        controller = RecoveryController(interval=interval, using=database)
        with stop_on_signals(controller.stop):
            controller.run()
