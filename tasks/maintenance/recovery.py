"""The recovery controller: requeues tasks whose worker died, repairs impossible states.

It runs as a loop (``manage.py recover_tasks``), inside every worker, or once from a Celery beat
task. Wherever it runs, it works only while it holds the ``tasks:recovery`` lease, so exactly one
instance recovers at a time and a standby takes over when that one dies. Between rounds the leader
also prunes what is past its retention (``tasks/maintenance/retention.py``) and runs the batches of
bulk operations (``tasks/maintenance/bulk.py``), a slice at a time, and rolls finished tasks up by
hour for the history page (``tasks/maintenance/history.py``), on a thread of its own for as long as it
leads, keeps the day partitions of finished tasks created ahead and retires those past retention
(``tasks/maintenance/partitions.py``), on another, and gives fair queues' keyless rows the shared key,
a bounded batch a round (``tasks/maintenance/keyless.py``).
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from django.db import DEFAULT_DB_ALIAS, Error, connections

from leasing import clock
from leasing.bounds import without_jit
from leasing.election import LeaderElection, Term
from tasks.conf import get_settings
from tasks.lifecycle import activity, concurrency, ratelimits
from tasks.lifecycle import statements as sql
from tasks.maintenance.archive import MOVER_SLICE, Archiver
from tasks.maintenance.bulk import BulkRunner
from tasks.maintenance.history import HistoryRollup, RollupRound, roll_up_hours
from tasks.maintenance.keyless import KeylessAdopter
from tasks.maintenance.partitions import KeeperRound, PartitionError, PartitionKeeper
from tasks.maintenance.repair import RepairReport, repair_stranded
from tasks.maintenance.retention import AutoPruner
from tasks.models import Recovered, Task
from tasks.models import Worker as WorkerRow
from tasks.runtime import task_log_fields

_T = TypeVar("_T")

logger = logging.getLogger("tasks.recovery")

RECOVERY_LEASE = "tasks:recovery"
#: The sweep for leases left live on rows that are not running runs every this many rounds.
REPAIR_EVERY = 30
#: Seconds between the leader's full scans of expired leases; between them it reads only the leases
#: that expired since its last scan (RecoveryWindow).
FULL_SCAN_INTERVAL = 30.0
#: Seconds of counting per pass of the history thread (at least one hour), and between its passes.
HISTORY_BUDGET = 5.0
HISTORY_PAUSE = 1.0
#: Seconds a windowed scan reaches back before the last scan's start: a lease whose expiry committed
#: that late waits for the next full scan. A row another session held locked (skipped) does not: the
#: next window starts at or before its expiry.
RECOVERY_MARGIN = dt.timedelta(seconds=1)
#: Seconds a term's end waits for the partitions thread (tasks/maintenance/partitions.py).
PARTITION_JOIN_TIMEOUT = 5.0

# The oldest lease a round's scans saw expired and left RUNNING (a row another session held locked:
# SKIP LOCKED passed over it): the next window must still cover it. A range of the expiry index,
# as the windowed pick's.
_LEFT_BEHIND_SQL = """
SELECT min(expires_at) FROM tasks_task
WHERE status = 'RUNNING' AND expires_at > %(after)s::timestamptz AND expires_at <= %(began)s::timestamptz
"""


@dataclass
class RecoveryWindow:
    """Where the leader's next scan of expired leases starts. A full scan reads every RUNNING entry
    of the expiry index up to now, and beside an old snapshot that is every RUNNING version since the
    snapshot (tasks/lifecycle/recover.py, RECOVER_EXPIRED_SINCE_SQL); between full scans, every
    FULL_SCAN_INTERVAL, a scan reads the leases that expired since the last one began (less
    RECOVERY_MARGIN), or since the oldest one a scan had to leave (locked by another session), so
    that one is taken by the first round after its lock goes. A new leader starts with a full scan."""

    full_scan_interval: float = FULL_SCAN_INTERVAL
    since: dt.datetime | None = None
    full_scan_due: float = 0.0

    def after(self) -> dt.datetime | None:
        """The database time this round's scan reads from; None: a full scan."""
        if self.since is None or clock.monotonic() >= self.full_scan_due:
            return None
        return self.since - RECOVERY_MARGIN

    def scanned(self, began: dt.datetime, *, full: bool, left_behind: dt.datetime | None = None) -> None:
        """A scan that began at ``began`` (database time) is done; ``left_behind``: the oldest
        expired lease it could not take (locked by another session)."""
        self.since = began if left_behind is None else min(began, left_behind)
        if full:
            self.full_scan_due = clock.monotonic() + self.full_scan_interval


