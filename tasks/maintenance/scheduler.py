"""Periodic tasks: schedules declared in settings, enqueued by one leader-elected scheduler.

    LEASING_TASKS = {"SCHEDULES": {
        "nightly-report": {"task": "reports.jobs.render", "cron": "30 2 * * *", "timezone": "Europe/Paris"},
        "sync": {"task": "billing.tasks.sync", "interval": 300, "kwargs": {"full": False}, "catch_up": "skip"},
    }}

Every replica may run a scheduler (a thread of ``run_worker``, or ``manage.py run_scheduler``);
only the holder of the ``tasks:scheduler`` lease enqueues. Each *slot* (a time a schedule is due)
becomes a task exactly once, however many replicas run and whatever they suffer:

- the slot statement inserts the task, a :class:`~tasks.models.schedule.ScheduleRun` row unique per
  (schedule, slot), and advances ``Schedule.last_slot``, all in one statement, and only while
  this scheduler's lease is live with this token (the lease row is read under a share lock, so a
  takeover waits for the statement to finish) and the schedule row was not written with a newer
  token (a fenced write, as ``leasing.fencing``). A leader that was paused past its lease is
  refused by the database, not by its own clock;
- ``last_slot`` only moves forward, so a slot once handled is never enqueued again, even after its
  run row was pruned; the unique run row refuses a duplicate all the same.

Slots (``tasks/maintenance/schedules.py``): an ``interval`` schedule is due at every multiple of the interval
since the Unix epoch (UTC); a ``cron`` schedule when its expression matches in its time zone, as
Debian's cron would run it. A new schedule's first slot is the first one after the scheduler first
saw it.

Catch-up, when the scheduler finds slots it missed (no scheduler ran, or a failover):

- ``"skip"``: the missed slots are skipped; the newest due slot runs if it is at most ``grace``
  seconds late (default 60), so a short failover still runs the slot that fell into it;
- ``"last"`` (the default): the newest missed slot runs once, the older ones are skipped;
- ``"all"``: every missed slot runs, oldest first (at most ``SCHEDULER_MAX_CATCH_UP`` per round).
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from dataclasses import dataclass, field
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.db import DEFAULT_DB_ALIAS, Error, connections

from leasing.election import LeaderElection, Term
from leasing.models import Lease
from leasing.routing import selected_database
from tasks.conf import get_settings
from tasks.lifecycle.routing import queue_database
from tasks.lifecycle.values import fair_key_for
from tasks.maintenance.schedules import ScheduleSpec, load_schedules

logger = logging.getLogger("tasks.scheduler")

SCHEDULER_LEASE = "tasks:scheduler"
#: Longest the leader sleeps between rounds when no slot is due sooner (it also wakes on loss/stop).
MAX_WAIT = 5.0


# -- statements ----------------------------------------------------------------------------------

# The scheduler's own lease, live and with this token, read under a share lock: a takeover (the
# acquire's upsert) waits until the statement holding it commits, so a slot is only ever written
# inside a term of the lease, as ordered by the database.
_LEASE_CTE = """lease AS (
    SELECT token FROM leasing_lease
    WHERE resource = %(lease)s AND holder = %(holder)s AND token = %(token)s
      AND released_at IS NULL AND expires_at > clock_timestamp()
    FOR SHARE
)"""

# The fenced, forward-only step of a schedule row: refused when a newer token wrote the row, or
# when the slot is not after the last one handled.
_ADVANCE_WHERE = """s.name = %(name)s AND s.fence_token <= %(token)s
      AND (s.last_slot IS NULL OR s.last_slot < %(slot)s)"""

# One slot, one statement: allocate the task's id, advance the schedule row (fenced, forward
# only), record the run (unique per schedule + slot: DO NOTHING on a duplicate, and then no task),
# insert the task. Each step reads the one before it, so nothing is written unless the lease and
# the fence allow it, and no task is inserted for a slot that already has a run. It answers no row
# when refused, and a NULL task when the slot had a run already. The task columns are listed here
# (not shared with ENQUEUE_SQL): a column added to tasks_task needs a database default, or an
# entry here.
SLOT_SQL = f"""
WITH {_LEASE_CTE},
allocated AS (
    SELECT nextval(pg_get_serial_sequence('tasks_task', 'id')) AS task_id FROM lease
),
advanced AS (
    UPDATE tasks_schedule AS s SET
        last_slot = %(slot)s, last_enqueued_slot = %(slot)s, last_enqueued_at = clock_timestamp(),
        last_task_id = allocated.task_id, next_slot = %(next_slot)s, enqueued = s.enqueued + 1,
        skipped = s.skipped + %(skipped)s, fence_token = %(token)s, leader = %(holder)s,
        updated_at = clock_timestamp()
    FROM allocated
    WHERE {_ADVANCE_WHERE}
    RETURNING allocated.task_id
),
run AS (
    INSERT INTO tasks_schedulerun (schedule, slot, task_id, token, enqueued_at)
    SELECT %(name)s, %(slot)s, task_id, %(token)s, clock_timestamp() FROM advanced
    ON CONFLICT (schedule, slot) DO NOTHING
    RETURNING task_id
),
task AS (
    INSERT INTO tasks_task (
        id, queue, priority, task_path, args, kwargs, status, run_after, enqueued_at, attempts, max_attempts,
        timeout, dedup_key, errors, worker_ids, renewals, transitions, failures, crashes, shared_crashes,
        unstarted_returns, attempt_started, attempt_isolated, errors_dropped, fair_key)
    SELECT run.task_id, %(queue)s, %(priority)s, %(task_path)s, %(args)s::jsonb, %(kwargs)s::jsonb, 'READY',
           statement_timestamp(), statement_timestamp(), 0, %(max_attempts)s, %(timeout)s, NULL, '[]'::jsonb,
           '[]'::jsonb, 0, 0, 0, 0, 0, 0, false, false, 0, %(fair_key)s::text
    FROM run
    RETURNING id
)
SELECT advanced.task_id, (SELECT id FROM task) FROM advanced
"""

# Slots passed over without a task (catch-up "skip" / "last"): the same fenced, forward-only step.
SKIP_SQL = f"""
WITH {_LEASE_CTE}
UPDATE tasks_schedule AS s SET
    last_slot = %(slot)s, next_slot = %(next_slot)s, skipped = s.skipped + %(skipped)s,
    fence_token = %(token)s, leader = %(holder)s, updated_at = clock_timestamp()
