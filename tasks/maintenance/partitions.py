"""The day partitions of ``tasks_finished`` (issue 43; docs/explanation/finished-storage.md): created
ahead of the days they hold, listed with their sizes, retired whole once past the retention age.

One partition per UTC day, ``tasks_finished_YYYYMMDD``, holding the rows whose ``finished_at`` falls
in ``[day 00:00, next day 00:00)`` UTC. There is no default partition: PostgreSQL cannot detach a
partition ``CONCURRENTLY`` from a table that has one, and a row of a day with no partition is refused
rather than kept somewhere retention cannot drop.

Retiring a day is ``ALTER TABLE ... DETACH PARTITION ... CONCURRENTLY`` (the parent stays readable
and writable; the detach waits for the transactions that might still see the partition) and then
``DROP TABLE`` of the detached table: no row is deleted, no dead tuple left, no vacuum needed. Both
statements run outside any transaction (``DETACH ... CONCURRENTLY`` refuses to run inside one). A
detach interrupted half-way (its session ended) leaves the partition marked pending; the next
retirement finishes it (``DETACH PARTITION ... FINALIZE``).
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass

from django.db import DEFAULT_DB_ALIAS, connections

TABLE = "tasks_finished"
_NAME = re.compile(r"^tasks_finished_(\d{8})$")

# Every partition of the table, with its bounds as PostgreSQL states them, its planner estimate of
# rows (reltuples: -1 before the first VACUUM/ANALYZE) and its size with indexes and TOAST.
PARTITIONS_SQL = """
SELECT c.relname, pg_get_expr(c.relpartbound, c.oid), c.reltuples::bigint, pg_total_relation_size(c.oid),
       i.inhdetachpending
FROM pg_inherits AS i JOIN pg_class AS c ON c.oid = i.inhrelid
WHERE i.inhparent = to_regclass(%(table)s)
ORDER BY c.relname
"""


class PartitionError(Exception):
    """A partition statement was refused (its message says why), or cannot run where it was asked."""


@dataclass(frozen=True)
class Partition:
    name: str
    day: dt.date | None  # None: a partition not named by this module (left alone)
    bounds: str
    rows: int  # the planner's estimate; -1 before the partition was first analyzed
    bytes: int
    detach_pending: bool

    @property
    def ends(self) -> dt.datetime | None:
        """The first instant past this partition's day (UTC)."""
        return None if self.day is None else day_start(self.day) + dt.timedelta(days=1)


def day_start(day: dt.date) -> dt.datetime:
    return dt.datetime(day.year, day.month, day.day, tzinfo=dt.timezone.utc)


def partition_name(day: dt.date) -> str:
    return f"{TABLE}_{day:%Y%m%d}"


def _day_of(name: str) -> dt.date | None:
    match = _NAME.match(name)
    return None if match is None else dt.datetime.strptime(match.group(1), "%Y%m%d").date()


def partitions(using: str = DEFAULT_DB_ALIAS) -> list[Partition]:
    """The table's partitions, oldest day first (names this module did not make last)."""
    with connections[using].cursor() as cursor:
        cursor.execute(PARTITIONS_SQL, {"table": TABLE})
        found = [
            Partition(name, _day_of(name), bounds, int(rows), int(size), bool(pending))
            for name, bounds, rows, size, pending in cursor.fetchall()
        ]
    return sorted(found, key=lambda p: (p.day is None, p.day or dt.date.min, p.name))


def _today(now: dt.datetime | None) -> dt.date:
    return (now or dt.datetime.now(dt.timezone.utc)).astimezone(dt.timezone.utc).date()


def create_ahead(days: int, *, now: dt.datetime | None = None, using: str = DEFAULT_DB_ALIAS) -> list[str]:
    """Make sure today's partition (UTC) and the next ``days`` days' exist; returns those created.
    Idempotent: a day that has its partition is left alone."""
    if days < 0:
        raise PartitionError(f"days ahead must be 0 or more, not {days}")
    today = _today(now)
    have = {p.day for p in partitions(using)}
    created = []
    with connections[using].cursor() as cursor:
        for offset in range(days + 1):
            day = today + dt.timedelta(days=offset)
            if day in have:
                continue
            start = day_start(day)
            try:
                # Literals, not parameters: DDL takes none where a connection binds on the server.
                cursor.execute(
                    f'CREATE TABLE IF NOT EXISTS "{partition_name(day)}" PARTITION OF "{TABLE}"'
                    f" FOR VALUES FROM ('{start.isoformat()}') TO ('{(start + dt.timedelta(days=1)).isoformat()}')"
                )
            except Exception as exc:  # an overlapping partition someone made by hand, a lock timeout
                raise PartitionError(f"could not create the partition of {day}: {exc}") from exc
            created.append(partition_name(day))
    return created


def retire_before(cutoff: dt.datetime, *, using: str = DEFAULT_DB_ALIAS) -> list[str]:
    """Detach (concurrently) and drop every day partition whose day ended at or before ``cutoff``;
    returns their names. Runs outside any transaction; a partition this module did not name is
    never touched."""
    connection = connections[using]
    if connection.in_atomic_block:
        raise PartitionError("partitions are retired outside a transaction (DETACH PARTITION ... CONCURRENTLY)")
    retired = []
    for partition in partitions(using):
        ends = partition.ends
        if ends is None or ends > cutoff:
            continue
        with connection.cursor() as cursor:
            how = "FINALIZE" if partition.detach_pending else "CONCURRENTLY"
            cursor.execute(f'ALTER TABLE "{TABLE}" DETACH PARTITION "{partition.name}" {how}')
            cursor.execute(f'DROP TABLE "{partition.name}"')
        retired.append(partition.name)
    return retired
