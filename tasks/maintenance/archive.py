"""The mover: finished tasks leave the hot table ``tasks_task`` for ``tasks_finished`` (issue 43;
docs/explanation/finished-storage.md), where retention drops them a day at a time.

On by default (``LEASING_TASKS["ARCHIVE_AFTER"]``, a duration, "10m"; None turns it off): lookups by
id (tasks/models/finished.py), the lists and counts of the dashboard, the admin and the JSON API
(tasks/web/listings.py, tasks/web/queries.py), the rerun and the bulk retry read or bring back both tables.

What it moves, per final status, oldest first: plain tasks (``workflow_id IS NULL``; a workflow's
members stay with their workflow, which retention prunes as one unit, tasks/lifecycle/workflows.py)
that finished more than ``ARCHIVE_AFTER`` ago **and** whose hour the history rollup has counted, at
least ``COUNTED_MARGIN`` ago (tasks/maintenance/history.py: an hour is counted from the rows in
``tasks_task`` once, five minutes after it ends; a row moved before would be missing from it; so
a finished task stays in ``tasks_task`` until ten minutes after its hour ends, 10 to 70 minutes
(``HISTORY_WAIT`` at most), whatever ARCHIVE_AFTER says), and that
are not in a day already past their status's retention (retention retires days whole; the prune
deletes those in place). The first day a pass reads is the oldest its status still keeps, from its
start: rows of that day older than the cutoff move too and go with their day, up to a day later than
the prune would have deleted them; a row the prune and the mover both want is taken by one of them
(both pick with SKIP LOCKED and re-check on the newest version).

How, one statement a batch (``ARCHIVE_SQL``): retention's pick (``FOR UPDATE SKIP LOCKED`` over one
status's range of ``tasks_task_prune_idx``, resumed from the last key moved) feeding ``DELETE ...
RETURNING *`` into ``INSERT INTO tasks_finished``. Its guarantees are the prune's: a row another
session holds (an operator's requeue, a worker's late compare-and-set) is passed over, never waited
for; the row lock re-checks status and finish time on the row's newest version, so a task requeued
under the pick stays; the row leaves ``tasks_task`` and enters ``tasks_finished`` in one transaction,
or neither. A statement waiting on a moved row sees it deleted, as a pruned one. Each batch stays
within one UTC day, whose partition it creates first when missing (an upgrade moves days long past).
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from django.db import DEFAULT_DB_ALIAS, IntegrityError, connections

from leasing.bounds import without_jit
from tasks.conf import DEFAULT_ARCHIVE_BUSY_FRACTION, get_settings
from tasks.maintenance.history import COUNTED_MARGIN, FINAL_AFTER
from tasks.maintenance.partitions import STATUS_TABLES, PartitionError, create_day, day_start, partitions
from tasks.maintenance.retention import parse_duration, retention_policy

logger = logging.getLogger("tasks.archive")

_BEGINNING = dt.datetime(1, 1, 1, tzinfo=dt.timezone.utc)
#: The longest a finished task waits for its hour's count to stand before it may move: an hour is
#: counted FINAL_AFTER after it ends, the count stands COUNTED_MARGIN later; a task finished as its
#: hour began waits that long, one finished as it ended ten minutes. ``tasks_archive_behind_seconds``
#: counts from the later of this and ARCHIVE_AFTER.
HISTORY_WAIT = dt.timedelta(hours=1, seconds=FINAL_AFTER + COUNTED_MARGIN)
#: Seconds between the mover's full passes (from the oldest day kept; the others resume).
FULL_PASS_INTERVAL = 3600.0
#: Seconds the leader's mover thread works at a time while a pass is in progress (it then rests
#: so that it works ``ARCHIVE_BUSY_FRACTION`` of the time), and the longest it sleeps between
#: checks that a pass is due.
MOVER_SLICE = 1.0


# Where a pass may move up to: ARCHIVE_AFTER back from now, and no later than the oldest hour of the
# history window not counted COUNTED_MARGIN ago (the open hour at the latest): from then on a count of
# that hour stands (history.py, COUNT_HOUR_SQL), so moving its tasks cannot take them out of it. One
# statement: the clock read once, HISTORY_HOURS primary-key probes of the marks at most.
LIMITS_SQL = """
SELECT statement_timestamp(),
       LEAST(statement_timestamp() - make_interval(secs => %(after)s),
             (SELECT min(h.hour)
              FROM generate_series(date_trunc('hour', statement_timestamp()) - make_interval(hours => %(hours)s),
                                   date_trunc('hour', statement_timestamp()), interval '1 hour') AS h(hour)
              WHERE NOT EXISTS (SELECT 1 FROM tasks_activityhourmark AS m WHERE m.hour = h.hour
                                AND m.counted_at < statement_timestamp() - make_interval(secs => %(margin)s))))
