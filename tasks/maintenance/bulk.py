"""The worker of bulk operations: the recovery leader runs their batches between its rounds, a slice
at a time (as it prunes: tasks/maintenance/retention.py), oldest operation first.

Restart-safe by construction: everything an operation has done is on its row (cursor and counts move
in the statement that changes the tasks, tasks/lifecycle/bulk.py), so a new leader resumes after the
cursor, and a batch cut short by a crash rolled back whole. Two sessions never run one batch twice:
each batch locks the operation's row and reads its cursor under that lock.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from django.db import DEFAULT_DB_ALIAS, DataError, ProgrammingError, connections

from leasing.bounds import StatementBounds, without_jit
from tasks.conf import get_settings
from tasks.lifecycle.bulk import BULK_FAIL_SQL, BatchResult
from tasks.models import BulkOperation

logger = logging.getLogger("tasks.bulk")

#: A batch's statement and lock timeouts: a batch reads at most BULK_SPAN ids, and a lock held longer
#: than this is a stopped session's (the next round tries again).
BATCH_STATEMENT_MS = 60_000
BATCH_LOCK_MS = 2_000


@dataclass
class BulkRunner:
    using: str = DEFAULT_DB_ALIAS
    batch_size: int = field(default_factory=lambda: get_settings().BULK_BATCH_SIZE)
    span: int = field(default_factory=lambda: get_settings().BULK_SPAN)
    clock: Callable[[], float] = time.monotonic
    #: Tasks changed by this runner, for its logs and tests.
    changed: int = 0

    def next_operation(self) -> BulkOperation | None:
        """The oldest open operation (through tasks_bulkop_open_idx)."""
        return BulkOperation.objects.db_manager(self.using).open().order_by("id").first()

    def run_batch(self) -> BatchResult | None:
        """One batch of the oldest open operation; None when none is open (or it just failed)."""
        operation = self.next_operation()
        if operation is None:
            return None
        try:
            # Bounded waits: a deposed leader stopped between its batch and its COMMIT holds the
            # operation's row; waiting for it without end held the recovery round that runs this one.
            # A lock timeout fails this round's batch, which the next round tries again.
            bounds = StatementBounds(statement_ms=BATCH_STATEMENT_MS, lock_ms=BATCH_LOCK_MS)
            with without_jit(), connections[self.using].execute_wrapper(bounds):
                result = operation.run_batch(batch=self.batch_size, span=self.span, using=self.using)
        except (DataError, ProgrammingError) as exc:
            # Refused for good, not a passing failure (those propagate: the leader's next round tries
            # again): it would fail every round and hold up every operation after it.
            logger.warning("bulk %s #%d failed: %s", operation.kind, operation.pk, exc)
            with connections[self.using].cursor() as cursor:
                cursor.execute(BULK_FAIL_SQL, {"operation": operation.pk, "error": str(exc)[:2000]})
            return None
        if result is not None:
            self.changed += result.batch_changed
            if not result.open:
                logger.info(
                    "bulk %s #%d %s: matched %d, changed %d, skipped %d",
                    operation.kind,
                    operation.pk,
                    result.status.lower(),
                    result.matched,
                    result.changed,
                    result.skipped,
                )
        return result

    def run_for(self, budget: float) -> int:
        """Run batches for up to ``budget`` seconds (at least one when an operation is open); returns
        the tasks changed."""
        deadline = self.clock() + budget
        before = self.changed
        while self.next_operation() is not None:
            self.run_batch()
            if self.clock() >= deadline:
                break
        return self.changed - before

    def run_until_idle(self) -> int:
        """Every open operation to its end (the command line's and the tests' way)."""
        before = self.changed
        while self.next_operation() is not None:
            self.run_batch()
        return self.changed - before
