"""A worker process's row: its incarnation id, name, host and pid, heartbeat and stop."""

from __future__ import annotations

from typing import Any

from django.db import connections, models
from django.db.models import Q
from django.db.models.functions import Now

from leasing.routing import SelectedManager
from tasks.lifecycle import statements as sql


class Tokens(models.Field):
    """A ``bigint[]`` column of fencing tokens, written and read by SQL only (not contrib.postgres's
    ArrayField, which would make every project add ``django.contrib.postgres`` to INSTALLED_APPS)."""

    description = "an array of fencing tokens"

    def db_type(self, connection: Any) -> str:
        return "bigint[]"


class WorkerQuerySet(models.QuerySet["Worker"]):
    def mark_dead(self) -> list[str]:
        """Workers silent for more than twice their TTL are recorded as stopped, with the reason."""
        with connections[self.db].cursor() as cursor:
            cursor.execute(sql.MARK_DEAD_WORKERS_SQL, {})
            return [row[0] for row in cursor.fetchall()]


class Worker(models.Model):
    """A worker process, as it last reported itself (registered at start, seen at each heartbeat)."""

    id = models.CharField(
        max_length=200, primary_key=True, help_text="This process's lifetime: its name and a suffix new at each start."
    )
    name = models.CharField(
        max_length=200, blank=True, default="", help_text="What it was started as (--worker-id); restarts reuse it."
    )
    hostname = models.CharField(max_length=255)
    pid = models.PositiveIntegerField()
    queues = models.JSONField(default=list)
    concurrency = models.PositiveIntegerField()
    started_at = models.DateTimeField(db_default=Now())
    last_seen_at = models.DateTimeField(db_default=Now())
    previous_seen_at = models.DateTimeField(null=True, blank=True, help_text="The heartbeat before the last.")
    stopped_at = models.DateTimeField(null=True, blank=True)
    running = models.PositiveIntegerField(default=0, help_text="Tasks held at the last heartbeat.")
    stats = models.JSONField(default=dict, blank=True, help_text="Counters: succeeded, failed, rejected, lost.")
    ttl = models.FloatField(default=30.0, help_text="Lease TTL of its tasks; silent for 2 x TTL means dead.")
    stop_reason = models.CharField(max_length=200, blank=True, default="")
    handed = Tokens(
        null=True,
        blank=True,
        editable=False,
        help_text="Tokens of the attempts it handed to its executors whose start is not recorded on their row yet:"
        " recovery counts them as attempts that may have run (tasks/worker/handoff.py).",
    )

    objects = SelectedManager.from_queryset(WorkerQuerySet)()

    class Meta:
        ordering = ["-started_at"]
        indexes = [
            models.Index(fields=["last_seen_at"], name="tasks_worker_live_idx", condition=Q(stopped_at__isnull=True)),
            # Retention: stopped and dead workers, oldest first.
            models.Index(fields=["stopped_at"], name="tasks_worker_stopped_idx", condition=Q(stopped_at__isnull=False)),
        ]

    def __str__(self) -> str:
        return self.id
