"""The task queue: a task's lease lives on its own row, so claim, heartbeat and finish are each one
statement (see docs/explanation/design.md, "Statement shapes").

Status names follow ``django.tasks.TaskResultStatus`` (READY, RUNNING, SUCCESSFUL, FAILED) plus
CANCELLED. A failed attempt that will be retried goes back to READY with a later ``run_after``;
FAILED is terminal ("dead": out of attempts, or not retryable), with every attempt's error kept.

The queryset's operations, one statement each, are methods of its bases in
tasks/models/task_enqueue.py, task_attempts.py and task_actions.py. Why the model stays one module
of ~400 lines: a task row has that many columns, each with the comment that says what reads it."""

from __future__ import annotations

import datetime as dt
from typing import TYPE_CHECKING, Any

from django.db import connections, models
from django.db.models import Q
from django.db.models.functions import Now

from leasing.models import LeaseFields, LeaseStateQuerySet
from leasing.routing import SelectedManager
from tasks.exceptions import ArchivedTask
from tasks.lifecycle import workflows as wf_sql
from tasks.lifecycle.states import FINISHED, NOT_RUNNING_STATUSES, UNFINISHED, WAITING, TaskStatus
from tasks.models.bookkeeping import UniqueKey
from tasks.models.finished import FinishedOperations
from tasks.models.task_actions import ActionOperations
from tasks.models.task_attempts import AttemptOperations
from tasks.models.task_await import AwaitOperations
from tasks.models.task_enqueue import EnqueueOperations
from tasks.models.task_wait import WaitOperations

if TYPE_CHECKING:
    # typing.Self is 3.11+; annotations are not evaluated at run time (__future__), so no run-time dependency.
    from typing_extensions import Self


NOT_RUNNING = Q(status__in=NOT_RUNNING_STATUSES)


class FiniteDateTimeField(models.DateTimeField):
    """A timestamp read as None where the row holds ``infinity`` or ``-infinity``: PostgreSQL takes
    them (a hand edit, a restored dump), Python's datetime has no such value, and psycopg would refuse
    the whole row (a listing's 500, the API's 400). Written and compared as any DateTimeField."""

    def select_format(self, compiler: Any, sql: str, params: Any) -> tuple[str, Any]:
        # Every SELECT of the column (model rows, values(), an aggregate over it) goes through here.
        return f"CASE WHEN isfinite({sql}) THEN {sql} END", (*params, *params)

    def deconstruct(self) -> Any:
        # Migrations see a DateTimeField: reading it so changes no schema.
        name, _, args, kwargs = super().deconstruct()
        return name, "django.db.models.DateTimeField", args, kwargs


#: An attempt of the task failed or its worker died with it: a waiting task so marked is "retrying".
#: These counters change only in statements that also change the status (fail, recover, requeue),
#: never in a start marker, so an index on them costs the start marker nothing.
FAILED_BEFORE = Q(failures__gt=0) | Q(crashes__gt=0) | Q(shared_crashes__gt=0)
NEVER_FAILED = Q(failures=0, crashes=0, shared_crashes=0)


