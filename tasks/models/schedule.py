"""The stored side of periodic tasks: the schedules operators store at runtime, one progress row
per schedule, one row per enqueued slot.

Schedules are declared in settings (``LEASING_TASKS["SCHEDULES"]``, see ``tasks/maintenance/scheduler.py``)
or stored here (:class:`StoredSchedule`, from the admin or the JSON API). ``Schedule`` and
``ScheduleRun`` are what the leader-elected scheduler has done with either kind. The scheduler
writes them only through the slot statement in ``tasks/maintenance/scheduler.py``, fenced with its
lease's token: a deposed leader's write is refused by the database.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass
from typing import Any

from django.db import connections, models

from leasing.fencing import FencedModel
from leasing.routing import SelectedManager


class Schedule(FencedModel):
    """A schedule's progress: the newest slot handled, the last task it enqueued, counters."""

    name = models.CharField(max_length=100, primary_key=True)
    definition = models.JSONField(default=dict, help_text="What the scheduler runs, as it last read the settings.")
    baseline_at = models.DateTimeField(help_text="When the scheduler first saw the schedule: slots after it run.")
    last_slot = models.DateTimeField(null=True, blank=True, help_text="Newest slot handled (enqueued or skipped).")
    last_enqueued_slot = models.DateTimeField(null=True, blank=True, help_text="Newest slot enqueued.")
    last_enqueued_at = models.DateTimeField(null=True, blank=True)
    last_task_id = models.BigIntegerField(null=True, blank=True, help_text="Task of the newest enqueued slot.")
    next_slot = models.DateTimeField(null=True, blank=True, help_text="Next slot, as of the scheduler's last round.")
    enqueued = models.BigIntegerField(default=0, help_text="Slots enqueued.")
    skipped = models.BigIntegerField(default=0, help_text="Slots missed and not run (catch-up policy).")
    leader = models.CharField(max_length=200, blank=True, default="", help_text="Scheduler that last wrote.")
    updated_at = models.DateTimeField(null=True, blank=True)

    objects = SelectedManager()

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class ScheduleRun(models.Model):
    """One enqueued slot. Unique per (schedule, slot): the last line of defence against a slot being
    enqueued twice (the first is the fenced, monotonic ``Schedule.last_slot``)."""

    schedule = models.CharField(max_length=100)
    slot = models.DateTimeField(help_text="The time the slot stands for.")
    task_id = models.BigIntegerField(help_text="The task enqueued for it (it may have been pruned since).")
    token = models.BigIntegerField(help_text="Fencing token of the scheduler lease that enqueued it.")
    enqueued_at = models.DateTimeField()

    objects = SelectedManager()

    class Meta:
        ordering = ["-slot"]
        constraints = [models.UniqueConstraint(fields=["schedule", "slot"], name="tasks_schedulerun_slot_uniq")]
        indexes = [models.Index(fields=["enqueued_at", "id"], name="tasks_schedulerun_prune_idx")]

    def __str__(self) -> str:
        return f"{self.schedule} @ {self.slot:%Y-%m-%d %H:%M:%S}"


# -- schedules stored at runtime -----------------------------------------------------------------
#
# Every operator write is one statement that sets ``revision`` to the next value of one sequence (so a
# revision is never given twice, not even to a schedule stored again under a deleted one's name: a
# write made at the deleted one's revision is refused); the scheduler's slot statement
# enqueues only while the row still has the revision it read (under a share lock: an edit waits for
# a slot statement in flight, and a slot statement for an edit in flight, then sees it), so no slot
# is enqueued under a definition after the edit that replaced it commits. ``effective_from`` is the
# database clock at the write that set the timing or resumed it: the scheduler runs only slots after
# it (no back-fill of the time before a schedule existed, was edited, or while it was paused).

_RETURNING = "RETURNING name, entry, paused, revision, effective_from, created_at, updated_at"
_NEXT_REVISION = "nextval('tasks_storedschedule_revision_seq')"  # migration 0033

# A new schedule; no row when the name is taken (the caller answers 409).
STORED_CREATE_SQL = f"""
INSERT INTO tasks_storedschedule AS s (
    name, entry, paused, revision, effective_from, created_at, updated_at, changed_by)
VALUES (%(name)s, %(entry)s::jsonb, %(paused)s, {_NEXT_REVISION}, clock_timestamp(), clock_timestamp(),
        clock_timestamp(), %(by)s)
ON CONFLICT (name) DO NOTHING
{_RETURNING}
"""

# Replace the definition: compare-and-set on the revision the caller read and validated against
# (no row: deleted, or edited meanwhile; the caller answers 404 or 409). The timing restarts now.
STORED_REPLACE_SQL = f"""
UPDATE tasks_storedschedule AS s SET
    entry = %(entry)s::jsonb, paused = %(paused)s, revision = {_NEXT_REVISION},
    effective_from = clock_timestamp(), updated_at = clock_timestamp(), changed_by = %(by)s
WHERE s.name = %(name)s AND s.revision = %(revision)s
{_RETURNING}
"""

