"""Rows the queue keeps for itself: the demo generator's state, concurrency keys (their counts,
wakes and kept slots), rate keys (their windows) and per-minute activity."""

from __future__ import annotations

from typing import Any

from django.db import models
from django.db.models import Q
from django.db.models.functions import Now

from leasing.fencing import FencedModel
from leasing.routing import SelectedManager


class GeneratorState(FencedModel):
    """The demo generator, shared by every replica through the database.

    ``running``, ``rate`` and ``max_sleep`` are the desired state: any replica may change them.
    The ``leader*`` fields, ``ticks``, ``observed_running`` and ``generated`` are written only by
    the instance that holds the generator lease, through a fenced update, so a deposed leader
    cannot keep generating.
    """

    name = models.CharField(max_length=100, primary_key=True, default="default")
    running = models.BooleanField(default=False)
    rate = models.FloatField(default=2.0, help_text="Tasks per second while running.")
    max_sleep = models.FloatField(default=3.0, help_text="Largest sleep_duration_seconds of a generated task.")
    queue = models.CharField(max_length=100, default="default")
    updated_at = models.DateTimeField(auto_now=True)
    generated = models.BigIntegerField(default=0)
    leader = models.CharField(max_length=200, blank=True, default="")
    leader_seen_at = models.DateTimeField(null=True, blank=True)
    observed_running = models.BooleanField(default=False)
    ticks = models.BigIntegerField(default=0)

    def __str__(self) -> str:
        return f"generator {self.name}: {'running' if self.running else 'stopped'} at {self.rate}/s"


#: How long ``pause`` waits for claims in flight (and makes new claims wait) before giving up.


class ConcurrencyKey(models.Model):
    """A concurrency key's limit, and the row whose lock serialises admissions to the key.

    Rows are created by the first enqueue of a key; the counts are never stored here: a key's
    admitted tasks are counted from tasks_task under this row's lock (see tasks/lifecycle/concurrency.py).
    """

    key = models.CharField(max_length=255, primary_key=True)
    max_running = models.PositiveIntegerField(help_text="Tasks of the key admitted (Ready or Running) at most.")
    updated_at = models.DateTimeField(help_text="When an enqueue last set the limit.")
    limit_task_id = models.BigIntegerField(
        null=True, blank=True, help_text="The task whose enqueue set the limit (a later enqueue has a larger id)."
    )
    wake_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="When the sweep must admit for the key: its first deferred task comes due and a slot is free.",
    )

    class Meta:
        ordering = ["key"]
        indexes = [
            # The recovery round forgets keys idle for a while, oldest first (tasks/lifecycle/concurrency.py).
            models.Index(fields=["updated_at"], name="tasks_concurrencykey_idle_idx"),
            # The sweep reads the keys due now, and only those, whatever the number of keys.
            models.Index(fields=["wake_at"], name="tasks_concurrencykey_wake_idx", condition=Q(wake_at__isnull=False)),
        ]

    def __str__(self) -> str:
        return f"concurrency key {self.key}: at most {self.max_running}"


class ConcurrencyWake(models.Model):
    """An admission that found its key's row locked by another transaction (an application's open
    transaction that enqueued a task of the key) and did not wait for it: the next admission of the
    key, or the recovery round's sweep, admits for it and deletes the row. Carries the limit of a
    skipped enqueue, applied then if no later enqueue set another (tasks/lifecycle/concurrency.py)."""

    id = models.BigAutoField(primary_key=True)
    key = models.CharField(max_length=255)
    max_running = models.PositiveIntegerField(null=True, blank=True)
    limit_task_id = models.BigIntegerField(null=True, blank=True)
    noted_at = models.DateTimeField(db_default=Now())

    class Meta:
        indexes = [models.Index(fields=["key"], name="tasks_concurrencywake_key_idx")]

    def __str__(self) -> str:
        return f"admission of {self.key} skipped at {self.noted_at}"


