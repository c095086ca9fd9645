"""A fair queue's turn cursor, shared by every claimer of its database (workers and API processes).

A fair claim deals its turns on from the key that took the claimer's last turn (FAIR_CURSOR in
tasks/lifecycle/claim.py). Kept only in a process's memory, that cursor died with the process:
a worker recycled by ``--max-tasks``, killed and restarted, or deployed started from the first key
every life, so with more tenants than one life's claims reach, the last ones never started a task.
The row of ``tasks_faircursor`` is where a new claimer starts instead.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext

from django.db import DatabaseError, connections, models, transaction

from leasing import clock
from leasing.routing import SelectedManager
from tasks.lifecycle import statements as sql

logger = logging.getLogger("tasks.fair")

#: A claimer writes its cursor back at most this often (seconds), and at a clean stop.
WRITE_INTERVAL = 1.0
#: The recent claims whose starting cursor a claimer remembers, to go back to it when their tasks are
#: handed back unstarted (a worker holds the tasks of a few claims at most: its prefetch is bounded).
REMEMBERED_CLAIMS = 64


def _guarded(using: str) -> AbstractContextManager[object]:
    """Inside a caller's transaction (an API request under ATOMIC_REQUESTS), a savepoint: a refused
    read or write of the cursor must not abort the caller's transaction. Otherwise (a worker's
    autocommit connection) the statement is its own transaction and needs nothing around it."""
    return transaction.atomic(using=using) if connections[using].in_atomic_block else nullcontext()


class FairCursorQuerySet(models.QuerySet["FairCursor"]):
    def read(self, queue: str) -> str | None:
        """Where a new claimer of fair ``queue`` starts its turns (None: from the first key)."""
        with _guarded(self.db), connections[self.db].cursor() as cursor:
            cursor.execute(sql.FAIR_CURSOR_READ_SQL, {"queue": queue})
            row = cursor.fetchone()
        return None if row is None else row[0]

    def write(self, queue: str, fair_after: str | None) -> None:
        """Store where this claimer's turns have got to (last writer wins: FAIR_CURSOR_WRITE_SQL)."""
        with _guarded(self.db), connections[self.db].cursor() as cursor:
            cursor.execute(sql.FAIR_CURSOR_WRITE_SQL, {"queue": queue, "fair_after": fair_after})


class FairCursor(models.Model):
    """The shared turn cursor of one fair queue (LEASING_TASKS["FAIR_QUEUES"]) in this database."""

    queue = models.CharField(max_length=100, primary_key=True)
    fair_after = models.CharField(
        max_length=255,
        null=True,
        blank=True,
        db_collation="C",
        help_text="The key that took the last turn a claimer wrote back: new claimers start after it.",
    )
    updated_at = models.DateTimeField(help_text="When the cursor last moved (the database clock).")

    objects = SelectedManager.from_queryset(FairCursorQuerySet)()

    class Meta:
        ordering = ["queue"]

    def __str__(self) -> str:
        return f"fair queue {self.queue}: turns go on after {self.fair_after!r}"


