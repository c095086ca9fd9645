from __future__ import annotations

import datetime as dt
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from tasks.maintenance.partitions import (
    STATUS_TABLES,
    PartitionError,
    create_ahead,
    partitions,
    retention_cutoffs,
    retire,
)
from tasks.maintenance.retention import retention_policy
from tasks.management.commands._common import database_alias
from tasks.management.commands.prune_tasks import duration
from tasks.models import ArchiveProgress


def days(value: str) -> int:
    number = int(value)
    if not 0 <= number <= 366:
        raise ValueError(value)
    return number


def statuses(value: str) -> list[str]:
    chosen = [part.strip().upper() for part in value.split(",") if part.strip()]
    if not chosen or set(chosen) - set(STATUS_TABLES):
        raise ValueError(value)
    return chosen


class Command(BaseCommand):
    help = (
        "The partitions of tasks_finished, one per final status and UTC day (docs/explanation/finished-storage.md):"
        " list them with their sizes, create today's and the next --days days' ahead, or retire (detach"
        " concurrently, then drop) the days that ended longer ago than --older-than, or than RETENTION keeps"
        " each status. Nothing is deleted row by row. The recovery leader does the same on its own."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("action", choices=["list", "create", "retire"])
        parser.add_argument("--days", type=days, default=3, help="create: days ahead of today, 0-366 (default 3)")
        parser.add_argument(
            "--older-than",
            type=duration,
            help='retire: the age past which a day goes, e.g. "30d" (default: each status\'s RETENTION)',
        )
        parser.add_argument(
            "--status",
            type=statuses,
            default=list(STATUS_TABLES),
            help="create/retire: final statuses, comma-separated (default SUCCESSFUL,FAILED,CANCELLED)",
        )
        parser.add_argument("--database", type=database_alias, default="default", help="the database alias")

    def handle(
        self,
        *,
        action: str,
        days: int,
        older_than: dt.timedelta | None,
        status: list[str],
        database: str,
        **options: Any,
    ) -> None:
        try:
            if action == "create":
                for name in create_ahead(days, statuses=status, using=database):
                    self.stdout.write(f"created {name}")
            elif action == "retire":
                now = dt.datetime.now(dt.timezone.utc)
                if older_than is not None:
                    cutoffs = {s: now - older_than for s in status}
                else:
                    try:
                        policy = retention_policy()
                    except ValueError as exc:
                        raise CommandError(str(exc)) from exc
                    cutoffs = {s: c for s, c in retention_cutoffs(policy, now=now).items() if s in status}
                for name in retire(cutoffs, using=database):
                    self.stdout.write(f"retired {name}")
        except PartitionError as exc:
            raise CommandError(str(exc)) from exc
        found = partitions(database)
        if not found:
            self.stdout.write("tasks_finished has no day partition")
        for partition in found:
            rows = "not analyzed" if partition.rows < 0 else f"~{partition.rows:,} rows"
            pending = " (detach pending)" if partition.detach_pending else ""
            self.stdout.write(f"{partition.name}: {partition.bounds}; {rows}, {partition.bytes:,} bytes{pending}")
        for mark in ArchiveProgress.objects.using(database):
            until, noted = (
                f"{at.astimezone(dt.timezone.utc):%Y-%m-%d %H:%M:%S} UTC" for at in (mark.moved_until, mark.recorded_at)
            )
            self.stdout.write(f"the mover: {mark.status} moved up to {until} ({mark.moved:,} rows, noted {noted})")