@dataclass
class RecoveryReport:
    requeued: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    orphans_expired: list[int] = field(default_factory=list)
    stray_leases_released: list[int] = field(default_factory=list)
    #: Requeued without charge: claimed but never started when their worker vanished.
    returned_unstarted: list[int] = field(default_factory=list)
    #: Workers silent for more than twice their TTL, now recorded as dead.
    workers_dead: list[str] = field(default_factory=list)
    #: Keyed tasks admitted by the sweep (deferred ones come due, ones an admission skipped).
    admitted: int = 0
    #: Tasks whose key slot was kept for a handler in a worker now known dead, given back.
    slots_released: list[int] = field(default_factory=list)
    #: Seconds from lease expiry to requeue, per recovered task that had a lease.
    delays: list[float] = field(default_factory=list)
    #: The round read every expired lease (not only those expired since its last scan: RecoveryWindow).
    full_scan: bool = True
    #: What the repair sweep set right (tasks/maintenance/repair.py): nothing, unless a settle was lost.
    repairs: RepairReport = field(default_factory=RepairReport)
    #: Tasks made due for an event that came while they ran (tasks/lifecycle/steps.py EVENTS_WAKE_SQL).
    woken_for_events: list[int] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (
            self.requeued
            or self.failed
            or self.orphans_expired
            or self.stray_leases_released
            or self.workers_dead
            or self.slots_released
            or not self.repairs.empty
        )


def recover_once(
    *, using: str = DEFAULT_DB_ALIAS, repair: bool = True, batch: int = 1000, window: RecoveryWindow | None = None
) -> RecoveryReport:
    """One round of recovery (statements, no lease): what the controller does each interval, with
    its ``window`` (without one: a full scan). Its statements go without JIT compilation
    (leasing/bounds.py says why)."""
    with without_jit():
        return _recover_once(using=using, repair=repair, batch=batch, window=window)