class SharedFairCursor:
    """One claimer's cursor of one fair queue: kept in memory, shared through ``tasks_faircursor``.

    Read once, before the claimer's first claim from the queue (again at most once per ``interval``
    while the read fails); from then on each claim's FAIR_CURSOR moves it in memory (:meth:`advance`),
    and :meth:`sync` writes it back when it moved, at most once per ``interval`` seconds (the first
    move at once), :meth:`flush` at a clean stop. So the hot path sends no statement of its own: a
    worker writes at most one upsert a second, whatever its claim rate, after its claimed tasks went
    to its executors; a process killed loses at most its last second of turns (the next life serves
    those keys again; it skips none).

    The cursor is advisory: a read or write the database refuses (a lost connection, the table not
    migrated yet during a deploy) is logged and the claimer goes on with its own cursor, as before
    the table existed. Thread-safe (an API process serves claims from several threads)."""

    def __init__(self, queue: str, using: str, *, interval: float = WRITE_INTERVAL) -> None:
        self.queue = queue
        self.using = using
        self.interval = interval
        self._lock = threading.Lock()
        self._value: str | None = None  # where this claimer's next turn starts after
        self._known = False  # read from the table, or moved by a claim of ours before a read succeeded
        self._stored: str | None = None  # the table's value as this claimer last read or wrote it
        self._read_due = 0.0  # local clock: a failed read is tried again from then on
        self._write_due = 0.0  # local clock: the next write may go from then on (the first at once)
        # (claim sent at, the cursor its turns started after, its turns' keys in the order it dealt
        # them, how many of those the cursor is past), oldest first: see rewind()
        self._claims: deque[tuple[float, str | None, tuple[str, ...], int]] = deque(maxlen=REMEMBERED_CLAIMS)

    def current(self) -> str | None:
        """Where the next claim's turns start: the shared cursor on the first call, then this
        claimer's own."""
        with self._lock:
            if not self._known and clock.monotonic() >= self._read_due:
                try:
                    stored = FairCursor.objects.db_manager(self.using).read(self.queue)
                except DatabaseError as exc:
                    self._read_due = clock.monotonic() + self.interval
                    logger.warning("fair queue %s: its shared cursor could not be read: %s", self.queue, exc)
                else:
                    self._known = True
                    self._value = self._stored = stored
            return self._value

    def advance(self, fair_after: str | None, *, claim: float | None = None, turns: Iterable[str] = ()) -> None:
        """A claim's turns went on to ``fair_after`` (``fair_after_claim``; None: the claim found no
        keys, the cursor stays). In memory only: :meth:`sync` writes it back. ``claim``: when the
        claim was sent (its tasks' ``claimed_at``), remembered with where its turns started and
        ``turns``, the keys whose turn its rows took (``ClaimedTask.fair_turn``), for :meth:`rewind`."""
        if fair_after is not None:
            with self._lock:
                if claim is not None:
                    before = self._value
                    # the order the claim dealt them: the keys after where it started, then round to the first
                    dealt = tuple(sorted(set(turns), key=lambda key: (before is not None and key <= before, key)))
                    self._claims.append((claim, before, dealt, len(dealt)))
                self._value = fair_after
                self._known = True  # ours wins over a read that has not succeeded yet

    def rewind(self, turns: Iterable[tuple[float, str | None]]) -> None:
        """Turns handed back unstarted, each as (when its claim was sent, its key; None: the claim's
        earliest turn): a worker's drain, or an executor returning a claim it could not begin. The
        cursor goes back to just before the earliest turn handed back, so the next claimer serves that
        key and the ones after it, not passes over them. Each stop of a rolling deploy moved the
        shared cursor past the keys of the claims it handed back, so the same keys went
        without a start life after life; an executor's return mid-stream did the same (stop 61).

        Within a claim the cursor goes back to the key before the first turn handed back, not to the
        claim's start: its turns that did start are not dealt again (a stop in the middle of a claim
        served them twice, and the next life started behind the last turn it left). A turn started
        after one handed back (the executors took them out of order) is served twice at worst; a claim
        older than what is remembered goes back as far as is remembered."""
        handed = list(turns)
        if not handed:
            return
        earliest = min(at for at, _key in handed)
        keys = {key for at, key in handed if at == earliest}
        with self._lock:
            while self._claims:  # newest first, back to the earliest handed back (as far as remembered)
                at, before, dealt, past = self._claims[-1]
                if at < earliest:
                    break
                if at == earliest and None not in keys and keys <= set(dealt):
                    first = min(past, *(dealt.index(key) for key in keys))
                    # The claim stays remembered, cut at its first turn handed back: a later return
                    # of one of its later turns leaves the cursor, one of its earlier ones goes
                    # further back, never forward.
                    self._claims[-1] = (at, before, dealt, first)
                    self._value = dealt[first - 1] if first else before
                    break
                self._claims.pop()
                self._value = before
            # The older claims stay remembered: a drain hands back in two steps (what no executor
            # had taken at once, what an executor gives back later), and the later one may be of an
            # earlier claim (clearing them left the cursor past that claim's keys: a lap without
            # their turn).

    def sync(self) -> None:
        """Write a move back, unless the last write is less than ``interval`` old (the first at once)."""
        with self._lock:
            self._write(force=False)

    def flush(self) -> None:
        """Write a move back now (a clean stop)."""
        with self._lock:
            self._write(force=True)

    def _write(self, *, force: bool) -> None:
        value = self._value
        if not self._known or value == self._stored:
            return
        if not force and clock.monotonic() < self._write_due:
            return
        try:
            FairCursor.objects.db_manager(self.using).write(self.queue, value)
        except DatabaseError as exc:
            logger.warning("fair queue %s: its shared cursor could not be written: %s", self.queue, exc)
        else:
            # A write that found the row locked by another writer left it (FAIR_CURSOR_WRITE_SQL): it
            # counts as written, the next move goes in the next interval.
            self._stored = value
        self._write_due = clock.monotonic() + self.interval  # from the write's end: a slow one never runs back to back
