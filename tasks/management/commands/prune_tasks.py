from __future__ import annotations

import argparse
import datetime as dt
import time
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from tasks.conf import get_settings
from tasks.maintenance.retention import (
    FINISHED_STATUSES,
    Batch,
    PruneCursor,
    count_prunable,
    parse_duration,
    prune,
    retention_policy,
)
from tasks.management.commands._common import configure_logging, database_alias, positive_int

EXTRAS = ("leases", "workers", "schedule-runs", "unique-keys", "bulk-operations")


def duration(value: str) -> dt.timedelta:
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def statuses(value: str) -> list[str]:
    names = [name.strip().upper() for name in value.split(",") if name.strip()]
    wrong = [name for name in names if name not in FINISHED_STATUSES]
    if wrong or not names:
        raise argparse.ArgumentTypeError(
            f"only finished tasks can be pruned: give {', '.join(FINISHED_STATUSES)} (not {', '.join(wrong) or 'none'})"
        )
    return names


def fraction(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
    if not 0 < number <= 1:
        raise argparse.ArgumentTypeError("give a fraction above 0 and at most 1")
    return number


def extras(value: str) -> list[str]:
    names = [name.strip().lower() for name in value.split(",") if name.strip()]
    wrong = [name for name in names if name not in EXTRAS]
    if wrong or not names:
        raise argparse.ArgumentTypeError(f"--include takes {', '.join(EXTRAS)}")
    return names


class Command(BaseCommand):
    help = (
        "Delete finished tasks older than --older-than (default: LEASING_TASKS['RETENTION'] per status), "
        "in small batches; never a READY or RUNNING task. --include also prunes ended leases, stopped "
        "workers, schedule runs, the windows of unique keys that passed and ended bulk operations."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--older-than", type=duration, help="age since finishing, e.g. 7d, 12h, 90m (default: RETENTION)"
        )
        parser.add_argument(
            "--status", type=statuses, help="comma-separated: SUCCESSFUL, FAILED, CANCELLED (default: all)"
        )
        parser.add_argument("--queue", help="only tasks of this queue")
        parser.add_argument("--include", type=extras, default=[], help=f"also prune: {', '.join(EXTRAS)}")
        parser.add_argument("--batch-size", type=positive_int, help="rows per statement (default RETENTION_BATCH_SIZE)")
        parser.add_argument(
            "--busy-fraction",
            type=fraction,
            help="share of the time spent deleting (default RETENTION_BUSY_FRACTION; 1: flat out)",
        )
        parser.add_argument("--database", type=database_alias, default="default", help="the database to prune")
        parser.add_argument("--dry-run", action="store_true", help="count what would be deleted; delete nothing")

    def handle(
        self,
        *,
        older_than: dt.timedelta | None,
        status: list[str] | None,
        queue: str | None,
        include: list[str],
        batch_size: int | None,
        busy_fraction: float | None,
        dry_run: bool,
        database: str,
        verbosity: int,
        **options: Any,
    ) -> None:
        configure_logging(verbosity)
        try:
            policy = retention_policy() or {}
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        kinds = [*(status or FINISHED_STATUSES), *(name.upper().replace("-", "_") for name in include)]
        ages: dict[str, dt.timedelta] = {}
        for kind in kinds:
            age = older_than if older_than is not None else policy.get(kind)
            if age is None:
                self.stdout.write(f"{kind.lower()}: kept forever (no --older-than, none in RETENTION)")
                continue
            ages[kind] = age
        if dry_run:
            for kind, age in ages.items():
                n = count_prunable(kind, age, queue=queue if kind in FINISHED_STATUSES else None, using=database)
                self.stdout.write(f"{kind.lower()}: would delete {n:,} (older than {age})")
            return
        started = time.monotonic()
        last_line = 0.0
        kind_started: dict[str, float] = {}

        def progress(batch: Batch, cursor: PruneCursor) -> None:
            nonlocal last_line
            now = time.monotonic()
            since = kind_started.setdefault(cursor.kind, now - batch.seconds)
            if cursor.done or now - last_line >= 1.0:
                last_line = now
                rate = cursor.deleted / max(now - since, 1e-6)
                oldest = cursor.after[0].isoformat(timespec="seconds") if cursor.deleted else "-"
                self.stdout.write(
                    f"{cursor.kind.lower()}: deleted {cursor.deleted:,} (up to {oldest}), {rate:,.0f} rows/s"
                    + (", done" if cursor.done else "")
                )

        busy = get_settings().RETENTION_BUSY_FRACTION if busy_fraction is None else busy_fraction

        def rest(batch: Batch) -> None:
            # Rest in proportion to the work: the workers sharing the database keep their pace.
            if busy < 1:
                time.sleep(batch.seconds * (1 / busy - 1))

        totals = prune(ages, batch_size=batch_size, queue=queue, using=database, on_batch=progress, pause=rest)
        summary = ", ".join(f"{kind.lower()} {n:,}" for kind, n in totals.items())
        self.stdout.write(f"pruned in {time.monotonic() - started:.1f}s: {summary or 'nothing'}")