def _recover_once(*, using: str, repair: bool, batch: int, window: RecoveryWindow | None) -> RecoveryReport:
    manager = Task.objects.db_manager(using)
    after = window.after() if window is not None else None
    began: dt.datetime | None = None
    if window is not None:
        with connections[using].cursor() as cursor:
            cursor.execute("SELECT clock_timestamp()")
            (began,) = cursor.fetchone()
    dead = list(WorkerRow.objects.db_manager(using).mark_dead())
    report = RecoveryReport(workers_dead=dead, orphans_expired=manager.expire_orphans(), full_scan=after is None)
    while True:
        recovered: list[Recovered] = manager.recover_expired(limit=batch, after=after)
        if recovered and logger.isEnabledFor(logging.INFO):
            _log_recovered(recovered)
        for item in recovered:
            (report.failed if item.status == "FAILED" else report.requeued).append(item.id)
            if item.kind == "returned":
                report.returned_unstarted.append(item.id)
            if item.expired_for is not None:
                report.delays.append(item.expired_for)
        if len(recovered) < batch:
            break
    if window is not None and began is not None:
        with connections[using].cursor() as cursor:
            cursor.execute(_LEFT_BEHIND_SQL, {"after": after or "-infinity", "began": began})
            (left_behind,) = cursor.fetchone()
        window.scanned(began, full=after is None, left_behind=left_behind)
    if repair:
        report.stray_leases_released = manager.release_stray_leases()
        # Workflow members and workflows left waiting for what will never happen (a second line of
        # defence: each repair is counted, logged as an error and alerted on).
        report.repairs = repair_stranded(using=using)
    # Tasks that had an event sent while they ran, and then went to wait for it: due now.
    report.woken_for_events = wake_for_events(using=using)
    # Slots kept for handlers that outlived their rows, in processes known dead now (admits for their keys).
    report.slots_released = concurrency.release_dead(using=using)
    # Keyed tasks whose deferral ended, or that an admission skipped, get their slots now.
    report.admitted = concurrency.admit_waiting(using=using)
    concurrency.prune_idle_keys(using=using)
    ratelimits.prune_idle_keys(using=using)  # rate keys without a start for an hour: their windows are empty
    # Close the minutes of the activity chart as they end (one minute of rows each, once), so that
    # dashboards and scrapes only ever count the open minute.
    activity.roll_up(using=using)
    if not report.empty:
        logger.warning(
            "recovery: requeued %d (%d never started: uncharged), failed for good %d, orphans expired %d,"
            " stray leases released %d, workers found dead %d, key slots of dead handlers released %d;"
            " longest expiry-to-requeue %.2fs",
            len(report.requeued),
            len(report.returned_unstarted),
            len(report.failed),
            len(report.orphans_expired),
            len(report.stray_leases_released),
            len(report.workers_dead),
            len(report.slots_released),
            max(report.delays, default=0.0),
        )
    return report


#: Undelivered events looked at per recovery round (the next round goes on with the rest).
EVENTS_BATCH = 1000


def wake_for_events(*, using: str = DEFAULT_DB_ALIAS) -> list[int]:
    """Make due each waiting task with an event it was not woken for (sent while it ran, when its
    attempt may have looked for it already): one batch, the ids of the tasks woken."""
    with connections[using].cursor() as cursor:
        cursor.execute(sql.EVENTS_WAKE_SQL, {"limit": EVENTS_BATCH})
        return sorted({task_id for task_id, woken in cursor.fetchall() if woken})


def _log_recovered(recovered: list[Recovered]) -> None:
    """One record per task recovered, with the fields of every record about a task (tasks.runtime.LOG_FIELDS):
    the worker that lost it, and the lost attempt's outcome (Recovered.outcome)."""
    for item in recovered:
        logger.info(
            "task %d: lease of worker %s expired (%s); %s",
            item.id,
            item.worker,
            item.kind or "?",
            "FAILED for good" if item.status == "FAILED" else f"{item.status} again",
            extra=task_log_fields(item.id, item.queue, item.attempt, item.worker, item.outcome),
        )


#: Seconds ``maintain_once`` gives the duties after recovery (bulk operations, history, retention),
#: shared between them: a cron line or a beat entry every minute goes on where the last one stopped.
ONCE_BUDGET = 30.0


@dataclass
class MaintenanceReport:
    """What one ``maintain_once`` did: recovery's round, and each duty of the leader beside it."""

    recovery: RecoveryReport
    bulk_changed: int = 0
    history: RollupRound | None = None
    pruned: int = 0
    #: Finished tasks moved to tasks_finished (ARCHIVE_AFTER set).
    archived: int = 0
    keyless_adopted: int = 0
    #: The partitions of finished tasks created and retired (None: their upkeep failed, logged).
    partitions: KeeperRound | None = None
    #: The duties that failed, each "name: error" (logged; the others still ran).
    errors: list[str] = field(default_factory=list)


