"""The partitions of ``tasks_finished`` (issue 43; docs/explanation/finished-storage.md): one per final
status, each split into UTC days created ahead of the days they hold, listed with their sizes, retired
whole once past their status's retention age.

``tasks_finished`` is list-partitioned by status into ``tasks_finished_successful``, ``_failed`` and
``_cancelled`` (migration 0035), each range-partitioned by ``finished_at``: the day partition
``tasks_finished_successful_YYYYMMDD`` holds the successes whose ``finished_at`` falls in
``[day 00:00, next day 00:00)`` UTC. Each status is kept its own time (``RETENTION``), so a day of
successes goes after 7 days while the same day's failures stay 30, without a row deleted. There is
no default partition at either level: PostgreSQL cannot detach a partition ``CONCURRENTLY`` from a
table that has one, and a row of a day with no partition is refused rather than kept somewhere
retention cannot drop.

Retiring a day is ``ALTER TABLE ... DETACH PARTITION ... CONCURRENTLY`` (the table stays readable and
writable; the detach waits for the transactions that might still see the partition) and then ``DROP
TABLE`` of the detached table: no row is deleted, no dead tuple left, no vacuum needed. Both statements
run outside any transaction (``DETACH ... CONCURRENTLY`` refuses to run inside one). A detach
interrupted half-way (its session ended) leaves the partition marked pending; the next retirement
finishes it (``DETACH PARTITION ... FINALIZE``).

The recovery leader keeps the partitions (:class:`PartitionKeeper`): every ``PARTITION_CHECK_INTERVAL``
it creates the days up to ``FINISHED_DAYS_AHEAD`` ahead and retires the days past each status's
retention, on a thread of its own (a detach waits for old snapshots, which must not hold recovery up).
"""

from __future__ import annotations

import datetime as dt
import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from django.db import DEFAULT_DB_ALIAS, Error, connections, transaction

from leasing import LeaseAcquisitionError, LeaseLost, clock
from leasing.holder import LeaseHolder, lease
from tasks.conf import get_settings
from tasks.lifecycle.steps import forget_steps_ctes
from tasks.maintenance.retention import retention_policy
from tasks.models.finished import FINISHED_TABLE, STATUS_TABLES

logger = logging.getLogger("tasks.partitions")

TABLE = FINISHED_TABLE
# The day as YYYYMMDD, the year zero-padded. 5 to 7 digits: a day before the year 1000 as this module
# named it before it padded (strftime's %Y does not), read as that day: used, not made again, retired.
_NAME = re.compile(r"^tasks_finished_(successful|failed|cancelled)_(\d{1,4}?)(\d{2})(\d{2})$")
#: Seconds between the leader's checks of the partitions (a catalog read when nothing is due).
PARTITION_CHECK_INTERVAL = 60.0
#: At least tomorrow's partition (a leader missing at midnight must not stop the mover), at most a
#: year's: three statuses x days empty tables.
MAX_DAYS_AHEAD = 366
#: The longest a creation waits for its lock on a status table before it gives up until the next check.
CREATE_LOCK_TIMEOUT = "5s"
#: The lease a retirement holds (renewed while its detaches wait): two retirements of one day would
#: meet in DETACH ... FINALIZE, which holds the partition while it waits for older snapshots. A
#: transaction's lock cannot serialise them (the detach commits in between), nor can a session's
#: advisory lock behind a transaction pooler.
RETIREMENT_LEASE = "tasks:partitions:retire"

# Every partition of the status tables, with its bounds as PostgreSQL states them, its planner
# estimate of rows (reltuples: -1 before the first VACUUM/ANALYZE) and its size with indexes and TOAST.
# Catalog reads: the cost is the number of partitions, not of rows. No lock on a partition being
# detached: a DETACH ... FINALIZE holds it (ACCESS EXCLUSIVE) while it waits for every older snapshot,
# this statement's among them, so a read waiting for it would wait for itself ("deadlock detected",
# once the other snapshots end). So its size is not read (pg_total_relation_size locks), and bounds
# are deparsed with no relation (0: pg_get_expr locks the one named; a bound names no column).
PARTITIONS_SQL = """
SELECT parent.relname, c.relname, pg_get_expr(c.relpartbound, 0), c.reltuples::bigint,
       CASE WHEN NOT i.inhdetachpending THEN pg_total_relation_size(c.oid) END, i.inhdetachpending
FROM unnest(%(parents)s::text[]) AS p(name)
JOIN pg_class AS parent ON parent.oid = to_regclass(p.name)
JOIN pg_inherits AS i ON i.inhparent = parent.oid
JOIN pg_class AS c ON c.oid = i.inhrelid
"""


