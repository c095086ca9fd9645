from __future__ import annotations

import signal
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from tasks.management.commands._common import configure_logging, positive_float
from tasks.recovery import RecoveryController, recover_once


class Command(BaseCommand):
    help = "Requeue tasks whose lease expired and repair impossible states (leader-elected loop, or --once)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--once", action="store_true", help="one round, without the recovery lease")
        parser.add_argument("--interval", type=positive_float, help="seconds between rounds")

    def handle(self, *, once: bool, interval: float | None, verbosity: int, **options: Any) -> None:
        configure_logging(verbosity)
        if once:
            report = recover_once()
            self.stdout.write(
                f"requeued {len(report.requeued)}, failed {len(report.failed)}, "
                f"orphans expired {len(report.orphans_expired)}, "
                f"stray leases released {len(report.stray_leases_released)}"
            )
            return
        controller = RecoveryController(interval=interval)
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: controller.stop())
        controller.run()