FROM lease
WHERE {_ADVANCE_WHERE}
RETURNING s.name
"""

# A new term: every declared schedule gets its row (baseline: now, so a new schedule's first slot
# is the first one after it was first seen) and the leader's definition and token. Stamping the
# token at once makes every later write of a deposed leader fail the fence.
SYNC_SQL = f"""
WITH {_LEASE_CTE}
INSERT INTO tasks_schedule AS s (name, definition, baseline_at, next_slot, enqueued, skipped, fence_token, leader,
                                 updated_at)
SELECT %(name)s, %(definition)s::jsonb, clock_timestamp(), %(next_slot)s, 0, 0, %(token)s, %(holder)s,
       clock_timestamp()
FROM lease
ON CONFLICT (name) DO UPDATE SET
    definition = EXCLUDED.definition, next_slot = COALESCE(EXCLUDED.next_slot, s.next_slot),
    fence_token = EXCLUDED.fence_token, leader = EXCLUDED.leader, updated_at = EXCLUDED.updated_at
WHERE s.fence_token <= EXCLUDED.fence_token
RETURNING s.name, s.baseline_at, s.last_slot
"""


class Deposed(Exception):
    """The database refused a write of this scheduler: its lease is gone or a newer one wrote."""


@dataclass(frozen=True)
class SlotResult:
    schedule: str
    slot: dt.datetime
    task_id: int | None  # None: skipped (catch-up policy), no task
    skipped: int  # slots passed over before this one


@dataclass
class RoundReport:
    enqueued: list[SlotResult] = field(default_factory=list)
    skipped: list[SlotResult] = field(default_factory=list)
    wait: float = MAX_WAIT  # seconds until the next slot is due (at most MAX_WAIT)


@dataclass
class ScheduleState:
    """What the leader knows of a schedule row (read at the start of its term, then its own writes)."""

    baseline_at: dt.datetime
    last_slot: dt.datetime | None

    @property
    def after(self) -> dt.datetime:
        return self.last_slot or self.baseline_at


class SlotWriter:
    """The scheduler's writes, each one statement under the lease's token."""

    def __init__(self, *, holder: str, token: int, using: str = DEFAULT_DB_ALIAS, lease: str = SCHEDULER_LEASE):
        self.holder = holder
        self.token = token
        self.using = using
        self.lease = lease

    def _params(self, **extra: Any) -> dict[str, Any]:
        return {"lease": self.lease, "holder": self.holder, "token": self.token, **extra}

    def _rows(self, statement: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
        with connections[self.using].cursor() as cursor:
            cursor.execute(statement, params)
            return cursor.fetchall()

    def _refused(self, what: str) -> Deposed:
        current = Lease.objects.db_manager(self.using).is_current(self.lease, self.token)
        reason = "a newer scheduler wrote the schedule" if current else "the scheduler lease is no longer ours"
        return Deposed(f"{what} refused: {reason} (token {self.token})")

    def sync(self, spec: ScheduleSpec, now: dt.datetime) -> ScheduleState:
        params = self._params(
            name=spec.name,
            definition=json.dumps(spec.definition()),
            next_slot=spec.next_slot(now) if spec.enabled else None,
        )
        rows = self._rows(SYNC_SQL, params)
        if not rows:
            raise self._refused(f"schedule {spec.name!r}: sync")
        return ScheduleState(baseline_at=rows[0][1], last_slot=rows[0][2])

    def enqueue(self, spec: ScheduleSpec, slot: dt.datetime, *, skipped: int = 0) -> int | None:
        """Enqueue ``slot``; its task id (None: it had been enqueued before). Raises Deposed."""
        params = self._params(
            name=spec.name,
            slot=slot,
            next_slot=spec.next_slot(slot),
            skipped=skipped,
            queue=spec.queue,
            priority=spec.priority,
            task_path=spec.task_path,
            args=json.dumps(spec.args),
            kwargs=json.dumps(spec.kwargs),
            max_attempts=spec.max_attempts or get_settings().MAX_ATTEMPTS,
            timeout=spec.timeout,
            # in a fair queue a scheduled task takes its turn like any enqueue: its key, or the shared ""
            fair_key=fair_key_for(spec.queue, spec.fair_key, get_settings().FAIR_QUEUES),
        )
        rows = self._rows(SLOT_SQL, params)
        if not rows:
            raise self._refused(f"schedule {spec.name!r}: slot {slot.isoformat()}")
        if rows[0][1] is None:
            # The schedule row had been set back (by hand) behind a slot that has its run already.
            logger.warning("schedule %s: slot %s was enqueued before; not again", spec.name, slot.isoformat())
            return None
        return int(rows[0][1])

    def skip(self, spec: ScheduleSpec, slot: dt.datetime, *, skipped: int) -> None:
        params = self._params(name=spec.name, slot=slot, next_slot=spec.next_slot(slot), skipped=skipped)
        if not self._rows(SKIP_SQL, params):
            raise self._refused(f"schedule {spec.name!r}: skipping to {slot.isoformat()}")


def database_now(using: str = DEFAULT_DB_ALIAS) -> dt.datetime:
    """The database clock: every replica's scheduler agrees on what is due."""
    with connections[using].cursor() as cursor:
        cursor.execute("SELECT clock_timestamp()")
        return cursor.fetchone()[0]