_ATTACHED_SQL = "SELECT EXISTS (SELECT FROM pg_inherits WHERE inhrelid = to_regclass(%s))"

# The steps and events of a retired day's tasks (issue 58), deleted before its table is dropped: a
# batch of the table's ids after the last one done, through its primary key (id leads it), and their
# rows through the steps' and events' unique indexes (forget_steps_ctes). Run on the detached table
# (it takes no new row: the mover cannot move into a day no longer attached), each batch its own
# statement; a retirement interrupted between batches or before its DROP leaves the table, and the
# next one (FINALIZE, or the drop of a detached table) does the day again from its first id.
# ``{table}``: the day's table, named by this module (_NAME), quoted by the caller.
FORGET_DAY_STEPS_SQL = f"""
WITH picked AS MATERIALIZED (
    SELECT d.id FROM "{{table}}" AS d WHERE d.id > %(after)s ORDER BY d.id LIMIT %(limit)s
), {forget_steps_ctes("picked")}
SELECT max(id), count(*) FROM picked
"""


class PartitionError(Exception):
    """A partition statement was refused (its message says why), or cannot run where it was asked."""


@dataclass(frozen=True)
class Partition:
    status: str
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


def partition_name(status: str, day: dt.date) -> str:
    # Not strftime's %Y: it does not pad a year before 1000, and that name would not read back as a day.
    return f"{STATUS_TABLES[status]}_{day.year:04d}{day.month:02d}{day.day:02d}"


def _day_of(name: str) -> dt.date | None:
    match = _NAME.match(name)
    if match is None:
        return None
    try:
        return dt.date(*(int(part) for part in match.group(2, 3, 4)))
    except ValueError:  # no such day (a table named so by hand): not one of ours
        return None


def _statuses(statuses: Iterable[str] | None) -> list[str]:
    chosen = list(STATUS_TABLES) if statuses is None else list(statuses)
    unknown = sorted(set(chosen) - set(STATUS_TABLES))
    if unknown:
        raise PartitionError(f"not a final status: {', '.join(unknown)} (known: {', '.join(STATUS_TABLES)})")
    return chosen


def partitions(using: str = DEFAULT_DB_ALIAS) -> list[Partition]:
    """The day partitions, by status (SUCCESSFUL, FAILED, CANCELLED) then oldest day first (names this
    module did not make last in their status)."""
    status_of = {table: status for status, table in STATUS_TABLES.items()}
    with connections[using].cursor() as cursor:
        cursor.execute(PARTITIONS_SQL, {"parents": list(STATUS_TABLES.values())})
        # A partition another session drops while this reads the catalog (a retirement, a scrape of
        # /metrics beside it) has no size any more: it is gone, not listed. One being detached is
        # listed without its bytes (PARTITIONS_SQL: its size is not read): retention's already.
        found = [
            Partition(status_of[parent], name, _day_of(name), bounds, int(rows), int(size or 0), bool(pending))
            for parent, name, bounds, rows, size, pending in cursor.fetchall()
            if size is not None or pending
        ]
    order = list(STATUS_TABLES)
    return sorted(found, key=lambda p: (order.index(p.status), p.day is None, p.day or dt.date.min, p.name))


def days_ahead_setting() -> int:
    """``FINISHED_DAYS_AHEAD``, checked: a PartitionError says what is wrong with it. ``manage.py``
    refuses to start on it (tasks.E122); a process that runs no system checks (a Celery worker running
    the cron-mode maintenance, code calling the keeper) learns it here, at each check, as a failure
    the keeper logs, rather than as a TypeError that would end the leader's partitions thread."""
    ahead = get_settings().FINISHED_DAYS_AHEAD
    if isinstance(ahead, bool) or not isinstance(ahead, int) or not 1 <= ahead <= MAX_DAYS_AHEAD:
        raise PartitionError(
            f"LEASING_TASKS['FINISHED_DAYS_AHEAD'] must be a whole number of days from 1 to {MAX_DAYS_AHEAD},"
            f" got {ahead!r}"
        )
    return ahead


