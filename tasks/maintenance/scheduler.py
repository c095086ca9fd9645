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

Slots (``tasks/maintenance/schedule_specs.py``): an ``interval`` schedule is due at every multiple of the interval
since the Unix epoch (UTC); a ``cron`` schedule when its expression matches in its time zone, as
Debian's cron would run it. A new schedule's first slot is the first one after the scheduler first
saw it.

Schedules stored at runtime (:class:`~tasks.models.schedule.StoredSchedule`, from the admin or the JSON
API) run beside the declared ones. The leader reads them every round (one query; a round is at most
``STORED_POLL`` seconds apart), so a change takes effect within a second:

- a new stored schedule's first slot is the first one after it was stored (``effective_from``);
- an edit takes effect from the first slot after the edit (the old definition's missed slots are
  not back-filled, whatever the catch-up); a pause enqueues nothing from the next statement on, and
  a resume runs the slots after it (none of those missed while paused); a delete stops it, and
  its progress row and runs stay as history (runs are pruned by age like any others);
- the slot statement enqueues only while the stored row still has the revision the leader read,
  under a share lock on that row: an edit committing while a round runs either lands after the slot
  statement (which enqueued under the definition that was current) or before it (which then
  enqueues nothing, and the leader reads the new definition at once). No slot is enqueued under a
  definition after the edit replacing it commits; the run row's uniqueness still holds each slot to
  one task;
- their tasks carry ``api_origin``: the worker checks the path against the API allow-list again.

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
from dataclasses import dataclass, field, replace
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.db import DEFAULT_DB_ALIAS, Error, connections

from leasing.election import LeaderElection, Term
from leasing.models import Lease
from leasing.routing import selected_database
from tasks.conf import get_settings
from tasks.lifecycle.routing import queue_database
from tasks.lifecycle.values import fair_key_for
from tasks.maintenance.schedule_specs import ScheduleSpec, load_schedules, stored_spec

logger = logging.getLogger("tasks.scheduler")

SCHEDULER_LEASE = "tasks:scheduler"
#: Longest the leader sleeps between rounds when no slot is due sooner (it also wakes on loss/stop).
MAX_WAIT = 5.0
#: Longest between two reads of the stored schedules: an operator's change takes effect within it.
STORED_POLL = 1.0


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

# A stored schedule's row at the revision the leader read, not paused, under a share lock: an edit
# (an UPDATE of the row) waits for the statement holding it, and a statement arriving while an edit
# is in flight waits for it and then finds the new revision (READ COMMITTED re-checks the locked
# row's newest version) and enqueues nothing. Settings schedules pass %(revision)s NULL. The row's
# created_at too (a schedule deleted and stored again under its name once started at revision 1
# again; revisions now come from one sequence, migration 0033, and the check stays as a second key).
_CURRENT_CTE = """current AS (
    SELECT name FROM tasks_storedschedule
    WHERE name = %(name)s AND revision = %(revision)s AND created_at = %(stored_at)s AND NOT paused
    FOR SHARE
)"""

# The fenced, forward-only step of a schedule row: refused when a newer token wrote the row, when
# the slot is not after the last one handled, or when a stored schedule changed since it was read.
_ADVANCE_WHERE = """s.name = %(name)s AND s.fence_token <= %(token)s
      AND (s.last_slot IS NULL OR s.last_slot < %(slot)s)
      AND (%(revision)s::bigint IS NULL OR EXISTS (SELECT FROM current))"""

# One slot, one statement: allocate the task's id, advance the schedule row (fenced, forward
# only), record the run (unique per schedule + slot: DO NOTHING on a duplicate, and then no task),
# insert the task. Each step reads the one before it, so nothing is written unless the lease and
# the fence allow it, and no task is inserted for a slot that already has a run. It answers no row
# when refused, and a NULL task when the slot had a run already. The task columns are listed here
# (not shared with ENQUEUE_SQL): a column added to tasks_task needs a database default, or an
# entry here.
SLOT_SQL = f"""
WITH {_LEASE_CTE},
{_CURRENT_CTE},
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
        unstarted_returns, attempt_started, attempt_isolated, errors_dropped, fair_key, api_origin)
    SELECT run.task_id, %(queue)s, %(priority)s, %(task_path)s, %(args)s::jsonb, %(kwargs)s::jsonb, 'READY',
           statement_timestamp(), statement_timestamp(), 0, %(max_attempts)s, %(timeout)s, NULL, '[]'::jsonb,
           '[]'::jsonb, 0, 0, 0, 0, 0, 0, false, false, 0, %(fair_key)s::text, %(api_origin)s
    FROM run
    RETURNING id
)
SELECT advanced.task_id, (SELECT id FROM task) FROM advanced
"""