class Scheduler:
    """Runs the declared schedules while it holds the scheduler lease; stands by otherwise."""

    def __init__(
        self,
        *,
        schedules: dict[str, ScheduleSpec] | None = None,
        ttl: float | None = None,
        holder: str | None = None,
        using: str = DEFAULT_DB_ALIAS,
        lease: str = SCHEDULER_LEASE,
    ) -> None:
        conf = get_settings()
        # A schedule runs where its queue is routed (tasks/lifecycle/routing.py), with this scheduler's lease in
        # that same database: the slot statement writes the lease check, the fenced schedule row, the
        # run row and the task at once, which only one database can do. One scheduler per database.
        if schedules is None:
            schedules = {n: s for n, s in load_schedules().items() if queue_database(s.queue) == using}
        elsewhere = {n: queue_database(s.queue) for n, s in schedules.items() if queue_database(s.queue) != using}
        if elsewhere:
            listed = ", ".join(f"{name} (queue routed to {alias})" for name, alias in elsewhere.items())
            raise ImproperlyConfigured(f"scheduler on database {using!r} given schedules of another database: {listed}")
        self.schedules = schedules
        self.using = using
        self.max_catch_up = conf.SCHEDULER_MAX_CATCH_UP
        lease_ttl = ttl or conf.SCHEDULER_TTL
        self.election = LeaderElection(
            lease, ttl=lease_ttl, holder=holder, retry_interval=min(1.0, lease_ttl / 4), using=using
        )
        self.lease = lease
        self.rounds = 0
        self.enqueued = 0

    @property
    def holder(self) -> str:
        return self.election.holder

    def run(self) -> None:
        """Stand by and lead until ``stop()`` (closes this thread's connections on return)."""
        if not self.schedules:
            logger.info("scheduler %s: no schedules declared, nothing to do", self.holder)
            return
        self.election.run(self._lead)

    def run_once(self) -> bool:
        """One round, if the lease is free (for cron-driven set-ups); whether it ran."""
        return self.election.run_once(lambda term: self._lead(term, once=True))

    def stop(self) -> None:
        self.election.stop()

    def _lead(self, term: Term, *, once: bool = False) -> None:
        writer = SlotWriter(holder=self.holder, token=term.token, using=self.using, lease=self.lease)
        logger.info("scheduler %s leads (token %d): %d schedule(s)", self.holder, term.token, len(self.schedules))
        states: dict[str, ScheduleState] | None = None
        while not term.should_stop:
            wait = 1.0
            try:
                if states is None:
                    now = database_now(self.using)
                    states = {name: writer.sync(spec, now) for name, spec in self.schedules.items()}
                report = self.round(writer, states)
                wait = report.wait
            except Deposed as exc:
                logger.warning("scheduler %s stands down: %s", self.holder, exc)
                return
            except Error as exc:
                logger.warning("scheduler round failed: %s", exc)
                connections[self.using].close()
                states = None  # read the rows again: a statement may have landed before the error
            if once:
                return
            term.wait(wait)

    def round(self, writer: SlotWriter, states: dict[str, ScheduleState]) -> RoundReport:
        """Enqueue (or skip) every due slot of every enabled schedule; say when the next is due."""
        now = database_now(self.using)
        report = RoundReport()
        capped = False
        for name, spec in self.schedules.items():
            if not spec.enabled:
                continue
            state = states[name]
            if spec.catch_up == "all":
                for count, slot in enumerate(spec.slots_after(state.after)):
                    if slot > now:
                        break
                    if count >= self.max_catch_up:
                        capped = True  # the rest next round, at once
                        break
                    task_id = writer.enqueue(spec, slot)
                    state.last_slot = slot
                    report.enqueued.append(SlotResult(name, slot, task_id, 0))
            else:
                newest, before, _exact = spec.latest_due(state.after, now)
                if newest is not None:
                    late = (now - newest).total_seconds()
                    if spec.catch_up == "last" or late <= spec.grace:
                        task_id = writer.enqueue(spec, newest, skipped=before)
                        report.enqueued.append(SlotResult(name, newest, task_id, before))
                    else:
                        writer.skip(spec, newest, skipped=before + 1)
                        report.skipped.append(SlotResult(name, newest, None, before + 1))
                    state.last_slot = newest
            upcoming = spec.next_slot(max(state.after, now))
            report.wait = min(report.wait, (upcoming - now).total_seconds())
        for result in report.enqueued:
            logger.info(
                "schedule %s: slot %s enqueued as task %s%s",
                result.schedule,
                result.slot.isoformat(),
                result.task_id,
                f" ({result.skipped} missed slot(s) skipped)" if result.skipped else "",
            )
        for result in report.skipped:
            logger.info("schedule %s: %d missed slot(s) skipped", result.schedule, result.skipped)
        self.rounds += 1
        self.enqueued += len(report.enqueued)
        # Wake just after the next slot (a few ms late rather than early and idle); when catching
        # up "all" stopped at its cap, go on at once.
        if capped:
            report.wait = 0.0
        report.wait = max(0.0, report.wait) + 0.005
        return report


