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

import threading
import time
from typing import Any

from tasks.exceptions import TaskLeaseLost
from tasks.models import ClaimedTask, Task

_local = threading.local()


class Execution:
    """One attempt of one task in this process."""

    def __init__(self, task: ClaimedTask, worker_id: str, ttl: float, claimed_at: float) -> None:
        self.task = task
        self.worker_id = worker_id
        self.started = time.monotonic()
        # Local deadline: the claim statement was sent at ``claimed_at``; the lease ends ttl later at
        # the latest. Used to give up early, never to hold longer.
        self.deadline = claimed_at + ttl
        self._lost = threading.Event()
        self.lost_reason: str | None = None
        self.progress: Any = task.progress

    @property
    def id(self) -> int:
        return self.task.id

    @property
    def token(self) -> int:
        return self.task.token

    @property
    def attempt(self) -> int:
        return self.task.attempts

    @property
    def lost(self) -> bool:
        if not self._lost.is_set() and time.monotonic() >= self.deadline:
            self.mark_lost("the lease ran out without a successful heartbeat")
        return self._lost.is_set()

    def mark_lost(self, reason: str) -> None:
        if not self._lost.is_set():
            self.lost_reason = reason
            self._lost.set()

    def check(self) -> None:
        if self.lost:
            raise TaskLeaseLost(f"task {self.id} is no longer held by this worker: {self.lost_reason}")

    def checkpoint(self, progress: Any) -> bool:
        """Save ``progress`` (JSON) on the task row; a retry of the task starts from it.

        Returns False (and marks the execution lost) when the claim is no longer ours.
        """
        saved = Task.objects.checkpoint(self.id, self.worker_id, self.token, progress)
        if saved:
            self.progress = progress
        else:
            self.mark_lost("checkpoint rejected: the task is no longer ours")
        return saved

    @property
    def overdue(self) -> bool:
        timeout = self.task.timeout
        return timeout is not None and time.monotonic() - self.started > timeout


def current_task() -> Execution:
    """The execution running in this thread (inside a task handler)."""
    execution: Execution | None = getattr(_local, "execution", None)
    if execution is None:
        raise RuntimeError("current_task() is only available inside a task run by a worker")
    return execution


def _set_current(execution: Execution | None) -> None:
    _local.execution = execution
