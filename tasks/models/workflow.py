"""Workflows: tasks that wait for other tasks (chains, groups with a callback, dependency graphs).

A workflow row counts its members; an edge row says that a task waits for another. Everything that
moves a member is the database's doing: when a member reaches a final status, the statement that
put it there also releases, cancels or counts down its dependants and counts it on its workflow
(migration 0016's triggers; ``tasks/lifecycle/workflows.py`` says how and why). So a callback is
released exactly once, by the statement that finished the last member it waited for, whichever
worker, operator or recovery round that was.

The builder that enqueues workflows is ``tasks.workflows``; these are the rows it writes.
"""

from __future__ import annotations

from django.db import connections, models, transaction
from django.db.models import Q
from django.db.models.functions import Now

from leasing.routing import SelectedManager
from tasks.lifecycle.states import UNFINISHED
from tasks.lifecycle.workflows import MARK_CANCELLED_SQL, ON_PARENT_FAILURE, WorkflowKind, WorkflowStatus
from tasks.models.task import FiniteDateTimeField


class WorkflowQuerySet(models.QuerySet["Workflow"]):
    def cancel(self) -> int:
        """Cancel these workflows: every unfinished member is cancelled (a running member's worker
        loses its lease), and each workflow that had one ends CANCELLED. Returns the members
        cancelled.

        Locks are taken in the order every finishing statement takes them: a workflow's members in
        id order, then (through their trigger) the workflow row; one workflow at a time."""
        from tasks.models.task import Task

        db = self.db
        cancelled = 0
        for workflow in sorted(self.filter(status=WorkflowStatus.RUNNING).values_list("id", flat=True)):
            with transaction.atomic(using=db):
                members = Task.objects.db_manager(db).filter(workflow_id=workflow, status__in=UNFINISHED)
                ids = list(members.order_by("id").select_for_update(no_key=True).values_list("id", flat=True))
                if not ids:
                    continue
                cancelled += Task.objects.db_manager(db).filter(pk__in=ids).cancel()
                with connections[db].cursor() as cursor:
                    cursor.execute(MARK_CANCELLED_SQL, {"ids": [workflow]})
        return cancelled


class Workflow(models.Model):
    """A set of tasks enqueued together, some waiting for others."""

    name = models.CharField(max_length=200, blank=True, default="")
    kind = models.CharField(max_length=10, choices=WorkflowKind.choices, default=WorkflowKind.GRAPH)
    status = models.CharField(max_length=12, choices=WorkflowStatus.choices, default=WorkflowStatus.RUNNING)
    total = models.PositiveIntegerField(default=0, help_text="Members.")
    remaining = models.PositiveIntegerField(default=0, help_text="Members not final yet.")
    callback_waiting = models.PositiveIntegerField(
        default=0, db_default=0, help_text="A group's callback: the members it waits for that are not final yet."
    )
    callback_only = models.BooleanField(
        default=False,
        db_default=False,
        help_text="A group nothing joined since: its members' one dependant is its callback, counted on "
        "callback_waiting (their finishes read no edges).",
    )
    failed = models.PositiveIntegerField(default=0, help_text="Members that ended Failed or Cancelled.")
    callback_id = models.BigIntegerField(
        null=True,
        blank=True,
        help_text="The task run when the others are final (a group's callback, a chain's last step).",
    )
    created_at = models.DateTimeField(db_default=Now())
    # Read as None where a hand edit left infinity or -infinity, as a task's finish time is.
    finished_at = FiniteDateTimeField(null=True, blank=True, help_text="When the last member became final.")

    objects = SelectedManager.from_queryset(WorkflowQuerySet)()

    class Meta:
        ordering = ["-id"]
        indexes = [
            models.Index("status", models.F("id").desc(), name="tasks_workflow_status_idx"),
            # Retention: finished workflows of one status, oldest first (tasks/maintenance/retention.py).
            models.Index(
                fields=["status", "finished_at", "id"],
                name="tasks_workflow_prune_idx",
                condition=Q(finished_at__isnull=False),
            ),
        ]

    def __str__(self) -> str:
        label = self.name or self.get_kind_display().lower()
        return f"workflow {self.pk} {label} [{self.get_status_display()}]"  # the status's label, as pages say it

    @property
    def succeeded(self) -> int:
        return self.total - self.remaining - self.failed

    @property
    def callback_role(self) -> str:
        """What the task of ``callback_id`` is to a reader: a chain has no callback, its last step
        ends it; a group's (or a graph's) is its callback."""
        return "last step" if self.kind == WorkflowKind.CHAIN else "callback"


class TaskDependency(models.Model):
    """``child`` waits for ``parent``: it runs once every parent is final (SUCCESSFUL, or any final
    status under ``on_failure="run"``); a parent that failed or was cancelled cancels it under
    ``on_failure="cancel"``. ``pipe``: the child receives its parents' return values as its first
    positional argument (one parent: the value; several: a list in parent id order)."""

    parent_id = models.BigIntegerField()
    child_id = models.BigIntegerField()
    on_failure = models.CharField(max_length=6, choices=[(p, p) for p in ON_PARENT_FAILURE], default="cancel")
    pipe = models.BooleanField(default=False)

    objects = SelectedManager()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["parent_id", "child_id"], name="tasks_dependency_edge_uniq")]
        indexes = [models.Index(fields=["child_id", "parent_id"], name="tasks_dependency_child_idx")]

    def __str__(self) -> str:
        return f"{self.child_id} after {self.parent_id}"
