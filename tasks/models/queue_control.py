"""The pause switch of a queue, read by every claim of its database."""

from __future__ import annotations

from django.db import OperationalError, connections, models, transaction
from psycopg import errors as psycopg_errors

from leasing.routing import SelectedManager
from tasks.exceptions import TaskError
from tasks.lifecycle.states import NOTIFY_CHANNEL
from tasks.lifecycle.values import validate_enqueue

PAUSE_LOCK_TIMEOUT_MS = 5000


class QueueControlQuerySet(models.QuerySet["QueueControl"]):
    def pause(self, name: str, *, by: str = "", reason: str = "") -> QueueControl:
        """Stop every worker and client from claiming ``name`` (from their next claim); running tasks
        go on and finish. Enqueueing into a paused queue still works. Inside the caller's transaction the
        lock it takes on the switches lasts until that transaction ends, holding every claim back: call it
        from a short one."""
        validate_enqueue(queue=name, priority=0, max_attempts=1, timeout=None)
        with transaction.atomic(using=self.db):
            # A claim reads this table under ACCESS SHARE until its transaction ends, and takes its
            # snapshot only after its locks. Waiting for ACCESS EXCLUSIVE makes the pause commit only
            # after every claim that read the old state has committed (a round held up by a row lock
            # included), and claims arriving meanwhile wait and then see the pause. Bounded: while
            # we wait, new claims queue behind us.
            with connections[self.db].cursor() as cursor:
                cursor.execute(
                    "SELECT current_setting('lock_timeout'), set_config('lock_timeout', %s, true)",
                    [f"{PAUSE_LOCK_TIMEOUT_MS}ms"],
                )
                (previous, _) = cursor.fetchone()
                try:
                    cursor.execute(f"LOCK TABLE {self.model._meta.db_table} IN ACCESS EXCLUSIVE MODE")
                    cursor.execute("SELECT set_config('lock_timeout', %s, true)", [previous])
                except OperationalError as exc:
                    if isinstance(exc.__cause__, psycopg_errors.DeadlockDetected):
                        # The caller's transaction read the controls before (an admin form, an
                        # action's selection) and so did another pause's: each waits for the other's
                        # ACCESS SHARE. PostgreSQL aborted this one; the other pause goes through.
                        raise TaskError(
                            f"could not pause {name!r}: another pause of a queue ran at the same moment; try again"
                        ) from exc
                    if not isinstance(exc.__cause__, psycopg_errors.LockNotAvailable):
                        raise
                    raise TaskError(
                        f"could not pause {name!r}: a transaction reading the queue controls did not end within "
                        f"{PAUSE_LOCK_TIMEOUT_MS / 1000:g}s; try again"
                    ) from exc
            control, _ = self.update_or_create(
                name=name, defaults={"paused": True, "changed_by": by[:200], "reason": reason[:500]}
            )
        return control

    def resume(self, name: str, *, by: str = "") -> QueueControl:
        """Let ``name`` be claimed again and wake idle workers at once (a NOTIFY, as an enqueue sends)."""
        validate_enqueue(queue=name, priority=0, max_attempts=1, timeout=None)
        with transaction.atomic(using=self.db):
            control, _ = self.update_or_create(
                name=name, defaults={"paused": False, "changed_by": by[:200], "reason": ""}
            )
            with connections[self.db].cursor() as cursor:
                cursor.execute("SELECT pg_notify(%s, %s)", [NOTIFY_CHANNEL, name])
        return control

    def paused_names(self) -> list[str]:
        return list(self.filter(paused=True).order_by("name").values_list("name", flat=True))


class QueueControl(models.Model):
    """The operator's switch for one queue: while ``paused``, claims take nothing from it.

    The state lives in the database, so every replica obeys it; the claim statement reads it.
    """

    name = models.CharField(max_length=100, primary_key=True)
    paused = models.BooleanField(default=False)
    changed_at = models.DateTimeField(auto_now=True)
    changed_by = models.CharField(max_length=200, blank=True, default="")
    reason = models.CharField(max_length=500, blank=True, default="")

    objects = SelectedManager.from_queryset(QueueControlQuerySet)()

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return f"queue {self.name}: {'paused' if self.paused else 'running'}"
