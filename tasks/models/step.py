"""A durable step's stored result (tasks/steps.py; the fence: tasks/lifecycle/steps.py)."""

from __future__ import annotations

from django.db import models

from leasing.routing import SelectedManager


class TaskStep(models.Model):
    """One completed step of a task: the n-th step its handler called, by name, with the result a
    later attempt gets back instead of running the step again. Written only by the step's own fenced
    transaction, so a row here is a step whose writes committed while its attempt held the task.

    Keyed by (task, position) with no foreign key: a finished task moves to tasks_finished (the
    mover) and keeps its steps."""

    task_id = models.BigIntegerField(help_text="The task whose step this is (in tasks_task or tasks_finished).")
    position = models.IntegerField(help_text="The order the handler called its steps in, from 0.")
    name = models.CharField(max_length=200, help_text="The name the handler called the step by.")
    attempt = models.IntegerField(help_text="The attempt whose transaction committed the step.")
    token = models.BigIntegerField(help_text="That attempt's fencing token.")
    result = models.JSONField(null=True, help_text="What the step returned (JSON).")
    started_at = models.DateTimeField(help_text="When the step began (the worker's clock).")
    completed_at = models.DateTimeField(help_text="When its transaction stored the result (the database clock).")

    objects = SelectedManager()

    class Meta:
        ordering = ["task_id", "position"]
        constraints = [models.UniqueConstraint(fields=["task_id", "position"], name="tasks_taskstep_task_position")]

    def __str__(self) -> str:
        return f"task {self.task_id} step {self.position} {self.name!r} (attempt {self.attempt})"


class TaskEvent(models.Model):
    """An event sent to a task (tasks/steps.py ``send_event``): the first payload under a name wins,
    and ``wait_for_event`` returns it. ``delivered``: no wake is owed for it any more (the send woke the
    task suspended on it, or the recovery round looked at it once the task no longer ran)."""

    task_id = models.BigIntegerField(help_text="The task the event was sent to.")
    name = models.CharField(max_length=150, help_text="The name the task waits for it by.")
    payload = models.JSONField(null=True, help_text="What was sent (JSON).")
    sent_at = models.DateTimeField(help_text="When it was stored (the database clock).")
    delivered = models.BooleanField(default=False, help_text="The task was woken for it (or needs no waking).")

    objects = SelectedManager()

    class Meta:
        ordering = ["task_id", "id"]
        constraints = [models.UniqueConstraint(fields=["task_id", "name"], name="tasks_taskevent_task_name")]
        indexes = [models.Index(fields=["id"], name="tasks_taskevent_pending_idx", condition=models.Q(delivered=False))]

    def __str__(self) -> str:
        return f"event {self.name!r} to task {self.task_id}"
