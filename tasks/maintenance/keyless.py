"""Keyless rows of fair queues, given the shared key on the recovery leader.

A fair claim (tasks/lifecycle/claim.py, ``PICK_FAIR``) walks tasks_task_fair_idx, whose
entries are the READY rows *with* a key. A row of a fair queue without one (``fair_key`` NULL:
enqueued before the queue was named in FAIR_QUEUES, or by a replica on older code during a rolling
deploy) is reached only by the claim's fill, which runs when the keys' turns leave room: in a busy
fair queue, never. The recovery leader adopts such rows: it gives them the shared key "" (what an
enqueue without a key stores in a fair queue), and they take their turn from the next claim on.

Bounded: each round reads at most ``KEYLESS_BATCH`` READY rows of each fair queue, in the claim
order of tasks_task_claim_idx, from where its last round stopped (``KeylessAdopter.positions``, kept
by the leader: a new leader starts from the front, where the oldest rows wait). A pass over a queue's
backlog of B rows takes B / KEYLESS_BATCH rounds (RECOVERY_INTERVAL apart), then starts again from
the front; no statement reads every READY row, and no index is added (a partial index over the
keyless READY rows would be maintained by every enqueue of every plain queue, whose rows are all
keyless). Rows it finds locked (a claim, a bulk operation) are passed over, not waited for: a claim
takes them anyway, and the next pass sees the rest. Besides the pass, a tail reads the rows inserted
since the last round (by primary key, ``KEYLESS_BATCH`` a statement up to the newest row, at most
``TAIL_BATCHES_PER_ROUND`` statements a round, from the newest row when the term began): the
keyless rows an older replica inserts during a rolling deploy are adopted at the next
round, not when the pass reaches the end of their level.
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass, field

from django.db import DEFAULT_DB_ALIAS, connections

from tasks.conf import get_settings
from tasks.lifecycle.routing import queue_database

logger = logging.getLogger("tasks.recovery")

#: READY rows read per fair queue per round (the keyless among them are adopted).
KEYLESS_BATCH = 1000
#: The tail's statements per round at most: it keeps up with 20 x KEYLESS_BATCH inserts a round (10,000
#: a second at the default RECOVERY_INTERVAL of 2 s), over every queue of the database.
TAIL_BATCHES_PER_ROUND = 20

# One batch of a queue's READY rows in claim order (priority DESC, run_after, id) after a position,
# as two range scans of tasks_task_claim_idx: the rest of the position's level, then the levels
# below it (an Append under a LIMIT: the second runs only when the first leaves room). A fresh pass
# starts at priority 32767 (above every level: priorities are -100 to 100), so only the second scan
# reads. The keyless rows among them are locked SKIP LOCKED (only those: a keyed row is never locked
# here, so claims are not held up) and given the shared key "". Returns how many rows it read, how
# many it adopted, and the last row read (the next position; none when it read nothing).
ADOPT_KEYLESS_SQL = """
WITH scanned AS MATERIALIZED (
    (SELECT id, priority, run_after, fair_key FROM tasks_task
     WHERE status = 'READY' AND queue = %(queue)s AND priority = %(priority)s
       AND (run_after, id) > (%(run_after)s::timestamptz, %(id)s::bigint)
     ORDER BY run_after, id
     LIMIT %(batch)s)
    UNION ALL
    (SELECT id, priority, run_after, fair_key FROM tasks_task
     WHERE status = 'READY' AND queue = %(queue)s AND priority < %(priority)s
     ORDER BY priority DESC, run_after, id
     LIMIT %(batch)s)
    LIMIT %(batch)s
), adopted AS (
    UPDATE tasks_task AS t SET fair_key = ''
    WHERE t.id = ANY(ARRAY(
        SELECT k.id FROM tasks_task AS k
        WHERE k.id = ANY(ARRAY(SELECT s.id FROM scanned AS s WHERE s.fair_key IS NULL))
          AND k.status = 'READY' AND k.fair_key IS NULL
        FOR UPDATE SKIP LOCKED
    ))
    RETURNING t.id
)
SELECT (SELECT count(*) FROM scanned), (SELECT count(*) FROM adopted), last.priority, last.run_after, last.id
FROM (SELECT 1) AS one
LEFT JOIN LATERAL (
    SELECT s.priority, s.run_after, s.id FROM scanned AS s
    ORDER BY s.priority, s.run_after DESC, s.id DESC
    LIMIT 1
) AS last ON true
"""

# The rows inserted since the last round (the primary key after ``after``, at most ``batch`` of them,
# whatever their queue): a replica on older code keeps inserting keyless rows during a rolling
# deploy, at the end of their level, where the pass above reaches them last. Those of the fair
# queues that are READY and keyless are adopted as above. Returns rows read, rows adopted and the
# last id read (NULL: none, the position stays). An id committed after a larger one was read (its
# transaction was slower) is left to the pass.
ADOPT_NEW_KEYLESS_SQL = """
WITH scanned AS MATERIALIZED (
    SELECT id, queue, status, fair_key FROM tasks_task
    WHERE id > %(after)s
    ORDER BY id
    LIMIT %(batch)s
), adopted AS (
    UPDATE tasks_task AS t SET fair_key = ''
    WHERE t.id = ANY(ARRAY(
        SELECT k.id FROM tasks_task AS k
        WHERE k.id = ANY(ARRAY(
            SELECT s.id FROM scanned AS s
            WHERE s.fair_key IS NULL AND s.status = 'READY' AND s.queue = ANY(%(queues)s::text[])
        ))
          AND k.status = 'READY' AND k.fair_key IS NULL AND k.queue = ANY(%(queues)s::text[])
        FOR UPDATE SKIP LOCKED
    ))
    RETURNING t.id
)
SELECT (SELECT count(*) FROM scanned), (SELECT count(*) FROM adopted), (SELECT max(id) FROM scanned)
"""

# Where the tail starts in a new term: the newest row (the rows before it are the pass's).
_NEWEST_SQL = "SELECT COALESCE(max(id), 0) FROM tasks_task"

#: Where a fresh pass starts: above every priority level.
_FRONT = (32767, dt.datetime(1, 1, 1, tzinfo=dt.timezone.utc), 0)


@dataclass(frozen=True)
class AdoptionRound:
    """One round over one fair queue: rows read, rows adopted, and whether the pass reached the end."""

    queue: str
    read: int
    adopted: int
    finished_pass: bool


@dataclass
class KeylessAdopter:
    """The recovery leader's passes over its fair queues' READY rows (see the module's docstring)."""

    using: str = DEFAULT_DB_ALIAS
    batch: int = KEYLESS_BATCH
    #: Per fair queue, the last row read (priority, run_after, id): where its next round resumes.
    positions: dict[str, tuple[int, dt.datetime, int]] = field(default_factory=dict)
    #: The last id the tail read (None: not started this term).
    newest: int | None = None

    def reset(self) -> None:
        self.positions.clear()
        self.newest = None

    def run_once(self) -> list[AdoptionRound]:
        """A batch of each fair queue that lives in this database (one statement per queue), then
        the rows inserted since the last round (one statement)."""
        queues = [queue for queue in get_settings().FAIR_QUEUES if queue_database(queue) == self.using]
        rounds = [self._pass(queue) for queue in queues]
        if queues:
            self._tail(queues)
        return rounds

    def _tail(self, queues: list[str]) -> int:
        """Adopt the keyless rows among those inserted since the last round; how many."""
        with connections[self.using].cursor() as cursor:
            if self.newest is None:
                cursor.execute(_NEWEST_SQL)
                self.newest = cursor.fetchone()[0]
                return 0
            adopted = 0
            # Batch after batch until the newest row (a database taking more inserts a round than the
            # batch would leave the tail further behind each round), at most
            # TAIL_BATCHES_PER_ROUND statements a round (the rest is read the round after).
            for _ in range(TAIL_BATCHES_PER_ROUND):
                cursor.execute(ADOPT_NEW_KEYLESS_SQL, {"after": self.newest, "batch": self.batch, "queues": queues})
                read, adopted_now, last = cursor.fetchone()
                adopted += adopted_now
                if last is not None:
                    self.newest = last
                if read < self.batch:
                    break
        if adopted:
            logger.info("fair queues: %d new task(s) without a key given the shared key", adopted)
        return adopted

    def _pass(self, queue: str) -> AdoptionRound:
        """One batch of ``queue``'s READY rows in claim order, from where its last round stopped."""
        priority, run_after, last_id = self.positions.get(queue, _FRONT)
        with connections[self.using].cursor() as cursor:
            cursor.execute(
                ADOPT_KEYLESS_SQL,
                {"queue": queue, "priority": priority, "run_after": run_after, "id": last_id, "batch": self.batch},
            )
            read, adopted, *last = cursor.fetchone()
        finished = read < self.batch
        if finished or last[0] is None:
            self.positions.pop(queue, None)  # the pass reached the end: the next one starts at the front
        else:
            self.positions[queue] = (last[0], last[1], last[2])
        if adopted:
            logger.info("fair queue %s: %d task(s) without a key given the shared key", queue, adopted)
        return AdoptionRound(queue, read, adopted, finished)
