from __future__ import annotations

import datetime as dt
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from tasks.maintenance.partitions import PartitionError, create_ahead, partitions, retire_before
from tasks.management.commands._common import database_alias
from tasks.management.commands.prune_tasks import duration


def days(value: str) -> int:
    number = int(value)
    if not 0 <= number <= 366:
        raise ValueError(value)
    return number


class Command(BaseCommand):
    help = (
        "The day partitions of tasks_finished (docs/explanation/finished-storage.md): list them with their"
        " sizes, create today's and the next --days days' ahead, or retire (detach concurrently, then drop)"
        " every day that ended more than --older-than ago. Nothing is deleted row by row."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("action", choices=["list", "create", "retire"])
        parser.add_argument("--days", type=days, default=3, help="create: days ahead of today, 0-366 (default 3)")
        parser.add_argument(
            "--older-than", type=duration, help='retire: the age past which a day goes, e.g. "30d" (required)'
        )
        parser.add_argument("--database", type=database_alias, default="default", help="the database alias")

    def handle(self, *, action: str, days: int, older_than: dt.timedelta | None, database: str, **options: Any) -> None:
        try:
            if action == "create":
                for name in create_ahead(days, using=database):
                    self.stdout.write(f"created {name}")
            elif action == "retire":
                if older_than is None:
                    raise CommandError("retire needs --older-than (e.g. --older-than 30d)")
                cutoff = dt.datetime.now(dt.timezone.utc) - older_than
                for name in retire_before(cutoff, using=database):
                    self.stdout.write(f"retired {name}")
        except PartitionError as exc:
            raise CommandError(str(exc)) from exc
        found = partitions(database)
        if not found:
            self.stdout.write("tasks_finished has no partition")
        for partition in found:
            rows = "not analyzed" if partition.rows < 0 else f"~{partition.rows:,} rows"
            pending = " (detach pending)" if partition.detach_pending else ""
            self.stdout.write(f"{partition.name}: {partition.bounds}; {rows}, {partition.bytes:,} bytes{pending}")