def maintain_once(
    *, using: str = DEFAULT_DB_ALIAS, budget: float = ONCE_BUDGET, prune: bool = True
) -> MaintenanceReport:
    """Every duty of the recovery leader, once, without its lease: a recovery round with its repairs,
    then, within ``budget`` seconds in all, the open bulk operations' batches, the history hours due,
    a retention slice (``prune``), and a keyless adoption round, and last the upkeep of the finished
    tasks' partitions (days created ahead; with ``prune``, days past retention retired). What
    ``recover_tasks --once`` (a cron line) and Celery beat's ``tasks.recover_expired`` run; each
    duty's statements are safe beside a leader's or another run's (row locks, SKIP LOCKED, upserts of
    the same numbers, partitions created and retired idempotently)."""
    report = MaintenanceReport(recovery=recover_once(using=using))
    share = budget / (4 if prune else 3)
    duty = _Duties(report, using)
    report.bulk_changed = duty("bulk operations", lambda: BulkRunner(using=using).run_for(share), 0)
    report.history = duty("history", lambda: roll_up_hours(using=using, budget=share), None)
    if prune:
        report.pruned = duty("retention", lambda: AutoPruner(using=using, interval=0.0).run_for(share), 0)
    report.archived = duty("archive", lambda: Archiver(using=using, interval=0.0).run_for(share), 0)
    report.keyless_adopted = duty(
        "keyless adoption", lambda: sum(r.adopted for r in KeylessAdopter(using=using).run_once()), 0
    )
    report.partitions = duty(
        "partitions", lambda: PartitionKeeper(using=using, retire=prune).run_once(force=True), None
    )
    return report


class _Duties:
    """Runs ``maintain_once``'s duties one after another: one that fails (a database error, a
    partition that could not be created) is logged and named in the report's ``errors``, and the
    duties after it still run (a cron run that stopped at a failed history count would leave the
    partitions un-kept too). The connection is closed after a failure, as the leader's loop does."""

    def __init__(self, report: MaintenanceReport, using: str) -> None:
        self.report = report
        self.using = using

    def __call__(self, name: str, run: Callable[[], _T], failed: _T) -> _T:
        try:
            return run()
        except (Error, PartitionError) as exc:
            logger.warning("%s failed: %s", name, exc)
            self.report.errors.append(f"{name}: {exc}")
            connections[self.using].close()
            return failed