class TaskQuerySet(
    EnqueueOperations,
    AttemptOperations,
    ActionOperations,
    WaitOperations,
    AwaitOperations,
    FinishedOperations,
    LeaseStateQuerySet["Task"],
):
    """Task selection (chainable) and the queue's table-wide operations, one statement each: enqueue
    (tasks/models/task_enqueue.py), an attempt's life on the worker's hot path (task_attempts.py), the
    recovery round's sweeps and the operator's actions (task_actions.py), a caller's wait for a task to
    finish (task_wait.py; in async code, task_await.py), a lookup by id that finds a task moved to
    tasks_finished (finished.py)."""

    # -- selection ------------------------------------------------------------------------

    def ready(self) -> Self:
        return self.filter(status=TaskStatus.READY)

    def runnable(self) -> Self:
        return self.filter(status=TaskStatus.READY, run_after__lte=Now())

    def running(self) -> Self:
        return self.filter(status=TaskStatus.RUNNING)

    def stuck(self) -> Self:
        """Running, but with no live lease: the worker died or stalled and recovery has not run yet."""
        return self.filter(status=TaskStatus.RUNNING).filter(
            Q(expires_at__lte=Now()) | Q(expires_at__isnull=True) | Q(holder__isnull=True)
        )

    def finished(self) -> Self:
        return self.filter(status__in=FINISHED)

    def snoozed(self) -> Self:
        """Waiting after its handler snoozed it (it wakes at ``run_after``)."""
        return self.filter(status__in=WAITING, snoozed_at__isnull=False)

    def unfinished(self) -> Self:
        return self.filter(status__in=UNFINISHED)


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
    finished_at = FiniteDateTimeField(null=True, blank=True)
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
    debounce_key = models.CharField(
        max_length=255,
        null=True,
        blank=True,
        help_text="Debounced under this key: a later enqueue of the key replaces its arguments and pushes its "
        "start while it waits (see tasks/lifecycle/windows.py).",
    )
    debounce_until = models.DateTimeField(
        null=True,
        blank=True,
        help_text="The latest start a debounce may push it to: its first enqueue plus max_wait (empty: no cap).",
    )
    # NULL on a task that is not debounced: a plain row stores nothing for it (a NOT NULL default
    # would widen every row of the queue by 4 bytes).
    debounces = models.PositiveIntegerField(
        null=True, blank=True, help_text="Later enqueues of its debounce key folded into it while it waited."
    )
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
    retry_policy = models.JSONField(
        null=True,
        blank=True,
        help_text="The retry policy given at enqueue (max_attempts, retry_on, backoff as dotted paths).",
    )
    trace_context = models.JSONField(
        null=True,
        blank=True,
        editable=False,
        help_text="The enqueuing span's context (traceparent, tracestate) when tracing was on (tasks/tracing.py).",
    )
    snoozes = models.PositiveIntegerField(
        default=0, db_default=0, help_text="Times its handler snoozed it (uncharged: not counted in attempts)."
    )
    snoozed_at = models.DateTimeField(
        null=True, blank=True, help_text="When it last snoozed (until its next failure); it wakes at run_after."
    )
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
    rate_key = models.CharField(
        max_length=255,
        null=True,
        blank=True,
        help_text="Starts of tasks sharing this key are limited per sliding window (tasks/lifecycle/ratelimits.py).",
    )
    rate_limit = models.PositiveIntegerField(
        null=True, blank=True, help_text="Starts of its rate key allowed per rate_period (as enqueued)."
    )
    rate_period = models.FloatField(null=True, blank=True, help_text="The rate limit's window, in seconds.")
    rate_refusals = models.PositiveIntegerField(
        default=0, db_default=0, help_text="Starts its rate key refused (handed back uncharged, run_after pushed)."
    )
    # Set by a caller that waits for the task (tasks/models/task_wait.py): its final status then
    # NOTIFYs leasing_task_finished (the trigger of migration 0030); a row nobody waits for never does.
    finish_waited = models.BooleanField(
        default=False,
        db_default=False,
        help_text="A caller waits for this task to finish: its final status NOTIFYs leasing_task_finished.",
    )

    # Collation "C": keys are walked in byte order, which is Python's order of their code points (the
    # worker tells the last key it served by comparing them), whatever the database's collation.
    fair_key = models.CharField(
        max_length=255,
        db_collation="C",
        null=True,
        blank=True,
        help_text="Its key (tenant) in a fair queue: claims take turns between keys (tasks/lifecycle/statements.py).",
    )

    workflow_id = models.BigIntegerField(
        null=True, blank=True, help_text="The workflow this task belongs to (tasks/lifecycle/workflows.py)."
    )
    waiting_on = models.PositiveIntegerField(
        default=0,
        db_default=0,
        help_text="Tasks it depends on that are not final yet (Awaiting until 0); a group's callback is "
        "counted on its workflow instead (see parents_left).",
    )
    awaited_by = models.BigIntegerField(
        null=True,
        blank=True,
        help_text="The task that spawned this one (tasks.steps.spawn): when this one ends, its outcome is "
        "sent to that task as the event task:<id> (a trigger, tasks/migrations/0041_task_awaited_by.py).",
    )

    # The lease columns' plain index on holder (and its LIKE twin) is replaced by
    # tasks_task_holder_state_idx below (holder, status, id) of the rows a worker no longer runs, which
    # serves pages of a holder's tasks, newest first; its running rows are read from the running set.
    holder = models.CharField(max_length=200, null=True, blank=True)

    objects = SelectedManager.from_queryset(TaskQuerySet)()

    class Meta:
        ordering = ["-id"]
        indexes = [
            # Exactly the claim's WHERE + ORDER BY, per queue (see PICK_ONE in tasks/lifecycle/claim.py).
            models.Index(
                fields=["queue", "-priority", "run_after", "id", "shared_crashes"],
                name="tasks_task_claim_idx",
                condition=Q(status="READY"),
            ),
            # Fair queues (LEASING_TASKS["FAIR_QUEUES"]): the keys with READY tasks, walked one index probe
            # per key, and each key's tasks in its claim order (PICK_FAIR in tasks/lifecycle/claim.py). Unkeyed
            # rows are not in it: a plain queue's enqueue and claim never write to it.
            models.Index(
                "queue",
                "fair_key",
                models.F("priority").desc(),
                "run_after",
                "id",
                name="tasks_task_fair_idx",
                condition=Q(status="READY", fair_key__isnull=False),
            ),
            # The few READY tasks that crashed beside others: a busy worker's look for one that must run
            # isolated (ISOLATED_WAITING_SQL in tasks/lifecycle/claim.py); tiny whatever the backlog.
            models.Index(
                fields=["queue", "run_after"],
                name="tasks_task_isolation_idx",
                condition=Q(status="READY", shared_crashes__gt=0),
            ),
            # Recovery, the stuck list and every read of the running set: running rows by lease expiry.
            # A worker's running rows are read from it too (a set bounded by the workers): an index of
            # the running rows by holder would cost every claim and every renewal one entry more
            # (migrations 0042, 0045).
            models.Index(fields=["expires_at"], name="tasks_task_running_exp_idx", condition=Q(status="RUNNING")),
            # Running rows nobody holds (normally none: a claim always names its worker), the third arm
            # of the stuck list beside the expiry index's two, so that the list reads the stuck rows
            # and not every running one. Empty, so it costs a claim nothing.
            models.Index(
                fields=["id"], name="tasks_task_running_unheld_idx", condition=Q(status="RUNNING", holder__isnull=True)
            ),
            # A rate key's live reservations (RATE_START_SQL: a refusal's place in line is after the
            # latest of them, not after reservations of tasks since cancelled or deleted). Only rows
            # with a rate key of their own, waiting: a plain task never enters it.
            models.Index(
                fields=["rate_key", "run_after"],
                name="tasks_task_rate_line_idx",
                condition=Q(rate_key__isnull=False, status__in=["READY", "BLOCKED"]),
            ),
            # Dashboard lists and counts by state, newest first. Not the RUNNING rows: a set bounded by
            # the workers, read from the running indexes (lease expiry, holder), so that a claim and
            # each renewal write one entry less (migration 0044).
            models.Index(fields=["status", "-id"], name="tasks_task_state_idx", condition=~Q(status="RUNNING")),
            # Retention (tasks/maintenance/retention.py) deletes finished rows of one status oldest first, in
            # batches that resume from the last key: an exact range scan, whatever the other statuses keep.
            # Every read of finished rows by time reads it too (the minute and hour counts, the earliest
            # finish: one range per final status), so a finish writes no entry to an index of finished_at
            # alone (migration 0042).
            models.Index(
                fields=["status", "finished_at", "id"],
                name="tasks_task_prune_idx",
                condition=Q(finished_at__isnull=False),
            ),
            # Pages, newest first, by queue / task path / holder / dedup key within a status (see
            # tasks/web/listings.py): each is an ordered index scan that stops after one page, however
            # many tasks match. The queue and task-path indexes leave RUNNING rows out (a set
            # bounded by the workers, listed from the running indexes), so that claims and
            # heartbeats never write to them.
            models.Index(
                "queue", "status", models.F("id").desc(), name="tasks_task_queue_newest_idx", condition=NOT_RUNNING
            ),
            models.Index(
                "task_path", "status", models.F("id").desc(), name="tasks_task_path_newest_idx", condition=NOT_RUNNING
            ),
            # A holder's tasks but its running ones (not written when a task is enqueued, nor when it
            # is claimed or its lease renewed: migration 0045).
            models.Index(
                "holder",
                "status",
                models.F("id").desc(),
                name="tasks_task_holder_state_idx",
                condition=Q(holder__isnull=False) & ~Q(status="RUNNING"),
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
            # them: they are read from tasks_task_state_idx.) Not the snoozed ones: a task snoozed
            # after a failure is "snoozed" (its own index below), so that neither the retrying list
            # nor its count steps over them (migration 0043).
            models.Index(
                models.F("id").desc(),
                name="tasks_task_retry_idx",
                condition=Q(status="READY", snoozed_at__isnull=True) & FAILED_BEFORE,
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
            # A workflow's members by status, newest first (the workflow page, its cancel, retention of the unit).
            models.Index(
                "workflow_id",
                "status",
                models.F("id").desc(),
                name="tasks_task_workflow_idx",
                condition=Q(workflow_id__isnull=False),
            ),
            # Waiting tasks their handler snoozed, newest first (the dashboard's "snoozed" list and
            # count, as tasks_task_retry_idx for "retrying"): only those waiting after a snooze. A
            # claim leaves the entry (status leaves the predicate); a failure clears snoozed_at.
            models.Index(
                models.F("id").desc(),
                name="tasks_task_snoozed_idx",
                condition=Q(status="READY", snoozed_at__isnull=False),
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
            # At most one *waiting, never claimed* task per task path and debounce key: the arbiter of
            # ENQUEUE_DEBOUNCE_SQL's upsert. A claim (the only statement that bumps ``transitions``) takes
            # a task out for good, so the next enqueue of the key inserts a new task, and a claimed task
            # that waits again (a retry, a hand-back, recovery, a requeue) never meets the key's newer one.
            # The task path is part of the key: an enqueue of one path never rewrites the arguments of
            # another's task (a JSON API client could otherwise feed a path it may not enqueue).
            models.UniqueConstraint(
                fields=["task_path", "debounce_key"],
                condition=Q(status__in=["BLOCKED", "READY"], debounce_key__isnull=False, transitions=0),
                name="tasks_task_debounce_waiting",
            ),
            models.CheckConstraint(
                condition=Q(priority__gte=-100, priority__lte=100), name="tasks_task_priority_range"
            ),
        ]

    #: True on a row read from tasks_finished (``Task.objects.find``): history, read-only. Its
    #: ``save()`` is refused (an UPDATE of tasks_task would find no row and INSERT it there again);
    #: a ``delete()`` deletes nothing (no such row in tasks_task): retention drops its day whole.
    archived = False

    def save(self, *args: Any, **kwargs: Any) -> None:
        if self.archived:
            raise ArchivedTask(f"task {self.pk} is kept in tasks_finished: its row is history and is not saved")
        super().save(*args, **kwargs)

    def __str__(self) -> str:
        # The status by its label, as every page names it (tasks/lifecycle/vocabulary.py): the admin
        # titles its change, history and delete pages with this.
        return f"task {self.pk} {self.task_path} [{self.get_status_display()}]"

    @property
    def parents_left(self) -> int:
        """How many of the tasks it depends on are not final yet. A group's callback (AWAITING with
        ``waiting_on`` 0) is counted on its workflow row (``callback_waiting``)."""
        if self.status != TaskStatus.AWAITING:
            return 0
        if self.waiting_on or self.workflow_id is None:
            return self.waiting_on
        with connections[self._state.db or "default"].cursor() as cursor:
            cursor.execute(wf_sql.CALLBACK_WAITING_SQL, {"id": self.workflow_id, "task": self.id})
            row = cursor.fetchone()
        return int(row[0]) if row else 0

    def unique_window(self) -> UniqueKey | None:
        """The unique_for window this task opened, while it is open (tasks/lifecycle/windows.py): one
        primary-key probe, none for a task without a dedup key."""
        if self.dedup_key is None:
            return None
        return (
            UniqueKey.objects.using(self._state.db or "default")
            .filter(key=self.dedup_key, task_id=self.pk, expires_at__gt=Now())
            .first()
        )

    @property
    def is_snoozed(self) -> bool:
        """Waiting after its handler snoozed it; it wakes at ``run_after``."""
        return self.status in WAITING and self.snoozed_at is not None

    @property
    def cancel_reason(self) -> str | None:
        """Why its handler cancelled it (:class:`tasks.exceptions.Cancel`), if it did."""
        last = self.errors[-1] if self.status == TaskStatus.CANCELLED and self.errors else None
        return last.get("message", "") if isinstance(last, dict) and last.get("kind") == "cancel" else None

    @property
    def is_stuck(self) -> bool:
        """Running with no live lease: judged at the database's clock of the read when it was read
        :func:`tasks.lifecycle.states.with_db_clock`, else at this process's clock."""
        if self.status != TaskStatus.RUNNING:
            return False
        now = self.__dict__.get("db_now") or dt.datetime.now(dt.timezone.utc)
        return self.expires_at is None or self.holder is None or self.expires_at <= now