# Slots passed over without a task (catch-up "skip" / "last"): the same fenced, forward-only step.
SKIP_SQL = f"""
WITH {_LEASE_CTE},
{_CURRENT_CTE}
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


class DefinitionChanged(Exception):
    """A stored schedule was edited, paused or deleted since the leader read it: read it again."""


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
    #: A stored schedule's ``effective_from``: only slots after it run (None: a settings schedule).
    not_before: dt.datetime | None = None

    @property
    def after(self) -> dt.datetime:
        if self.not_before is None:
            return self.last_slot or self.baseline_at
        return max(self.last_slot, self.not_before) if self.last_slot else self.not_before


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

    def _refused(self, what: str, spec: ScheduleSpec | None = None) -> Exception:
        current = Lease.objects.db_manager(self.using).is_current(self.lease, self.token)
        if current and spec is not None and spec.stored:
            from tasks.models.schedule import StoredSchedule

            row = StoredSchedule.objects.db_manager(self.using).filter(name=spec.name).first()
            if row is None or row.revision != spec.revision or row.created_at != spec.stored_at or row.paused:
                return DefinitionChanged(f"{what}: schedule {spec.name!r} changed since it was read")
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
            revision=spec.revision,
            stored_at=spec.stored_at,
            api_origin=spec.stored,
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
            raise self._refused(f"schedule {spec.name!r}: slot {slot.isoformat()}", spec)
        if rows[0][1] is None:
            # The schedule row had been set back (by hand) behind a slot that has its run already.
            logger.warning("schedule %s: slot %s was enqueued before; not again", spec.name, slot.isoformat())
            return None
        return int(rows[0][1])

    def skip(self, spec: ScheduleSpec, slot: dt.datetime, *, skipped: int) -> None:
        params = self._params(
            name=spec.name,
            slot=slot,
            next_slot=spec.next_slot(slot),
            skipped=skipped,
            revision=spec.revision,
            stored_at=spec.stored_at,
        )
        if not self._rows(SKIP_SQL, params):
            raise self._refused(f"schedule {spec.name!r}: skipping to {slot.isoformat()}", spec)


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
        stored: bool = True,
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
        self.declared = dict(schedules)
        #: What the next round runs: the declared schedules and the stored ones as last read.
        self.schedules: dict[str, ScheduleSpec] = dict(schedules)
        self.stored = stored
        #: name -> (revision, created_at) read (valid or not): a row stored again is a new row
        self._stored_seen: dict[str, tuple[int, dt.datetime]] = {}
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
        if not self.declared and not self._wait_for_stored():
            return
        self.election.run(self._lead)

    def _wait_for_stored(self) -> bool:
        """Nothing declared: stand aside from the election (no lease taken) until a schedule is
        stored, looking every MAX_WAIT seconds; False when stopped first."""
        from tasks.models.schedule import StoredSchedule

        if not self.stored:
            logger.info("scheduler %s: no schedules declared, nothing to do", self.holder)
            return False
        stopping = self.election._stopping
        logger.info(
            "scheduler %s: no schedule declared; no lease taken until one is stored (looking every %gs)",
            self.holder,
            MAX_WAIT,
        )
        try:
            while not stopping.is_set():
                try:
                    if StoredSchedule.objects.db_manager(self.using).exists():
                        return True
                except Error as exc:
                    logger.warning("scheduler %s: reading the stored schedules failed: %s", self.holder, exc)
                    connections[self.using].close()
                stopping.wait(MAX_WAIT)
            return False
        finally:
            connections[self.using].close()

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
                    states = {name: writer.sync(spec, now) for name, spec in self.declared.items()}
                    self._stored_seen.clear()  # a new term (or after an error) syncs them again
                    self.schedules = dict(self.declared)
                if self.stored:
                    self.refresh(writer, states)
                report = self.round(writer, states)
                wait = min(report.wait, STORED_POLL) if self.stored else report.wait
            except DefinitionChanged as exc:
                logger.info("scheduler %s: %s; reading it again", self.holder, exc)
                wait = 0.0
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

    def refresh(self, writer: SlotWriter, states: dict[str, ScheduleState]) -> None:
        """Read the stored schedules (one query) and bring ``self.schedules`` and ``states`` up to
        date: a new or changed one is validated again and its progress row synced (one statement
        each, only when its revision moved), a deleted one dropped. A row that no longer validates
        (its task path left the allow-list, its module is gone) is left out, with a warning once."""
        from tasks.models.schedule import StoredSchedule

        rows = StoredSchedule.objects.db_manager(self.using).for_scheduler()
        present: set[str] = set()
        now: dt.datetime | None = None
        for name, entry, paused, revision, effective_from, created_at in rows:
            seen = (revision, created_at)
            if name in self.declared:
                if self._stored_seen.get(name) != seen:
                    logger.warning("stored schedule %s: the settings declare one of that name; it is not run", name)
                    self._stored_seen[name] = seen
                continue
            present.add(name)
            if self._stored_seen.get(name) == seen:
                continue
            self._stored_seen[name] = seen
            self.schedules.pop(name, None)
            states.pop(name, None)
            try:
                spec = replace(stored_spec(name, entry, paused=paused, revision=revision), stored_at=created_at)
            except ImproperlyConfigured as exc:
                logger.warning("stored schedule %s is not run: %s", name, exc)
                continue
            if queue_database(spec.queue) != self.using:
                logger.warning("stored schedule %s: its queue is routed to another database; not run here", name)
                continue
            self.schedules[name] = spec
            if spec.enabled:
                now = now or database_now(self.using)
                state = writer.sync(spec, now)
                state.not_before = effective_from
                states[name] = state
        for name in [n for n in self._stored_seen if n not in present and n not in self.declared]:
            del self._stored_seen[name]
            self.schedules.pop(name, None)
            states.pop(name, None)
        for name in [n for n in self._stored_seen if n in self.declared and n not in {r[0] for r in rows}]:
            del self._stored_seen[name]

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
    """Every schedule, declared (``kind: "settings"``) or stored (``kind: "stored"``), with its
    stored progress and next run (dashboard, API, admin); a progress row whose schedule left the
    settings or was deleted is listed as ``declared: False`` (``kind: None``). One query each for the
    stored schedules, the progress rows and the leader."""
    from tasks.models.schedule import Schedule, StoredSchedule

    using = using or selected_database()
    # The schedules that run in this database (their queue is routed here: tasks/lifecycle/routing.py).
    declared = {
        n: s for n, s in (load_schedules() if specs is None else specs).items() if queue_database(s.queue) == using
    }
    stored = {row.name: row for row in StoredSchedule.objects.using(using).all() if row.name not in declared}
    rows = {row.name: row for row in Schedule.objects.using(using).all()}
    now = dt.datetime.now(dt.timezone.utc)
    leader = Lease.objects.db_manager(using).active().filter(resource=SCHEDULER_LEASE).first()
    result = []
    for name in sorted(set(declared) | set(stored) | set(rows)):
        spec, row, kept = declared.get(name), rows.get(name), stored.get(name)
        error = None
        if kept is not None:
            try:
                spec = stored_spec(name, kept.entry, paused=kept.paused, revision=kept.revision)
            except ImproperlyConfigured as exc:
                spec, error = None, getattr(exc, "reason", str(exc))
        next_run = None
        if spec is not None and spec.enabled:
            after = (row.last_slot or row.baseline_at) if row is not None else now
            if kept is not None:
                after = max(row.last_slot, kept.effective_from) if row and row.last_slot else kept.effective_from
            next_run = spec.next_slot(max(after, now))
        if kept is not None:
            definition = spec.definition() if spec is not None else dict(kept.entry)
            explain = spec.explain() if spec is not None else f"not run: {error}"
        else:
            definition = spec.definition() if spec is not None else (row.definition if row else {})
            explain = spec.explain() if spec is not None else "no longer in settings"
        result.append(
            {
                "name": name,
                "declared": spec is not None or kept is not None,
                "kind": "settings" if name in declared else "stored" if kept is not None else None,
                "paused": bool(kept and kept.paused),
                "revision": kept.revision if kept is not None else None,
                "stored": kept,
                "error": error,
                "spec": spec,
                "row": row,
                "definition": definition,
                "every": spec.every if spec is not None else "",
                "explain": explain,
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
