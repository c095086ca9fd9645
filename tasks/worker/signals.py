"""Django's ``task_finished`` for the django.tasks Tasks a worker runs, sent once the attempt's end is
stored, with the result as stored.

The worker writes outcomes in batches; an attempt's end is known only when its write landed (or was
refused: the lease was lost). Then ``task_finished`` carries what a ``refresh()`` would read: the
stored status (READY for an attempt that will be retried, FAILED for a cancelled task), ``finished_at``,
every error with this attempt's traceback, the workers. Receivers are user code, so they run on a
thread of their own: a slow receiver never holds up the dispatcher's claims and finishes. That
thread reads the rows of each batch of ended attempts in one statement.

Every attempt that sent ``task_started`` gets exactly one ``task_finished``: when its outcome is
written, when the outcome is refused (the lease was lost: expired, cancelled, taken over), when it
is abandoned past its timeout, and when a worker shutting down hands it back.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
from typing import TYPE_CHECKING, Any

from django.db import DatabaseError, connections
from django.utils import timezone

from tasks.backends.backend import _STATUS, task_errors, task_result
from tasks.backends.running import DjangoRun
from tasks.compat import TaskError, TaskResult, TaskResultStatus, task_finished
from tasks.models import Task, TaskStatus
from tasks.worker.logs import log_attempt

if TYPE_CHECKING:
    from tasks.runtime import Execution
    from tasks.worker.ledger import Outcome

logger = logging.getLogger("tasks.worker")

Ended = tuple["Execution", str | None, "Outcome | None"]


class FinishedSignals:
    def __init__(self, using: str) -> None:
        self.using = using
        self._queue: queue.SimpleQueue[Ended | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def ended(self, execution: Execution, status: str | None = None, outcome: Outcome | None = None) -> None:
        """The attempt ended; ``status`` is what this worker stored (None: nothing, the row says).
        Only attempts of django.tasks Tasks that sent ``task_started`` are signalled, once."""
        run: DjangoRun | None = execution.django
        if run is None:
            return
        with self._lock:
            if run.finish_sent:
                return
            run.finish_sent = True
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="task-signals", daemon=True)
                self._thread.start()
        self._queue.put((execution, status, outcome))

    def close(self, timeout: float) -> None:
        """Send what is pending, then end the thread (receivers get at most ``timeout`` seconds)."""
        with self._lock:
            thread = self._thread
        if thread is None:
            return
        self._queue.put(None)
        thread.join(timeout)
        if thread.is_alive():
            logger.warning("task_finished receivers still running %.0fs after the worker stopped", timeout)

    def _run(self) -> None:
        try:
            while True:
                batch = [self._queue.get()]
                while True:
                    try:
                        batch.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
                ended = [item for item in batch if item is not None]
                if ended:
                    self._send(ended)
                if len(ended) < len(batch):
                    return
        finally:
            connections.close_all()

    def _send(self, ended: list[Ended]) -> None:
        try:
            rows = {row.pk: row for row in Task.objects.using(self.using).filter(pk__in={e.id for e, _s, _o in ended})}
        except DatabaseError as exc:
            logger.warning("task_finished: reading the finished tasks failed (%s); sending what the worker knows", exc)
            connections[self.using].close()
            rows = {}
        for execution, status, outcome in ended:
            run: DjangoRun = execution.django
            try:
                result = finished_result(execution, rows.get(execution.id), status, outcome)
                send_finished(run.sender, result, outcome.error if outcome is not None else None)
            except BaseException:  # receivers are user code: SystemExit must not end every later signal
                log_attempt(
                    logger,
                    logging.ERROR,
                    execution,
                    "task %d: a task_finished receiver failed",
                    execution.id,
                    exc_info=True,
                )


def finished_result(execution: Execution, row: Task | None, status: str | None, outcome: Outcome | None) -> TaskResult:
    """The result ``task_finished`` carries for an attempt that ended."""
    run: DjangoRun = execution.django
    if row is not None and row.token == execution.token and row.status != TaskStatus.RUNNING:
        return task_result(row, default_alias=run.result.backend, task=run.task)  # the row as this attempt left it
    # The row has moved on (claimed again, or a lapsed lease that recovery has not returned yet) or
    # could not be read: this attempt as far as it went, with the status it was stored with (a lost
    # attempt's task goes back to the queue).
    base = run.result
    errors = list(base.errors)
    worker_ids = list(base.worker_ids)
    started_at = base.started_at
    if row is not None:
        errors = task_errors(row.errors, up_to_token=execution.token)
        worker_ids = list(row.worker_ids)[: execution.attempt] or worker_ids
        started_at = row.started_at or started_at
    elif outcome is not None and outcome.failure is not None:
        errors.append(
            TaskError(exception_class_path=outcome.failure.exception_class_path, traceback=outcome.failure.traceback)
        )
    final = _STATUS[TaskStatus(status or TaskStatus.READY)]
    result: TaskResult = TaskResult(
        task=run.task,
        id=base.id,
        status=final,
        enqueued_at=base.enqueued_at,
        started_at=started_at,
        finished_at=timezone.now() if final in (TaskResultStatus.SUCCESSFUL, TaskResultStatus.FAILED) else None,
        last_attempted_at=base.last_attempted_at,
        args=base.args,
        kwargs=base.kwargs,
        backend=base.backend,
        errors=errors,
        worker_ids=worker_ids,
    )
    if final == TaskResultStatus.SUCCESSFUL and outcome is not None and outcome.value_json is not None:
        object.__setattr__(result, "_return_value", json.loads(outcome.value_json))
    return result


def send_finished(sender: Any, result: TaskResult, error: BaseException | None) -> None:
    if error is None:
        task_finished.send(sender=sender, task_result=result)
        return
    # Receivers expect to run while the attempt's exception is being handled (Django's own logs
    # sys.exc_info()): raise it again here, with the traceback the handler left.
    traceback = error.__traceback__
    try:
        raise error
    except BaseException:
        error.__traceback__ = traceback
        task_finished.send(sender=sender, task_result=result)
