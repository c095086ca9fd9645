"""A bulk operation: retry, cancel or discard every task matching a filter, worked through in the
background by the recovery leader (tasks/maintenance/bulk.py; the statements and what each kind does:
tasks/lifecycle/bulk.py)."""

from __future__ import annotations

import json
from typing import Any

from django.db import IntegrityError, connections, models, transaction
from django.db.models.functions import Now

from leasing.routing import SelectedManager
from tasks.conf import get_settings
from tasks.lifecycle import bulk as sql
from tasks.lifecycle import prepared
from tasks.models import finished

# The operation's id range is fixed when it is requested: from before the oldest task to the newest
# one, in tasks_task and, for a retry (the only kind that reaches the mover's rows: it brings them
# back), in tasks_finished (probes of its primary keys, one per day kept there; a cancel or a discard
# applies to waiting tasks and skips them: a one-time filter). Tasks enqueued afterwards are not its
# business, and a retried task keeps its id, so no task is seen twice.
REQUEST_SQL = """
INSERT INTO tasks_bulkoperation
    (kind, filter, status, first_id, cursor, last_id, matched, changed, skipped, batches, requested_by,
     created_at, error)
SELECT %(kind)s, %(filter)s::jsonb, 'PENDING', first.id, first.id,
       COALESCE(GREATEST((SELECT max(id) FROM tasks_task),
                         (SELECT max(id) FROM tasks_finished WHERE %(kind)s = 'retry')), 0),
       0, 0, 0, 0, %(requested_by)s, clock_timestamp(), ''
FROM (SELECT COALESCE(LEAST((SELECT min(id) FROM tasks_task),
                            (SELECT min(id) FROM tasks_finished WHERE %(kind)s = 'retry')), 1) - 1 AS id)
     AS first
RETURNING id
"""

# A cancel re-checks that the operation is still open on its newest version (a batch that finished it
# meanwhile wins), and waits for a batch in flight (which holds the row) to commit first.
CANCEL_SQL = """
UPDATE tasks_bulkoperation SET status = 'CANCELLED', finished_at = clock_timestamp(), updated_at = clock_timestamp()
WHERE id = ANY(%(ids)s) AND status IN ('PENDING', 'RUNNING')
"""


class BulkOperationQuerySet(models.QuerySet["BulkOperation"]):
    def open(self) -> BulkOperationQuerySet:
        return self.filter(status__in=sql.OPEN)

    def request(self, kind: Any, filter: Any, *, requested_by: str = "") -> BulkOperation:
        """Validate ``filter`` for ``kind`` and insert the operation (PENDING): the recovery leader does
        the work. Raises :class:`tasks.lifecycle.bulk.BulkFilterError`; nothing is written then."""
        stored = sql.parse_filter(kind, filter)
        with connections[self.db].cursor() as cursor:
            cursor.execute(
                REQUEST_SQL, {"kind": kind, "filter": json.dumps(stored), "requested_by": requested_by[:200]}
            )
            (operation_id,) = cursor.fetchone()
        return self.get(pk=operation_id)

    def cancel(self) -> int:
        """Stop the open operations of this queryset: what their batches changed stays changed, no
        further batch runs (a batch in flight holds the operation's row: this waits for it)."""
        ids = list(self.open().values_list("pk", flat=True))
        if not ids:
            return 0
        with connections[self.db].cursor() as cursor:
            cursor.execute(CANCEL_SQL, {"ids": ids})
            return cursor.rowcount


