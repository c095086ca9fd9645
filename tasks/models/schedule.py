"""The stored side of periodic tasks: one row per schedule, one per enqueued slot.

Schedules are declared in settings (``LEASING_TASKS["SCHEDULES"]``, see ``tasks/maintenance/scheduler.py``);
these rows are what the leader-elected scheduler has done with them. The scheduler writes them only
through the slot statement in ``tasks/maintenance/scheduler.py``, fenced with its lease's token: a deposed
leader's write is refused by the database.
"""

from __future__ import annotations

from django.db import models

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