def _today(now: dt.datetime | None) -> dt.date:
    return (now or dt.datetime.now(dt.timezone.utc)).astimezone(dt.timezone.utc).date()


def create_ahead(
    days: int, *, now: dt.datetime | None = None, statuses: Iterable[str] | None = None, using: str = DEFAULT_DB_ALIAS
) -> list[str]:
    """Make sure today's partition (UTC) and the next ``days`` days' exist for each final status
    (``statuses``: all three unless given); returns those created. Idempotent: a day that has its
    partition is left alone, and one another session creates meanwhile is not an error."""
    if days < 0:
        raise PartitionError(f"days ahead must be 0 or more, not {days}")
    chosen = _statuses(statuses)
    today = _today(now)
    have = {(p.status, p.day) for p in partitions(using)}
    created = []
    for status in chosen:
        for offset in range(days + 1):
            day = today + dt.timedelta(days=offset)
            if (status, day) in have:
                continue
            try:
                made = _create(status, day, using)
            except Error as exc:  # an overlapping partition someone made by hand, a lock not had in time
                raise PartitionError(f"could not create the {status} partition of {day}: {exc}") from exc
            if made:
                created.append(partition_name(status, day))
    return created


def create_day(status: str, day: dt.date, *, using: str = DEFAULT_DB_ALIAS) -> bool:
    """Make sure ``status``'s partition of ``day`` exists (any day: the mover's first batch of a day
    long past makes it); False: it did already."""
    _statuses([status])
    try:
        return _create(status, day, using)
    except Error as exc:
        raise PartitionError(f"could not create the {status} partition of {day}: {exc}") from exc


def _create(status: str, day: dt.date, using: str) -> bool:
    """A day's partition, made as a table of its own and then attached: ``CREATE TABLE ... PARTITION
    OF`` would take an ACCESS EXCLUSIVE lock on the status table, queueing every reader and writer of
    finished tasks behind any long read of it; ``ATTACH PARTITION`` takes SHARE UPDATE EXCLUSIVE,
    which conflicts with neither (its check of the new table's rows reads an empty table). Within
    ``CREATE_LOCK_TIMEOUT``: a lock not had by then is tried again at the next check (days are made
    ``FINISHED_DAYS_AHEAD`` ahead for that). False: another session had attached it meanwhile."""
    name, start = partition_name(status, day), day_start(day)
    with transaction.atomic(using=using), connections[using].cursor() as cursor:
        cursor.execute(f"SET LOCAL lock_timeout = '{CREATE_LOCK_TIMEOUT}'")
        # The lock ATTACH takes, taken first: two creators of one day (the keeper's thread and the
        # mover's batch on the leader, a cron-mode run) take turns, and the second sees the first's
        # table below; checked without it, both would CREATE and the second fail on the catalog.
        cursor.execute(f'LOCK TABLE "{STATUS_TABLES[status]}" IN SHARE UPDATE EXCLUSIVE MODE')
        cursor.execute("SELECT to_regclass(%s)", [name])
        if cursor.fetchone()[0] is not None:  # made meanwhile by another session (or left unattached)
            cursor.execute(_ATTACHED_SQL, [name])
            if cursor.fetchone()[0]:
                return False
        else:
            # Literals, not parameters: DDL takes none where a connection binds on the server.
            cursor.execute(f'CREATE TABLE "{name}" (LIKE "{TABLE}" INCLUDING DEFAULTS INCLUDING CONSTRAINTS)')
        cursor.execute(
            f'ALTER TABLE "{STATUS_TABLES[status]}" ATTACH PARTITION "{name}"'
            f" FOR VALUES FROM ('{start.isoformat()}') TO ('{(start + dt.timedelta(days=1)).isoformat()}')"
        )
    return True


def retire_before(
    cutoff: dt.datetime, *, statuses: Iterable[str] | None = None, using: str = DEFAULT_DB_ALIAS
) -> list[str]:
    """Detach (concurrently) and drop every day partition of ``statuses`` (all three unless given)
    whose day ended at or before ``cutoff``; returns their names. Runs outside any transaction; a
    partition this module did not name is never touched."""
    return retire({status: cutoff for status in _statuses(statuses)}, using=using)


