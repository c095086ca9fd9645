"""What django.tasks' signals carried and what its loggers wrote, as JSON lines in files the tests
read: the worker that sends ``task_started`` / ``task_finished`` may be another process.

Each signal is recorded with the stored status of its task *at the moment the receiver ran*, so a
test can tell that ``task_finished`` came after the outcome was written.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

from tasks.compat import LOGGER_NAME, TaskResult, task_enqueued, task_finished, task_started

EVENTS_ENV = "CONFORMANCE_EVENTS"
LOGS_ENV = "CONFORMANCE_LOGS"

SIGNALS = {"enqueued": task_enqueued, "started": task_started, "finished": task_finished}


def _when(value: dt.datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def snapshot(signal: str, sender: Any, task_result: TaskResult) -> dict[str, Any]:
    from tasks.models import Task

    task = task_result.task
    stored = None
    if task_result.id.isdigit():  # a LeaseBackend result (the immediate backend's ids are random strings)
        stored = Task.objects.filter(pk=int(task_result.id)).values_list("status", flat=True).first()
    return {
        "signal": signal,
        "sender": f"{sender.__module__}.{sender.__qualname__}",
        "pid": os.getpid(),
        "id": task_result.id,
        "status": str(task_result.status),
        "stored_status": stored,
        "enqueued_at": _when(task_result.enqueued_at),
        "started_at": _when(task_result.started_at),
        "last_attempted_at": _when(task_result.last_attempted_at),
        "finished_at": _when(task_result.finished_at),
        "attempts": task_result.attempts,
        "worker_ids": list(task_result.worker_ids),
        "errors": [[e.exception_class_path, e.traceback] for e in task_result.errors],
        "return_value": getattr(task_result, "_return_value", None),
        "backend": task_result.backend,
        "task": {
            "module_path": task.module_path,
            "priority": task.priority,
            "queue_name": task.queue_name,
            "run_after": _when(task.run_after),
            "backend": task.backend,
        },
    }


def _append(path: str, record: dict[str, Any]) -> None:
    # One write per line on an O_APPEND file: lines from several processes do not interleave.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(record, default=str) + "\n").encode())
    finally:
        os.close(fd)


class EventRecorder:
    """Receivers for the three task signals, appending a snapshot of each to ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._receivers: list[tuple[Any, Any]] = []

    def attach(self) -> None:
        for name, signal in SIGNALS.items():

            def receiver(sender: Any, task_result: TaskResult, _name: str = name, **kwargs: Any) -> None:
                _append(self.path, snapshot(_name, sender, task_result))

            signal.connect(receiver, weak=False)
            self._receivers.append((signal, receiver))

    def detach(self) -> None:
        for signal, receiver in self._receivers:
            signal.disconnect(receiver)
        self._receivers.clear()


def read_events(path: str, offset: int = 0) -> list[dict[str, Any]]:
    """The events recorded in ``path`` from byte ``offset`` on."""
    return read_lines(path, offset)


class JsonLinesHandler(logging.Handler):
    """Log records as JSON lines, each formatted as ``assertLogs`` formats them (traceback included)."""

    def __init__(self, path: str) -> None:
        super().__init__(logging.DEBUG)
        self.path = path
        self.setFormatter(logging.Formatter("%(levelname)s:%(name)s:%(message)s"))
        self._lock_write = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = {"levelno": record.levelno, "name": record.name, "output": self.format(record)}
            with self._lock_write:
                _append(self.path, line)
        except Exception:
            self.handleError(record)


def read_lines(path: str, offset: int = 0) -> list[dict[str, Any]]:
    file = Path(path)
    if not file.exists():
        return []
    with file.open("rb") as stream:
        stream.seek(offset)
        data = stream.read()
    # A line being appended right now may be read in part: only whole lines (up to a newline) count.
    data = data[: data.rfind(b"\n") + 1]
    return [json.loads(line) for line in data.decode().splitlines() if line.strip()]


def file_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except FileNotFoundError:
        return 0


def attach_from_environment() -> None:
    """In a worker process: record signals and django.tasks logs where the environment says."""
    events = os.environ.get(EVENTS_ENV)
    if events:
        EventRecorder(events).attach()
    logs = os.environ.get(LOGS_ENV)
    if logs:
        logger = logging.getLogger(LOGGER_NAME)
        logger.addHandler(JsonLinesHandler(logs))
        logger.setLevel(logging.DEBUG)