class BulkOperation(models.Model):
    KINDS = [(kind, kind) for kind in sql.KINDS]
    STATUSES = [(s, s.title()) for s in (sql.PENDING, sql.RUNNING, sql.DONE, sql.CANCELLED, sql.FAILED)]

    kind = models.CharField(max_length=10, choices=KINDS)
    filter = models.JSONField(help_text="The validated filter (tasks/lifecycle/bulk.py, parse_filter).")
    status = models.CharField(max_length=10, choices=STATUSES, default=sql.PENDING)
    first_id = models.BigIntegerField(default=0, help_text="Where the cursor started (before the oldest task).")
    cursor = models.BigIntegerField(default=0, help_text="The last task id processed: a new leader resumes after it.")
    last_id = models.BigIntegerField(default=0, help_text="The newest task id when it was requested: the end.")
    matched = models.BigIntegerField(default=0, help_text="Tasks matching the filter so far.")
    changed = models.BigIntegerField(default=0, help_text="Tasks changed so far.")
    skipped = models.BigIntegerField(
        default=0, help_text="Matched but left alone: moved meanwhile (e.g. claimed), or a dedup key collision."
    )
    batches = models.BigIntegerField(default=0)
    requested_by = models.CharField(max_length=200, blank=True, default="")
    created_at = models.DateTimeField(db_default=Now())
    started_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    error = models.TextField(blank=True, default="")

    objects = SelectedManager.from_queryset(BulkOperationQuerySet)()

    class Meta:
        ordering = ["-id"]
        indexes = [
            # The leader's "next open operation": tiny, whatever the history kept.
            models.Index(fields=["id"], name="tasks_bulkop_open_idx", condition=models.Q(status__in=sql.OPEN)),
            # Retention's range scan of the ended ones, oldest first (tasks/maintenance/retention.py).
            models.Index(
                fields=["finished_at", "id"],
                name="tasks_bulkop_finished_idx",
                condition=models.Q(finished_at__isnull=False),
            ),
        ]

    def __str__(self) -> str:
        return f"bulk {self.kind} #{self.pk} ({self.status.lower()})"

    @property
    def is_open(self) -> bool:
        return self.status in sql.OPEN

    @property
    def progress(self) -> float:
        """The share of its id range gone through, 0..1."""
        if self.status == sql.DONE:
            return 1.0
        span = self.last_id - self.first_id
        return 0.0 if span <= 0 else max(0.0, min(1.0, (self.cursor - self.first_id) / span))

    def run_batch(self, *, batch: int, span: int, using: str | None = None) -> sql.BatchResult | None:
        """One batch (one statement, its own transaction); None when the operation is no longer open.
        A retry whose batch collided on a dedup key is redone a row at a time (each row its own
        savepoint; a collision is counted as skipped), progress in the same transaction."""
        alias = using or self._state.db or "default"
        params = self.batch_params(batch=batch, span=span)
        try:
            with transaction.atomic(using=alias):
                rows = prepared.rows(connections[alias], sql.BULK_SQL[self.kind], params)
                if not rows:
                    return None
                result = sql.BatchResult(*rows[0][:7])
                if self.kind == "retry":
                    result = self._requeue_restored(alias, params, result, restored=rows[0][7], missed=rows[0][8])
        except IntegrityError:
            if self.kind != "retry":
                raise
            return self.retry_one_at_a_time(alias, params)
        return result

    def batch_params(self, *, batch: int, span: int) -> dict[str, Any]:
        """The parameters of this operation's batch statements."""
        params = {"operation": self.pk, "batch": batch, "span": span, **sql.filter_params(self.filter)}
        if self.kind == "retry":  # RERUN_SET's parameter (tasks/lifecycle/transitions.py)
            params["fair_queues"] = list(get_settings().FAIR_QUEUES)
        return params

    def _requeue_restored(
        self,
        alias: str,
        params: dict[str, Any],
        result: sql.BatchResult,
        *,
        restored: list[int] | None,
        missed: list[int] | None,
    ) -> sql.BatchResult:
        """A retry batch's second part, in its transaction (a dedup key collision rolls the batch back
        whole): the rows it brought back from tasks_finished unchanged run again; the rows it picked in
        tasks_task but found gone, taken by the mover meanwhile, are brought back from tasks_finished
        and run again too, counted changed (RETRY_MISSED_SQL)."""
        with connections[alias].cursor() as cursor:
            if restored:
                cursor.execute(sql.RETRY_RESTORED_SQL, {**params, "ids": restored})
            if not missed:
                return result
            cursor.execute(sql.RETRY_MISSED_SQL, {**params, "ids": missed})
            found = [row[0] for row in cursor.fetchall()]
            if not found:
                return result
            cursor.execute(sql.RETRY_RESTORED_SQL, {**params, "ids": found})
            cursor.execute(sql.MISSED_COUNTED_SQL, {"operation": self.pk, "found": len(found)})
            status, position, matched, changed, skipped = cursor.fetchone()
        return sql.BatchResult(
            status, position, matched, changed, skipped, result.batch_picked, result.batch_changed + len(found)
        )

    def retry_one_at_a_time(self, alias: str, params: dict[str, Any]) -> sql.BatchResult | None:
        """A retry's batch redone a row at a time (after its statement collided on a dedup key)."""
        with transaction.atomic(using=alias), connections[alias].cursor() as cursor:
            cursor.execute(sql.BULK_PICK_SQL, params)
            picked = cursor.fetchall()
            if not picked:
                # The rows moved meanwhile: the batch's own statement has nothing left to collide on.
                rows = prepared.rows(connections[alias], sql.BULK_SQL[self.kind], params)
                return sql.BatchResult(*rows[0][:7]) if rows else None
            window_end = picked[0][1]
            changed = 0
            for task_id, _hi, moved in picked:
                try:
                    with transaction.atomic(using=alias):
                        if moved:  # back from tasks_finished first (gone meanwhile: skipped)
                            cursor.execute(finished.RESTORE_SQL, {"ids": [task_id]})
                            if not cursor.fetchall():
                                continue
                        cursor.execute(sql.BULK_RETRY_ONE_SQL, {**params, "task": task_id})
                        changed += len(cursor.fetchall())
                except IntegrityError:
                    pass  # another unfinished task holds its dedup key: skipped (and stays where it was)
            new_cursor = picked[-1][0] if len(picked) >= params["batch"] else window_end
            cursor.execute(
                sql.BULK_ADVANCE_SQL,
                {"operation": self.pk, "cursor": new_cursor, "picked": len(picked), "changed": changed},
            )
            row = cursor.fetchone()
        if row is None:
            return None
        status, position, matched, total_changed, skipped = row
        return sql.BatchResult(status, position, matched, total_changed, skipped, len(picked), changed)
