"""Eager mode: an enqueue runs the tasks it inserted at once, in the caller's thread and transaction,
through the worker's statements and handler code (:mod:`tasks.testing.inline`), and their outcomes are
stored on their rows as a worker would store them.

::

    with eager_tasks() as run:
        send_welcome.enqueue("a@example.com")     # has run when enqueue returns
    assert run.drained.succeeded == 1

Every kind of enqueue is covered: ``Task.objects.enqueue`` and ``bulk_enqueue``, a django.tasks
``Task.enqueue()`` through the LeaseBackend (after its ``task_enqueued`` signal), and a workflow
(its steps run as they are released). A failed attempt that will be retried is retried at once (the
backoff skipped), so a task is final when the enqueue returns, unless its handler snoozed it (it
waits for its ``run_after``), it waits for a concurrency slot (BLOCKED) or for other tasks
(AWAITING), or its queue is paused. A task a handler enqueues runs once that handler's attempt has
ended, in the same call: tasks do not run inside one another.

Only the thread (the context) that entered the mode runs tasks eagerly: the mode is a context
variable, so a live server's threads or a worker in the same process are not affected.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from tasks.models import Task
from tasks.models.task_enqueue import ENQUEUE_HOOK
from tasks.testing.inline import DEFAULT_LIMIT, INLINE_TTL, Drained, InlineRunner, RunLimitReached


@dataclass
class EagerRun:
    """What the tasks run eagerly did so far (:class:`~tasks.testing.inline.Drained`)."""

    drained: Drained = field(default_factory=Drained)
    limit: int = DEFAULT_LIMIT
    ttl: float = INLINE_TTL
    _pending: list[tuple[str, list[int]]] = field(default_factory=list)
    _running: bool = False
    _runners: dict[str, InlineRunner] = field(default_factory=dict)

    def enqueued(self, database: str, ids: list[int]) -> None:
        """The enqueue hook: run what was inserted (later, if a task is running now: its handler
        enqueued these)."""
        self._pending.append((database, ids))
        if self._running:
            return
        self._running = True
        ends: list[tuple[int, str]] = []
        try:
            while self._pending:
                database, ids = self._pending.pop(0)
                self._run(database, ids, ends)
        finally:
            self._running = False
            self._pending.clear()
            self.drained = self.drained + Drained.of(ends)

    def _run(self, database: str, ids: list[int], ends: list[tuple[int, str]]) -> None:
        runner = self._runners.get(database)
        if runner is None:
            runner = self._runners[database] = InlineRunner(database, ttl=self.ttl)
        # Workflow steps are released by the statement that finishes the step they wait for: the
        # claim also looks among the members of the workflows these tasks belong to.
        members = Task.objects.using(database).filter(pk__in=ids, workflow_id__isnull=False)
        workflows = sorted({flow for flow in members.values_list("workflow_id", flat=True) if flow is not None})
        while claimed := runner.tasks.claim_chosen(runner.worker_id, ids, workflows=workflows, ttl=self.ttl):
            if len(ends) >= self.limit:
                runner.tasks.hand_back(runner.worker_id, [claimed[0].key], reason="the eager run reached its limit")
                raise RunLimitReached(
                    f"an eager enqueue ran {self.limit} attempts and tasks were still runnable (a task that "
                    f"enqueues itself?); the last one ran: {claimed[0].task_path}",
                    self.drained + Drained.of(ends),
                )
            ends.append((claimed[0].id, runner.run(claimed[0])))


@contextmanager
def eager_tasks(*, limit: int = DEFAULT_LIMIT, ttl: float = INLINE_TTL) -> Iterator[EagerRun]:
    """Within the block, every enqueue runs its tasks at once (see the module's documentation).
    ``limit``: attempts one enqueue may run (with those of the tasks they enqueue) before it raises
    :class:`~tasks.testing.inline.RunLimitReached`. Usable as a decorator too."""
    if limit < 1:
        raise ValueError("limit must be at least 1")
    run = EagerRun(limit=limit, ttl=ttl)
    token = ENQUEUE_HOOK.set(run.enqueued)
    try:
        yield run
    finally:
        ENQUEUE_HOOK.reset(token)


__all__ = ["EagerRun", "eager_tasks"]