# Pause: the scheduler enqueues nothing for it from its next statement on. Already paused: no change.
STORED_PAUSE_SQL = f"""
UPDATE tasks_storedschedule AS s SET
    paused = true, revision = {_NEXT_REVISION}, updated_at = clock_timestamp(),
    changed_by = %(by)s
WHERE s.name = %(name)s AND NOT s.paused
{_RETURNING}
"""

# Resume: slots after now run, the ones missed while paused do not. Not paused: no change.
STORED_RESUME_SQL = f"""
UPDATE tasks_storedschedule AS s SET
    paused = false, revision = {_NEXT_REVISION}, effective_from = clock_timestamp(),
    updated_at = clock_timestamp(),
    changed_by = %(by)s
WHERE s.name = %(name)s AND s.paused
{_RETURNING}
"""

# Delete: the progress row and the runs stay (history; runs are pruned by age as any others).
STORED_DELETE_SQL = f"""
DELETE FROM tasks_storedschedule AS s WHERE s.name = %(name)s
{_RETURNING}
"""


@dataclass(frozen=True)
class StoredRow:
    """One stored schedule as a statement returned it."""

    name: str
    entry: dict[str, Any]
    paused: bool
    revision: int
    effective_from: dt.datetime
    created_at: dt.datetime
    updated_at: dt.datetime


class StoredScheduleQuerySet(models.QuerySet["StoredSchedule"]):
    """The operator's writes, one statement each (the admin and the API both go through them)."""

    def _one(self, statement: str, **params: Any) -> StoredRow | None:
        with connections[self.db].cursor() as cursor:
            cursor.execute(statement, params)
            row = cursor.fetchone()
        if row is None:
            return None
        entry = row[1] if isinstance(row[1], dict) else json.loads(row[1])
        return StoredRow(row[0], entry, *row[2:])

    def create_stored(
        self, name: str, entry: dict[str, Any], *, paused: bool = False, by: str = ""
    ) -> StoredRow | None:
        """Store a new schedule (``entry`` validated by the caller); None when the name is taken."""
        return self._one(STORED_CREATE_SQL, name=name, entry=json.dumps(entry), paused=paused, by=by[:200])

    def replace_stored(
        self, name: str, entry: dict[str, Any], *, paused: bool, revision: int, by: str = ""
    ) -> StoredRow | None:
        """Replace the definition read at ``revision``; None when the row is gone or changed since."""
        return self._one(
            STORED_REPLACE_SQL, name=name, entry=json.dumps(entry), paused=paused, revision=revision, by=by[:200]
        )

    def pause_stored(self, name: str, *, by: str = "") -> StoredRow | None:
        """Pause; None when it is missing or paused already."""
        return self._one(STORED_PAUSE_SQL, name=name, by=by[:200])

    def resume_stored(self, name: str, *, by: str = "") -> StoredRow | None:
        """Resume from the next slot; None when it is missing or not paused."""
        return self._one(STORED_RESUME_SQL, name=name, by=by[:200])

    def delete_stored(self, name: str) -> StoredRow | None:
        return self._one(STORED_DELETE_SQL, name=name)

    def for_scheduler(self) -> list[tuple[str, dict[str, Any], bool, int, dt.datetime, dt.datetime]]:
        """What the scheduler reads each round: one query over the (few) stored schedules. A row is
        (name, revision, created_at)."""
        return list(
            self.order_by("name").values_list("name", "entry", "paused", "revision", "effective_from", "created_at")
        )


class StoredSchedule(models.Model):
    """A schedule stored at runtime (admin, JSON API): the settings entry's keys in ``entry``
    (validated by ``tasks.maintenance.schedule_specs.stored_spec``, the settings' validator), run by the
    same scheduler as the declared ones. Write it through the queryset's operations (each bumps
    ``revision``), not ``save()``."""

    name = models.CharField(max_length=100, primary_key=True)
    entry = models.JSONField(default=dict, help_text="The schedule, as a settings entry (task, cron or interval, ...).")
    paused = models.BooleanField(default=False, help_text="While paused, no slot is enqueued (none back-filled).")
    revision = models.BigIntegerField(default=1, help_text="Bumped by every write; the scheduler enqueues under it.")
    effective_from = models.DateTimeField(help_text="Slots after this time run (set on create, edit and resume).")
    created_at = models.DateTimeField()
    updated_at = models.DateTimeField()
    changed_by = models.CharField(max_length=200, blank=True, default="")

    objects = SelectedManager.from_queryset(StoredScheduleQuerySet)()

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name
