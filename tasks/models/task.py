"""The task queue: a task's lease lives on its own row, so claim, heartbeat and finish are each one
statement (see docs/explanation/design.md, "Statement shapes").

Status names follow ``django.tasks.TaskResultStatus`` (READY, RUNNING, SUCCESSFUL, FAILED) plus
CANCELLED. A failed attempt that will be retried goes back to READY with a later ``run_after``;
FAILED is terminal ("dead": out of attempts, or not retryable), with every attempt's error kept."""

from __future__ import annotations

import datetime as dt

from django.db import models
from django.db.models import Q
from django.db.models.functions import Now

from leasing.models import LeaseFields
from leasing.routing import SelectedManager
from tasks.lifecycle.states import TaskStatus
from tasks.models.queryset import FAILED_BEFORE, NOT_RUNNING, TaskQuerySet


class Task(LeaseFields):
    """One unit of work. The lease columns (holder = worker id, token, expires_at …) are the
    claim of the worker running it."""

    queue = models.CharField(max_length=100, default="default")
    priority = models.SmallIntegerField(default=0)
    task_path = models.CharField(max_length=255, help_text="Import path of the callable or django.tasks Task.")
    args = models.JSONField(default=list, blank=True)
    kwargs = models.JSONField(default=dict, blank=True, help_text="Keyword arguments: the task's payload.")
    status = models.CharField(max_length=12, choices=TaskStatus.choices, default=TaskStatus.READY)
    run_after = models.DateTimeField(db_default=Now(), help_text="Earliest time the task may run.")
    enqueued_at = models.DateTimeField(db_default=Now())
    started_at = models.DateTimeField(null=True, blank=True, help_text="First attempt's start.")
    last_attempted_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    attempts = models.PositiveIntegerField(default=0, help_text="Attempts that started (charged or not).")
    max_attempts = models.PositiveIntegerField(default=3, help_text="Failed attempts (the handler's own) allowed.")
    failures = models.PositiveIntegerField(default=0, help_text="Attempts that ended in the handler's own failure.")
    crashes = models.PositiveIntegerField(
        default=0, help_text="Started attempts whose worker vanished (lease expired); bounded by MAX_CRASHES."
    )
    shared_crashes = models.PositiveIntegerField(
        default=0, help_text="Started attempts whose worker vanished beside other attempts (not charged)."
    )
    attempt_isolated = models.BooleanField(default=False, help_text="The current attempt runs alone in its process.")
    unstarted_returns = models.PositiveIntegerField(
        default=0, help_text="Claims returned unstarted after their worker vanished (uncharged; makes it a suspect)."
    )
    attempt_started = models.BooleanField(default=False, help_text="The current claim's attempt has begun.")
    timeout = models.FloatField(null=True, blank=True, help_text="Seconds an attempt may run.")
    dedup_key = models.CharField(max_length=255, null=True, blank=True)
    return_value = models.JSONField(null=True, blank=True)
    errors = models.JSONField(
        default=list,
        blank=True,
        help_text="How attempts ended (class, message, traceback): the first and the newest, at most ten.",
    )
    errors_dropped = models.IntegerField(
        default=0, db_default=0, help_text="Error entries dropped from the middle of the history to bound it."
    )
    worker_ids = models.JSONField(default=list, blank=True, help_text="The worker of each attempt.")
    progress = models.JSONField(null=True, blank=True, help_text="The last checkpoint.")
    progress_at = models.DateTimeField(null=True, blank=True)
    backend_alias = models.CharField(
        max_length=100,
        null=True,
        blank=True,
        help_text="The django.tasks backend alias that enqueued it (empty: Task.objects.enqueue, any callable).",
    )
    task_run_after = models.DateTimeField(
        null=True,
        blank=True,
        help_text="The run_after the django.tasks Task was enqueued with (run_after itself moves with retries).",
    )
    api_origin = models.BooleanField(
        default=False,
        db_default=False,
        help_text="Enqueued through the JSON API: workers check its path against the API allow-list first.",
    )
    concurrency_key = models.CharField(
        max_length=255,
        null=True,
        blank=True,
        help_text="Tasks sharing this key run at most concurrency_limit at once (see tasks/lifecycle/concurrency.py).",
    )
    concurrency_limit = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="The key's limit as this task was enqueued with it (the latest enqueue sets it).",
    )

    # The lease columns' plain index on holder (and its LIKE twin) is replaced by
    # tasks_task_holder_newest_idx below (holder, status, id), which serves the same lookups and also
    # pages of a holder's tasks, newest first: one index write less per claim, heartbeat and finish.
    holder = models.CharField(max_length=200, null=True, blank=True)

    objects = SelectedManager.from_queryset(TaskQuerySet)()

    class Meta:
        ordering = ["-id"]
        indexes = [
            # Exactly the claim's WHERE + ORDER BY, per queue (see _PICK_ONE in statements.py).
            models.Index(
                fields=["queue", "-priority", "run_after", "id", "shared_crashes"],
                name="tasks_task_claim_idx",
                condition=Q(status="READY"),
            ),
            # The few READY tasks that crashed beside others: a busy worker's look for one that must run
            # isolated (ISOLATED_WAITING_SQL in statements.py); tiny whatever the backlog.
            models.Index(
                fields=["queue", "run_after"],
                name="tasks_task_isolation_idx",
                condition=Q(status="READY", shared_crashes__gt=0),
            ),
            # Recovery and the stuck list: running rows by lease expiry.
            models.Index(fields=["expires_at"], name="tasks_task_running_exp_idx", condition=Q(status="RUNNING")),
            models.Index(fields=["holder"], name="tasks_task_running_holder_idx", condition=Q(status="RUNNING")),
            # Dashboard lists and counts by state, newest first.
            models.Index(fields=["status", "-id"], name="tasks_task_status_idx"),
            models.Index(
                fields=["finished_at"], name="tasks_task_finished_idx", condition=Q(finished_at__isnull=False)
            ),
            # Retention (tasks/maintenance/retention.py) deletes finished rows of one status oldest first, in
            # batches that resume from the last key: an exact range scan, whatever the other statuses keep.
            models.Index(
                fields=["status", "finished_at", "id"],
                name="tasks_task_prune_idx",
                condition=Q(finished_at__isnull=False),
            ),
            # Pages, newest first, by queue / task path / holder / dedup key within a status (see
            # tasks/web/queries.py): each is an ordered index scan that stops after one page, however
            # many tasks match. The queue and task-path indexes leave RUNNING rows out (a set
            # bounded by the workers, listed from the running indexes), so that claims and
            # heartbeats never write to them.
            models.Index(
                "queue", "status", models.F("id").desc(), name="tasks_task_queue_newest_idx", condition=NOT_RUNNING
            ),
            models.Index(
                "task_path", "status", models.F("id").desc(), name="tasks_task_path_newest_idx", condition=NOT_RUNNING
            ),
            models.Index(
                "holder",
                "status",
                models.F("id").desc(),
                name="tasks_task_holder_newest_idx",
                condition=Q(holder__isnull=False),  # not written when a task is enqueued
            ),
            models.Index(
                "dedup_key",
                "status",
                models.F("id").desc(),
                name="tasks_task_dedup_newest_idx",
                condition=Q(dedup_key__isnull=False),
            ),
            # Waiting tasks that failed before ("retrying"), newest first: few, and written only when
            # a task fails or is recovered. (The rest of the waiting tasks, "pending", are most of
            # them: they are read from tasks_task_status_idx.)
            models.Index(
                models.F("id").desc(), name="tasks_task_retrying_idx", condition=Q(status="READY") & FAILED_BEFORE
            ),
            # Concurrency keys (tasks/lifecycle/concurrency.py): a key's waiting tasks in admission order, and
            # its admitted ones (READY or RUNNING: at most its limit, counted under the key's row
            # lock). Unkeyed rows are in neither, so they cost the claim and the finish nothing.
            models.Index(
                "concurrency_key",
                models.F("priority").desc(),
                "run_after",
                "id",
                name="tasks_task_blocked_idx",
                condition=Q(status="BLOCKED"),
            ),
            models.Index(
                fields=["concurrency_key"],
                name="tasks_task_slot_idx",
                condition=Q(status__in=["READY", "RUNNING"], concurrency_key__isnull=False),
            ),
            # Pages of blocked tasks by queue, newest first (the other page indexes leave BLOCKED out).
            models.Index(
                "queue",
                "status",
                models.F("id").desc(),
                name="tasks_task_blocked_page_idx",
                condition=Q(status="BLOCKED"),
            ),
            # The repair sweep looks for leases left live on rows that are not running: normally none.
            models.Index(
                fields=["id"],
                name="tasks_task_stray_lease_idx",
                condition=Q(released_at__isnull=True, expires_at__isnull=False) & ~Q(status="RUNNING"),
            ),
        ]
        constraints = [
            models.UniqueConstraint(
                fields=["dedup_key"],
                condition=Q(status__in=["BLOCKED", "READY", "RUNNING"], dedup_key__isnull=False),
                name="tasks_task_dedup_unfinished",
            ),
            models.CheckConstraint(
                condition=Q(priority__gte=-100, priority__lte=100), name="tasks_task_priority_range"
            ),
        ]

    def __str__(self) -> str:
        return f"task {self.pk} {self.task_path} [{self.status}]"

    @property
    def is_stuck(self) -> bool:
        if self.status != TaskStatus.RUNNING:
            return False
        return self.expires_at is None or self.holder is None or self.expires_at <= dt.datetime.now(dt.UTC)