def schedule_status(specs: dict[str, ScheduleSpec] | None = None, *, using: str | None = None) -> list[dict[str, Any]]:
    """Every declared schedule with its stored progress and next run (dashboard, API, admin);
    schedules whose row remains after they left the settings are listed as ``declared: False``."""
    from tasks.models.schedule import Schedule

    using = using or selected_database()
    # The schedules that run in this database (their queue is routed here: tasks/lifecycle/routing.py).
    declared = {
        n: s for n, s in (load_schedules() if specs is None else specs).items() if queue_database(s.queue) == using
    }
    rows = {row.name: row for row in Schedule.objects.using(using).all()}
    now = dt.datetime.now(dt.UTC)
    leader = Lease.objects.db_manager(using).active().filter(resource=SCHEDULER_LEASE).first()
    result = []
    for name in sorted(set(declared) | set(rows)):
        spec, row = declared.get(name), rows.get(name)
        next_run = None
        if spec is not None and spec.enabled:
            after = (row.last_slot or row.baseline_at) if row is not None else now
            next_run = spec.next_slot(max(after, now))
        result.append(
            {
                "name": name,
                "declared": spec is not None,
                "spec": spec,
                "row": row,
                "definition": spec.definition() if spec is not None else (row.definition if row else {}),
                "every": spec.every if spec is not None else "",
                "explain": spec.explain() if spec is not None else "no longer in settings",
                "enabled": bool(spec and spec.enabled),
                "next_run": next_run,
                "last_slot": row.last_enqueued_slot if row else None,
                "last_enqueued_at": row.last_enqueued_at if row else None,
                "last_task_id": row.last_task_id if row else None,
                "enqueued": row.enqueued if row else 0,
                "skipped": row.skipped if row else 0,
                "leader": leader.holder if leader else None,
            }
        )
    return result
