"""What a running task sees of its own claim: attempt, fencing token, checkpoints, loss.

from tasks.runtime import current_task

def import_rows(path):
    run = current_task()
    start = (run.progress or {}).get("row", 0)     # resume from the last checkpoint
    for n, row in enumerate(read(path)[start:], start):
        run.check()                                 # raises TaskLeaseLost once the claim is gone
        save(row, fence=run.token)
        if n % 1000 == 0:
            run.checkpoint({"row": n})
"""

from __future__ import annotations

import datetime as dt
import threading
from typing import Any

from leasing import clock
from tasks.exceptions import TaskLeaseLost
from tasks.models import ClaimedTask, Started, Task

_local = threading.local()


class Execution:
    """One attempt of one task in this process, identified by its key: (task id, fencing token).

    States: claimed (held, not begun) -> running (START committed, handler called) -> done
    (outcome handed to the writer). ``lost`` (the claim is gone or may be gone) and ``abandoned``
    (past its timeout: no longer heartbeated, its late result dropped) can happen at any point.
    """

    def __init__(
        self, task: ClaimedTask, worker_id: str, ttl: float, claimed_at: float, using: str = "default"
    ) -> None:
        self.task = task
        self.key: tuple[int, int] = (task.id, task.token)
        self.worker_id = worker_id
        self.using = using
        self.claimed_at = claimed_at
        self.started: float | None = None  # local clock at START; None until the attempt began
        # Local deadline: the claim statement was sent at ``claimed_at``; the lease ends ttl later at
        # the latest. Used to give up early, never to hold longer.
        self.deadline = claimed_at + ttl
        self._lost = threading.Event()
        self.lost_reason: str | None = None
        self.abandoned = False
        self.finished = False  # the handler returned; its outcome waits for the writer
        self.gate_slot: str | None = None  # "shared" / "exclusive" while it holds the isolation gate
        self.progress: Any = task.progress
        self.attempt = task.attempts  # the attempt number once START charged it
        self.started_at: dt.datetime | None = task.started_at
        self.last_attempted_at: dt.datetime | None = task.last_attempted_at
        self._stalled_until = 0.0

    @property
    def started_epoch(self) -> float | None:
        """When the handler was called, in epoch seconds (what a folded start marker records)."""
        return None if self.last_attempted_at is None else self.last_attempted_at.timestamp()

    @property
    def id(self) -> int:
        return self.task.id

    @property
    def token(self) -> int:
        return self.task.token

    @property
    def running(self) -> bool:
        return self.started is not None

    def begin(self, started: Started) -> None:
        """The start marker committed before the handler runs (a suspect task)."""
        self.started = clock.monotonic()
        self.attempt = started.attempt
        self.started_at = started.started_at
        self.last_attempted_at = started.last_attempted_at

    def begin_local(self, now: dt.datetime) -> None:
        """The handler runs now; the start marker follows in the dispatcher's next round. The claim
        holds the row for us, so the attempt number it will charge is known: one more."""
        self.started = clock.monotonic()
        self.attempt = self.task.attempts + 1
        self.started_at = self.task.started_at or now
        self.last_attempted_at = now

    @property
    def lost(self) -> bool:
        if not self._lost.is_set() and clock.monotonic() >= self.deadline:
            self.mark_lost("the lease ran out without a successful heartbeat")
        return self._lost.is_set()

    def mark_lost(self, reason: str) -> None:
        if not self._lost.is_set():
            self.lost_reason = reason
            self._lost.set()

    def renewed(self, sent: float, ttl: float) -> None:
        """A heartbeat sent at ``sent`` (local clock) renewed the lease for ``ttl`` seconds."""
        self.deadline = max(self.deadline, sent + ttl)

    def check(self) -> None:
        if self.lost:
            raise TaskLeaseLost(f"task {self.id} is no longer held by this worker: {self.lost_reason}")

    def checkpoint(self, progress: Any) -> bool:
        """Save ``progress`` (JSON) on the task row; a retry of the task starts from it.

        Returns False (and marks the execution lost) when the claim is no longer ours. Raises
        :class:`~tasks.exceptions.UnstorableResult` (a ValueError) for progress jsonb cannot hold.
        """
        saved = Task.objects.db_manager(self.using).checkpoint(self.id, self.worker_id, self.token, progress)
        if saved:
            self.progress = progress
        else:
            self.mark_lost("checkpoint rejected: the task is no longer ours")
        return saved

    @property
    def overdue(self) -> bool:
        timeout = self.task.timeout
        return timeout is not None and self.started is not None and clock.monotonic() - self.started > timeout

    @property
    def timeout_deadline(self) -> float | None:
        if self.task.timeout is None or self.started is None:
            return None
        return self.started + self.task.timeout

    # -- fault injection ------------------------------------------------------------------------

    def miss_heartbeats(self, seconds: float) -> None:
        """Fault injection (the demo's latency spike): the worker leaves this attempt out of its
        heartbeats for ``seconds``, as if this task alone had stalled, so its lease can lapse and
        another worker take the task over while the rest of the process carries on."""
        self._stalled_until = clock.monotonic() + seconds

    @property
    def heartbeat_paused(self) -> bool:
        return clock.monotonic() < self._stalled_until


def current_task() -> Execution:
    """The execution running in this thread (inside a task handler)."""
    execution: Execution | None = getattr(_local, "execution", None)
    if execution is None:
        raise RuntimeError("current_task() is only available inside a task run by a worker")
    return execution


def _set_current(execution: Execution | None) -> None:
    _local.execution = execution