"""

# The next task a batch would move (its finish time says which day's partition the batch needs).
NEXT_SQL = """
SELECT finished_at FROM tasks_task
WHERE status = %(status)s AND finished_at IS NOT NULL AND workflow_id IS NULL
  AND finished_at >= %(since)s::timestamptz AND finished_at < %(until)s::timestamptz
  AND (finished_at, id) > (%(after_at)s, %(after_id)s)
ORDER BY finished_at, id
LIMIT 1
"""

# The mover's progress for one status (tasks_archiveprogress): every plain task of it that finished
# before ``moved_until`` has moved (but rows another session held). Never backwards: a full pass, from
# the oldest day kept, leaves the mark where the last pass put it until it passes it. A primary-key
# upsert: in each batch's statement (its last row's finish time) and at a pass's end (its limit).
_PROGRESS_UPSERT = """ON CONFLICT (status) DO UPDATE
    SET moved_until = GREATEST(tasks_archiveprogress.moved_until, EXCLUDED.moved_until),
        recorded_at = EXCLUDED.recorded_at, moved = tasks_archiveprogress.moved + EXCLUDED.moved"""
# A pass's end: the mark moved up to its limit (never back), with no rows counted.
PROGRESS_SQL = f"""
INSERT INTO tasks_archiveprogress (status, moved_until, recorded_at, moved)
VALUES (%(status)s, %(until)s, statement_timestamp(), 0)
{_PROGRESS_UPSERT}
"""

# One batch: picked as retention picks (MATERIALIZED: the pick runs once, tasks/lifecycle/claim.py
# says why), deleted, inserted, its progress noted; returns the keys moved. ``until`` ends the batch
# at its day's end.
ARCHIVE_SQL = f"""
WITH picked AS MATERIALIZED (
    SELECT id FROM tasks_task AS candidate
    WHERE status = %(status)s AND finished_at IS NOT NULL AND workflow_id IS NULL
      AND finished_at >= %(since)s::timestamptz AND finished_at < %(until)s::timestamptz
      AND (finished_at, id) > (%(after_at)s, %(after_id)s)
    ORDER BY finished_at, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), moved AS (
    DELETE FROM tasks_task AS t USING picked WHERE t.id = picked.id RETURNING t.*
), kept AS (
    INSERT INTO tasks_finished SELECT * FROM moved
    RETURNING finished_at, id
), progress AS (
    INSERT INTO tasks_archiveprogress (status, moved_until, recorded_at, moved)
    SELECT %(status)s, max(finished_at), statement_timestamp(), count(*) FROM kept HAVING count(*) > 0
    {_PROGRESS_UPSERT}
)
SELECT finished_at, id FROM kept
"""


def archive_after() -> dt.timedelta | None:
    """``LEASING_TASKS["ARCHIVE_AFTER"]`` as a duration; None: the mover is off."""
    value = get_settings().ARCHIVE_AFTER
    return None if value is None else parse_duration(value)


def archive_busy_fraction() -> float:
    """``LEASING_TASKS["ARCHIVE_BUSY_FRACTION"]``: the share of the time the leader's mover thread
    works while it is behind, above 0 and at most 1 (1: flat out); ValueError otherwise."""
    value = get_settings().ARCHIVE_BUSY_FRACTION
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
        raise ValueError(f"ARCHIVE_BUSY_FRACTION must be a number above 0 and at most 1, got {value!r}")
    return float(value)


@dataclass
class MoveCursor:
    """Where a pass over one status stands."""

    status: str
    since: dt.datetime
    until: dt.datetime
    after: tuple[dt.datetime, int] = (_BEGINNING, 0)
    moved: int = 0
    done: bool = False


@dataclass
class ArchivePass:
    """The limits of one pass, read once from the database clock."""

    now: dt.datetime
    until: dt.datetime
    cursors: list[MoveCursor]


def plan_pass(
    after: dt.timedelta,
    *,
    resume: Mapping[str, tuple[dt.datetime, int]] | None = None,
    using: str = DEFAULT_DB_ALIAS,
) -> ArchivePass:
    """One cursor per final status: from the start of the oldest day its retention still keeps (a
    day past it is retention's to delete), or from where the last pass of that status stopped
    (``resume``), up to the pass's limit."""
    with connections[using].cursor() as cursor:
        cursor.execute(
            LIMITS_SQL,
            {"after": after.total_seconds(), "hours": get_settings().HISTORY_HOURS, "margin": COUNTED_MARGIN},
        )
        now, until = cursor.fetchone()
    policy = retention_policy() or {}
    cursors = []
    for status in STATUS_TABLES:
        age = policy.get(status)
        since = _BEGINNING if age is None else day_start((now - age).astimezone(dt.timezone.utc).date())
        if since < until:
            planned = MoveCursor(status, since, until)
            if resume and status in resume:
                planned.after = max(planned.after, resume[status])
            cursors.append(planned)
    return ArchivePass(now, until, cursors)


def move_batch(cursor: MoveCursor, *, limit: int, days: set[tuple[str, dt.date]], using: str = DEFAULT_DB_ALIAS) -> int:
    """Move one batch of ``cursor``'s status (at most ``limit`` rows, within one UTC day, whose
    partition is created first if ``days`` does not list it); returns the rows moved."""
    params: dict[str, Any] = {
        "status": cursor.status,
        "since": cursor.since,
        "until": cursor.until,
        "after_at": cursor.after[0],
        "after_id": cursor.after[1],
    }
    with without_jit(), connections[using].cursor() as db:
        db.execute(NEXT_SQL, params)
        row = db.fetchone()
        if row is None:
            cursor.done = True
            record_progress(cursor, using=using)
            return 0
        day = row[0].astimezone(dt.timezone.utc).date()
        if (cursor.status, day) not in days:
            create_day(cursor.status, day, using=using)
            days.add((cursor.status, day))
        day_end = day_start(day) + dt.timedelta(days=1)
        try:
            db.execute(ARCHIVE_SQL, {**params, "until": min(cursor.until, day_end), "limit": limit})
            rows = db.fetchall()
        except IntegrityError:
            # No partition for the row: retention retired the day under this pass (the partition
            # keeper runs beside it; the day passed its retention since the pass began), or a
            # retirement interrupted half-way left its detach pending (a hand retirement cancelled:
            # the next retirement finishes it). Its rows stay, for the prune or for a later pass once
            # the detach is finished; the statement changed nothing. Another failure is the caller's.
            if connections[using].in_atomic_block or _attached(cursor.status, day, using):
                raise
            days.discard((cursor.status, day))
            logger.info("archive: %s's day %s was retired under the pass; its rows stay", cursor.status, day)
            rows = []
    if rows:
        cursor.after = max(rows)
        cursor.moved += len(rows)
    elif cursor.after < (day_end, 0) and day_end < cursor.until:
        # Every row left of this day was held by another session: the next pass takes them; go on
        # with the next day.
        cursor.after = (day_end - dt.timedelta(microseconds=1), 2**63 - 1)
    else:
        cursor.done = True
    if cursor.done:
        record_progress(cursor, using=using)
    return len(rows)


def _attached(status: str, day: dt.date, using: str) -> bool:
    # A partition whose detach is pending (a retirement interrupted half-way) takes no row: its day is
    # retention's, as if it were retired (the next retirement finishes the detach, whatever its cutoff).
    return any(p.status == status and p.day == day and not p.detach_pending for p in partitions(using))


def record_progress(cursor: MoveCursor, *, using: str = DEFAULT_DB_ALIAS) -> None:
    """Note that ``cursor``'s pass is done (PROGRESS_SQL): every row of its status that finished before
    the pass's limit has moved (each batch notes its own last row in ARCHIVE_SQL)."""
    with connections[using].cursor() as db:
        db.execute(PROGRESS_SQL, {"status": cursor.status, "until": cursor.until})


@dataclass
class Archiver:
    """The recovery leader's mover: a pass over the three final statuses every ``interval``
    seconds, run a slice at a time (``run_for``) between recovery rounds, as retention is.

    A pass resumes each status where the last one stopped, not from the oldest day kept: the index
    range it reads holds the workflow members finished since (they stay in tasks_task, up to the
    longest retention of them), which every pass would otherwise step over again. A full pass, from
    the oldest day kept, runs first in a term and then every ``full_pass_interval`` seconds: it
    takes the rows a pass passed over because another session held them (SKIP LOCKED). A row that
    commits its finish with a finish time already behind a cursor (a transaction open for more than
    the 10 minutes a row waits at least) waits for that full pass too."""

    using: str = DEFAULT_DB_ALIAS
    interval: float = field(default_factory=lambda: get_settings().RETENTION_INTERVAL)
    batch_size: int = field(default_factory=lambda: get_settings().RETENTION_BATCH_SIZE)
    clock: Callable[[], float] = time.monotonic
    moved: int = 0
    _pass: ArchivePass | None = None
    _days: set[tuple[str, dt.date]] = field(default_factory=set)
    _next_pass_at: float = 0.0
    full_pass_interval: float = FULL_PASS_INTERVAL
    _full_pass_at: float = 0.0
    _resume: dict[str, tuple[dt.datetime, int]] = field(default_factory=dict)
    #: Passes completed (each status's cursor at its limit).
    passes: int = 0
    #: The warning last logged per invalid setting: a setting read every slice is said once per
    #: value, not every second, until it is fixed.
    _warned: dict[str, str] = field(default_factory=dict)

    def _warn_once(self, setting: str, message: str) -> None:
        if self._warned.get(setting) != message:
            self._warned[setting] = message
            logger.warning("%s", message)

    def busy_fraction(self) -> float:
        """``ARCHIVE_BUSY_FRACTION``; while it is invalid (manage.py check says so too, tasks.E124)
        the default, with a warning logged once per invalid value."""
        try:
            busy = archive_busy_fraction()
        except ValueError as exc:
            self._warn_once("busy", f"archive: {exc}; working {DEFAULT_ARCHIVE_BUSY_FRACTION} of the time")
            return DEFAULT_ARCHIVE_BUSY_FRACTION
        self._warned.pop("busy", None)
        return busy

    def run_for(self, budget: float) -> int:
        """Move batches for up to ``budget`` seconds (at least one batch when a pass is due; none
        while ARCHIVE_AFTER is None); returns the rows moved."""
        try:
            after = archive_after()
        except ValueError as exc:  # manage.py check says so too (tasks.E123): nothing moves meanwhile
            self._warn_once("after", f"archive: {exc}; nothing moves until it is fixed")
            return 0
        self._warned.pop("after", None)
        now = self.clock()
        if after is None or (self._pass is None and now < self._next_pass_at):
            return 0
        if self._pass is None:
            if now >= self._full_pass_at:
                self._resume.clear()
                self._full_pass_at = now + self.full_pass_interval
            self._pass = plan_pass(after, resume=self._resume, using=self.using)
            self._days = {(p.status, p.day) for p in partitions(self.using) if p.day is not None}
        deadline = now + budget
        moved = 0
        while self._pass.cursors:
            current = self._pass.cursors[0]
            try:
                moved += move_batch(current, limit=self.batch_size, days=self._days, using=self.using)
            except PartitionError:
                self.reset()
                raise
            if current.done:
                self._resume[current.status] = current.after
                if current.moved:
                    logger.info("archive: moved %d %s tasks to tasks_finished", current.moved, current.status.lower())
                self._pass.cursors.pop(0)
            if self.clock() >= deadline:
                break
        if not self._pass.cursors:
            self._pass = None
            self._next_pass_at = self.clock() + self.interval
            self.passes += 1
        self.moved += moved
        return moved

    @property
    def behind(self) -> bool:
        """A pass is in progress: its slice ended before it did."""
        return self._pass is not None

    def rest(self, worked: float, busy_fraction: float) -> float:
        """Seconds the leader's mover thread waits after a slice of ``worked`` seconds: while a pass
        is in progress, long enough that it works ``busy_fraction`` of the time; otherwise until the
        next pass is due, at most MOVER_SLICE; MOVER_SLICE when no pass is due yet none began
        (ARCHIVE_AFTER None: it is read again then)."""
        if self.behind:
            return worked * (1.0 - busy_fraction) / busy_fraction
        due_in = self._next_pass_at - self.clock()
        return min(MOVER_SLICE, due_in) if due_in > 0 else MOVER_SLICE

    def reset(self) -> None:
        """Forget the pass in progress (after a database error: the next call starts a new one,
        a full one)."""
        self._pass = None
        self._full_pass_at = 0.0