class RecoveryController:
    def __init__(
        self,
        *,
        interval: float | None = None,
        using: str = DEFAULT_DB_ALIAS,
        ttl: float | None = None,
        prune: bool = True,
        history: bool = True,
        partitions: bool = True,
    ) -> None:
        self.interval = interval or get_settings().RECOVERY_INTERVAL
        self.using = using
        # Retention runs on the recovery leader, a slice after each round (tasks/maintenance/retention.py).
        self.pruner = AutoPruner(using=using) if prune else None
        # The mover (ARCHIVE_AFTER): finished tasks to tasks_finished, on a thread of its own that
        # works ARCHIVE_BUSY_FRACTION of the time while it is behind (a backlog of an hour of a busy
        # queue, counted at once, must neither wait behind recovery nor hold it up).
        self.archiver = Archiver(using=using)
        # Bulk operations too (tasks/maintenance/bulk.py): their progress is on their rows, so a new
        # leader resumes them where the last one stopped.
        self.bulk = BulkRunner(using=using)
        # The hourly history rollup, also on the leader, on a thread of its own: counting an hour of
        # a busy queue is one statement of seconds, which must not hold recovery up.
        self.history = HistoryRollup(using=using) if history else None
        # The finished tasks' partitions, on a thread of their own: retiring one waits for the
        # transactions that may still read it (DETACH PARTITION ... CONCURRENTLY).
        self.partitions = PartitionKeeper(using=using, retire=prune) if partitions else None
        # Fair queues' rows without a key, adopted a batch per queue a round (tasks/maintenance/keyless.py).
        self.keyless = KeylessAdopter(using=using)
        # The controller's own lease: long enough to ride out a slow round, short enough to hand over fast.
        self.election = LeaderElection(
            RECOVERY_LEASE, ttl=ttl or max(1.0, self.interval * 3), retry_interval=self.interval, using=using
        )
        self.rounds = 0
        self.reports: list[RecoveryReport] = []
        self.window = RecoveryWindow()

    def _lead(self, term: Term) -> None:
        logger.info("recovery controller %s is active", self.election.holder)
        self.window = RecoveryWindow()  # a new term starts with a full scan
        self.keyless.reset()  # and its passes over fair queues from their front
        # and the mover's with a full pass: a controller leading again would otherwise resume its
        # last term's cursors, past the rows a lock held back then (they would wait up to an hour).
        self.archiver.reset()
        threads = [threading.Thread(target=self._move_finished, args=(term,), name="mover", daemon=True)]
        if self.history is not None:
            threads.append(threading.Thread(target=self._count_history, args=(term,), name="history", daemon=True))
        if self.partitions is not None:
            threads.append(
                threading.Thread(target=self._upkeep_partitions, args=(term,), name="partitions", daemon=True)
            )
        for thread in threads:
            thread.start()
        try:
            self._recover(term)
        finally:
            # The term ends with its threads: a count in progress finishes first (one statement;
            # were it to commit after a new leader's, it writes the same numbers). A retirement may
            # be waiting for an old snapshot to end (DETACH ... CONCURRENTLY): it is given
            # PARTITION_JOIN_TIMEOUT, then left to end on its own (a new leader's retirement of the
            # same day fails until it does, and finalizes it after).
            for thread in threads:
                thread.join(PARTITION_JOIN_TIMEOUT if thread.name == "partitions" else None)

    def _upkeep_partitions(self, term: Term) -> None:
        assert self.partitions is not None
        self.partitions.reset()
        try:
            while not term.should_stop:
                try:
                    self.partitions.run_once()
                except (
                    Error,
                    PartitionError,
                ) as exc:  # tried again at the next check; the metrics show days running out
                    logger.warning("partition upkeep failed: %s", exc)
                    connections[self.using].close()
                term.wait(min(self.partitions.interval, 1.0))
        finally:
            connections[self.using].close()  # this thread's own connection

    def _count_history(self, term: Term) -> None:
        assert self.history is not None
        try:
            while not term.should_stop:
                try:
                    self.history.run_for(HISTORY_BUDGET)
                except Error as exc:
                    logger.warning("history round failed: %s", exc)
                    connections[self.using].close()
                term.wait(HISTORY_PAUSE)
        finally:
            connections[self.using].close()  # this thread's own connection

    def _move_finished(self, term: Term) -> None:
        try:
            while not term.should_stop:
                began = clock.monotonic()
                busy = self.archiver.busy_fraction()
                try:
                    self.archiver.run_for(MOVER_SLICE)
                except (Error, PartitionError) as exc:  # the next slice starts a full pass
                    logger.warning("archive round failed: %s", exc)
                    self.archiver.reset()
                    connections[self.using].close()
                term.wait(self.archiver.rest(clock.monotonic() - began, busy))
        finally:
            connections[self.using].close()  # this thread's own connection

    def _recover(self, term: Term) -> None:
        while not term.should_stop:
            try:
                report = recover_once(using=self.using, repair=self.rounds % REPAIR_EVERY == 0, window=self.window)
                if not report.empty:
                    self.reports = [*self.reports[-99:], report]
                if self.pruner is not None and not term.should_stop:
                    # Its share of the interval: recovery is held up by at most one slice.
                    self.pruner.run_for(self.interval * get_settings().RETENTION_BUSY_FRACTION)
                if not term.should_stop:
                    self.bulk.run_for(self.interval * get_settings().BULK_BUSY_FRACTION)
                if not term.should_stop:
                    self.keyless.run_once()
            except (Error, PartitionError) as exc:
                logger.warning("recovery round failed: %s", exc)
                if self.pruner is not None:
                    self.pruner.reset()
                connections[self.using].close()
            self.rounds += 1
            term.wait(self.interval)

    def run(self) -> None:
        self.election.run(self._lead)

    def stop(self) -> None:
        self.election.stop()