def retire(cutoffs: Mapping[str, dt.datetime], *, using: str = DEFAULT_DB_ALIAS) -> list[str]:
    """Retire, per status, the days that ended at or before its cutoff (a status not named: none).

    One retirement at a time per database, under the lease ``RETIREMENT_LEASE``: one begun while
    another holds it (the leader's keeper and the command by hand, a new leader while the last
    term's detach still waits) retires nothing and returns ``[]``; the holder retires the days."""
    _statuses(cutoffs)
    if connections[using].in_atomic_block:
        raise PartitionError("partitions are retired outside a transaction (DETACH PARTITION ... CONCURRENTLY)")
    held = lease(RETIREMENT_LEASE, timeout=0, using=using)
    try:
        held.acquire()
    except LeaseAcquisitionError:
        logger.info("partitions: another retirement is under way; its days are left to it")
        return []
    try:
        return _retire(cutoffs, held, using)
    finally:
        held.release()


def _retire(cutoffs: Mapping[str, dt.datetime], held: LeaseHolder, using: str) -> list[str]:
    connection = connections[using]
    retired = []
    for partition in partitions(using):
        ends, cutoff = partition.ends, cutoffs.get(partition.status)
        # A detach left pending (a retirement interrupted half-way: a hand retirement cancelled, a
        # holder that died) is finished whatever the cutoffs: the partition takes no row meanwhile (the
        # mover could not move its day's tasks), and nothing else would ever finish it where the day
        # is kept longer than the interrupted retirement's cutoff said, or for ever.
        pending = partition.detach_pending and partition.day is not None
        if not pending and (ends is None or cutoff is None or ends > cutoff):
            continue
        try:
            held.check()  # a retirement whose lease ran out starts no detach: another may have begun
        except LeaseLost as exc:
            raise PartitionError(f"retirement stopped: {exc}") from None
        parent = STATUS_TABLES[partition.status]
        with connection.cursor() as cursor:
            # Pending: a detach interrupted half-way (the lease says no other retirement runs).
            how = "FINALIZE" if partition.detach_pending else "CONCURRENTLY"
            try:
                cursor.execute(f'ALTER TABLE "{parent}" DETACH PARTITION "{partition.name}" {how}')
            except Error as exc:
                # A detach begun outside this module's lease (by hand in psql, a retirement that
                # outlived its lease) may have detached it first: then it only needs dropping, if
                # that session has not yet.
                cursor.execute(_ATTACHED_SQL, [partition.name])
                if cursor.fetchone()[0]:
                    raise PartitionError(f"could not retire {partition.name}: {exc}") from exc
        _drop_detached(partition.name, held, using)
        retired.append(partition.name)
    for status, name in _detached(using):  # detached by a retirement whose DROP never ran
        day, cutoff = _day_of(name), cutoffs.get(status)
        if day is not None and cutoff is not None and day_start(day) + dt.timedelta(days=1) <= cutoff:
            _drop_detached(name, held, using)
            retired.append(name)
    return retired


def _drop_detached(name: str, held: LeaseHolder, using: str) -> None:
    """Drop a detached day's table, its tasks' steps and events first (FORGET_DAY_STEPS_SQL, a batch at
    a time: the work is the day's rows, never the whole steps table). A table dropped meanwhile by
    another session (a retirement that outlived its lease) is not an error."""
    batch = get_settings().RETENTION_BATCH_SIZE
    statement = FORGET_DAY_STEPS_SQL.format(table=name)
    after = 0
    with connections[using].cursor() as cursor:
        while True:
            try:
                cursor.execute(statement, {"after": after, "limit": batch})
            except Error:
                cursor.execute("SELECT to_regclass(%s) IS NOT NULL", [name])
                if cursor.fetchone()[0]:
                    raise
                return  # dropped by the other session, with what it held
            last, count = cursor.fetchone()
            if count < batch:
                break
            after = last
            try:
                held.check()  # each batch is done for good: the next retirement starts the day again
            except LeaseLost as exc:
                raise PartitionError(f"retirement stopped: {exc}") from None
        # IF EXISTS: another session's retirement of it may have dropped it meanwhile.
        cursor.execute(f'DROP TABLE IF EXISTS "{name}"')