class ConcurrencyHold(models.Model):
    """A concurrency slot kept for a handler that may still be running after its task's row stopped
    counting: a timed-out attempt whose thread cannot be stopped (or a cancelled coroutine that has not
    ended yet), or an attempt whose lease lapsed while its worker lived on. The admission counts these
    with the key's READY and RUNNING tasks, so a key's limit bounds its handlers running, not only its
    rows. Deleted when the handler returns, or by recovery once the worker is stopped or presumed dead
    (tasks/lifecycle/concurrency.py, "Handlers that outlive their row")."""

    id = models.BigAutoField(primary_key=True)
    key = models.CharField(max_length=255)
    task_id = models.BigIntegerField()
    token = models.BigIntegerField(help_text="The attempt's fencing token.")
    worker = models.CharField(max_length=200, help_text="The worker (incarnation) whose handler is running.")
    reason = models.CharField(max_length=20, help_text="timeout or lapsed")
    since = models.DateTimeField(db_default=Now())

    class Meta:
        constraints = [models.UniqueConstraint(fields=["task_id", "token"], name="tasks_concurrencyhold_attempt")]
        indexes = [
            models.Index(fields=["key"], name="tasks_conchold_key_idx"),
            models.Index(fields=["worker"], name="tasks_conchold_worker_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.key}: slot kept for task {self.task_id} (token {self.token}) on {self.worker}"


class GrantTimes(models.Field):
    """A ``timestamptz[]`` column, read and written by SQL only (django.contrib.postgres's ArrayField
    would make every project add that app to INSTALLED_APPS)."""

    description = "an array of timestamps"

    def db_type(self, connection: Any) -> str:
        return "timestamptz[]"


class RateLimit(models.Model):
    """A rate key's sliding window: the grant times of the starts in the last ``period`` (at most
    ``max_starts`` of them, oldest first), and the row whose lock serialises the key's grants. Written
    only by the rate start (RATE_START_SQL, tasks/lifecycle/ratelimits.py)."""

    key = models.CharField(max_length=255, primary_key=True)
    max_starts = models.PositiveIntegerField(help_text="Starts allowed in any window of ``period`` (the last start's).")
    period = models.FloatField(help_text="The window, in seconds (the last start's).")
    starts = GrantTimes(default=list, help_text="Grant times within the last period, oldest first.")
    next_due = models.DateTimeField(
        help_text="Where the next refused start is sent: refusals are spread period / max_starts apart."
    )
    grants = models.BigIntegerField(default=0, help_text="Starts granted (ever).")
    refusals = models.BigIntegerField(default=0, help_text="Starts refused and handed back uncharged (ever).")
    retry_at = models.DateTimeField(null=True, blank=True, help_text="Where the last refused start was sent.")
    promised_until = models.DateTimeField(
        null=True,
        blank=True,
        help_text="The latest start promised to a task back from the line whose start was not free yet: the next"
        " such task is given the start after it (its place in line kept).",
    )
    decided_at = models.DateTimeField(help_text="The database clock at the last grant or refusal.")
    granted = models.BooleanField(help_text="Whether the last decision granted its start.")

    class Meta:
        indexes = [
            # The recovery round forgets keys idle for a while, oldest first (tasks/lifecycle/ratelimits.py).
            models.Index(fields=["decided_at"], name="tasks_ratelimit_idle_idx"),
        ]

    def __str__(self) -> str:
        return f"rate key {self.key}: at most {self.max_starts} per {self.period:g}s"


class ActivityMinute(models.Model):
    """One minute of queue activity: the rollup behind the dashboard chart and ``/metrics``.

    ``succeeded`` and ``failed`` are counted once from the finished-at index when the minute has
    closed (``closed``), and counted again a few minutes later (``final``) to take in finishes
    whose transaction committed late; pages then read these rows instead of every task finished in
    the last hour. ``recovered`` and the recovery timings are added by the recovery statement itself,
    so they are exact at once. See tasks/lifecycle/activity.py.
    """

    minute = models.DateTimeField(primary_key=True)
    succeeded = models.BigIntegerField(default=0)
    failed = models.BigIntegerField(default=0, help_text="Tasks that failed for good (Failed).")
    closed = models.BooleanField(default=False, help_text="succeeded and failed are counted.")
    final = models.BooleanField(default=False, help_text="Counted again after late commits could land.")
    recovered = models.BigIntegerField(default=0, help_text="Tasks requeued (or failed) after their lease expired.")
    silent_total = models.FloatField(default=0.0, help_text="Sum of seconds from last heartbeat to recovery.")
    silent_max = models.FloatField(default=0.0)
    delay_max = models.FloatField(default=0.0, help_text="Longest expiry-to-recovery delay, seconds.")

    objects = SelectedManager()

    class Meta:
        ordering = ["-minute"]

    def __str__(self) -> str:
        return f"{self.minute:%Y-%m-%d %H:%M}: {self.succeeded} succeeded, {self.failed} failed"


class BucketCounts(models.Field):
    """A ``bigint[]`` column: counts per histogram bucket, written and read by SQL only. Not
    contrib.postgres's ArrayField, which would make every project add ``django.contrib.postgres``
    to INSTALLED_APPS for two columns no ORM lookup reads (psycopg maps lists to arrays itself)."""

    def db_type(self, connection: Any) -> str:
        return "bigint[]"


class ActivityHour(models.Model):
    """One hour of finished tasks of one queue and task path: the rollup behind the history page.

    Written by the recovery leader once the hour has been over for a few minutes, in one statement
    that recomputes the whole hour from the finished-at index and overwrites the rows (a rerun or a
    second leader writes the same numbers: nothing is counted twice). Wait and run times are kept as
    fixed histograms (``tasks.maintenance.history.BOUNDS``) so that percentiles over any set of
    hours and keys come from summed buckets. See tasks/maintenance/history.py.
    """

    id = models.BigAutoField(primary_key=True)
    hour = models.DateTimeField()
    queue = models.CharField(max_length=100)
    task_path = models.CharField(max_length=255)
    succeeded = models.BigIntegerField(default=0)
    failed = models.BigIntegerField(default=0, help_text="Tasks that failed for good (Failed).")
    cancelled = models.BigIntegerField(default=0)
    attempt_failures = models.BigIntegerField(
        default=0, help_text="Attempts that failed (the handler's own failures) of the tasks finished in the hour."
    )
    timed = models.BigIntegerField(default=0, help_text="Tasks with a wait and run time (an attempt started).")
    wait_sum = models.FloatField(default=0.0)
    wait_max = models.FloatField(default=0.0)
    run_sum = models.FloatField(default=0.0)
    run_max = models.FloatField(default=0.0)
    wait_buckets = BucketCounts(help_text="Tasks per wait-time bucket (seconds, BOUNDS).")
    run_buckets = BucketCounts(help_text="Tasks per run-time bucket (seconds, BOUNDS).")

    objects = SelectedManager()

    class Meta:
        constraints = [
            # The upsert's conflict target, and the page's index: a range of hours, then the keys.
            models.UniqueConstraint(fields=["hour", "queue", "task_path"], name="tasks_activityhour_key")
        ]

    def __str__(self) -> str:
        return f"{self.hour:%Y-%m-%d %H:00} {self.queue} {self.task_path}: {self.succeeded} ok, {self.failed} failed"


class ActivityHourMark(models.Model):
    """An hour the history rollup has counted (zero tasks included): the rounds skip it."""

    hour = models.DateTimeField(primary_key=True)
    counted_at = models.DateTimeField()
    keys = models.IntegerField(default=0, help_text="(queue, task path) rows written for the hour.")
    tasks = models.BigIntegerField(default=0, help_text="Tasks finished in the hour.")

    objects = SelectedManager()

    class Meta:
        ordering = ["-hour"]

    def __str__(self) -> str:
        return f"{self.hour:%Y-%m-%d %H:00}: {self.tasks} tasks counted"


class UniqueKey(models.Model):
    """The window of a key enqueued with ``unique_for``: no second task of the key is accepted
    before ``expires_at``, finished or not (see tasks/lifecycle/windows.py).

    One row per key, replaced in place by the enqueue that opens the next window (an upsert whose
    DO UPDATE fires only once this one has passed); retention deletes rows whose window has passed.
    """

    key = models.CharField(max_length=255, primary_key=True)
    task_id = models.BigIntegerField(help_text="The task the window's enqueue created (it may since be pruned).")
    accepted_at = models.DateTimeField(help_text="When the enqueue that opened the window was accepted.")
    expires_at = models.DateTimeField(help_text="The window ends: the next enqueue of the key is accepted.")

    class Meta:
        ordering = ["key"]
        indexes = [
            # Retention deletes the rows whose window passed, oldest first (tasks/maintenance/retention.py).
            models.Index(fields=["expires_at", "key"], name="tasks_uniquekey_expires_idx"),
        ]

    def __str__(self) -> str:
        return f"unique key {self.key}: task {self.task_id} until {self.expires_at:%Y-%m-%d %H:%M:%S}"

    @property
    def seconds(self) -> float:
        """The window's length as asked (``unique_for``), to the millisecond: its two ends are two
        reads of the database clock in one statement, which may lie a few microseconds further
        apart than the window (a 90 s window read 90.000004 s, shown as "90.0")."""
        return round((self.expires_at - self.accepted_at).total_seconds(), 3)


class Repair(models.Model):
    """What the recovery round's repair sweep found stranded and set right, by kind: a count that
    should stay zero (every repair is a bug report: docs/monitoring/alerts.yml fires on one), and the
    last task repaired, to start from (tasks/maintenance/repair.py)."""

    kind = models.CharField(max_length=50, primary_key=True)
    count = models.BigIntegerField(default=0, help_text="Rows repaired (ever).")
    last_at = models.DateTimeField(help_text="When the last repair of this kind was made.")
    last_task_id = models.BigIntegerField(null=True, blank=True, help_text="The last task repaired.")

    class Meta:
        ordering = ["kind"]

    def __str__(self) -> str:
        return f"repair {self.kind}: {self.count} (last: task {self.last_task_id})"


class ArchiveProgress(models.Model):
    """How far the mover (tasks/maintenance/archive.py) has come, per final status: every plain task
    of the status that finished before ``moved_until`` has left tasks_task, but for a row another
    session held as the pass went by (the next full pass takes it, at most an hour later). Written by
    the recovery leader after each batch that moved rows and at the end of each pass (never backwards:
    a full pass from the oldest day kept leaves it where it was); read by ``/metrics``
    (``tasks_archive_behind_seconds``) and ``manage.py tasks_partitions list``."""

    status = models.CharField(max_length=12, primary_key=True)
    moved_until = models.DateTimeField(help_text="Every plain task of the status finished before this has moved.")
    recorded_at = models.DateTimeField(help_text="When the mover last wrote this row (the database clock).")
    moved = models.BigIntegerField(default=0, help_text="Rows of the status moved (ever).")

    objects = SelectedManager()

    class Meta:
        ordering = ["status"]

    def __str__(self) -> str:
        return f"{self.status}: moved until {self.moved_until:%Y-%m-%d %H:%M:%S}"