# Tables named as this module names day partitions that are attached to nothing: a retirement that
# detached one and failed before its DROP.
_DETACHED_SQL = r"""
SELECT c.relname FROM pg_class AS c
WHERE c.relkind = 'r' AND c.relnamespace = current_schema()::regnamespace
  AND c.relname ~ '^tasks_finished_(successful|failed|cancelled)_[0-9]{5,8}$'
  AND NOT EXISTS (SELECT FROM pg_inherits AS i WHERE i.inhrelid = c.oid)
"""


def _detached(using: str) -> list[tuple[str, str]]:
    status_of = {table: status for status, table in STATUS_TABLES.items()}
    with connections[using].cursor() as cursor:
        cursor.execute(_DETACHED_SQL)
        return [(status_of[name.rsplit("_", 1)[0]], name) for (name,) in cursor.fetchall()]


def retention_cutoffs(
    policy: Mapping[str, dt.timedelta | None] | None, *, now: dt.datetime | None = None
) -> dict[str, dt.datetime]:
    """Each final status's cutoff under a retention policy (tasks/maintenance/retention.py,
    ``retention_policy``): a day goes once it ended longer ago than its status is kept. A status kept
    for ever (None), or no policy at all, retires nothing."""
    if policy is None:
        return {}
    moment = now or dt.datetime.now(dt.timezone.utc)
    return {status: moment - age for status in STATUS_TABLES if (age := policy.get(status)) is not None}


@dataclass(frozen=True)
class Horizon:
    """Where one status's partitions stand: how many, their bytes, the last day created and the
    oldest kept (None: none)."""

    status: str
    count: int
    bytes: int
    last_day: dt.date | None
    oldest_day: dt.date | None

    def days_ahead(self, today: dt.date) -> int | None:
        """Whole days from ``today`` (UTC) to the last day created: 0 when only today's exists,
        negative when even today's is missing; None when there is no day at all."""
        return None if self.last_day is None else (self.last_day - today).days


def horizons(found: Iterable[Partition]) -> list[Horizon]:
    """One Horizon per final status, in STATUS_TABLES order (partitions not named by this module are
    counted with their bytes, but not as days)."""
    listed = list(found)
    result = []
    for status in STATUS_TABLES:
        mine = [p for p in listed if p.status == status]
        days = [p.day for p in mine if p.day is not None and not p.detach_pending]
        result.append(
            Horizon(status, len(mine), sum(p.bytes for p in mine), max(days, default=None), min(days, default=None))
        )
    return result


@dataclass
class KeeperRound:
    created: list[str] = field(default_factory=list)
    retired: list[str] = field(default_factory=list)


class PartitionKeeper:
    """The leader's upkeep of the partitions: days created ``FINISHED_DAYS_AHEAD`` ahead, days past
    their status's retention retired, at most every ``interval`` seconds (``run_once(force=True)``:
    now). A failure (a lock it could not get, a detach cancelled) is logged and retried at the next
    check; the metrics (``tasks_finished_days_ahead``) and the alert say when creation falls behind."""

    def __init__(
        self, *, using: str = DEFAULT_DB_ALIAS, interval: float = PARTITION_CHECK_INTERVAL, retire: bool = True
    ) -> None:
        self.using = using
        self.interval = interval
        self.retire = retire  # False: create ahead only (retention off on this leader)
        self._due = 0.0

    def reset(self) -> None:
        self._due = 0.0

    def run_once(self, *, force: bool = False) -> KeeperRound | None:
        """One check, if due (or ``force``); None when it was not due."""
        if not force and clock.monotonic() < self._due:
            return None
        self._due = clock.monotonic() + self.interval
        done = KeeperRound()
        done.created = create_ahead(days_ahead_setting(), using=self.using)
        for name in done.created:
            logger.info("created partition %s", name)
        if self.retire:
            try:
                policy = retention_policy()
            except ValueError as exc:  # tasks.E102 at startup; here too for a process that runs no checks
                raise PartitionError(f"no retirement: {exc}") from None
            done.retired = retire(retention_cutoffs(policy), using=self.using)
        for name in done.retired:
            logger.info("retired partition %s", name)
        return done
