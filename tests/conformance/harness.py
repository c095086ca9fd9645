"""Test cases for Django's task tests run against LeaseBackend, with or without a real worker.

- :class:`BackendTestCase`: the backend alone, no worker (what Django's DummyBackend tests check:
  nothing runs, every result stays READY). Every signal of this process is recorded.
- :class:`ThreadWorkerTestCase` / :class:`ProcessWorkerTestCase`: a real worker serves the queue,
  in a thread of this process or as ``manage.py run_worker`` in another process (which records its
  signals and django.tasks logs into files this process reads, see ``recorder.py``). A test waits
  for the worker with :meth:`wait_finished` (a poll with a deadline, on the worker's own
  ``task_finished``), then makes Django's assertions unchanged.

TransactionTestCase: the worker (another thread or process) only sees committed rows.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

from django.db import connections
from django.test import TransactionTestCase

from tasks.compat import LOGGER_NAME, TaskResult
from tasks.worker.process import Worker
from tests.conformance.recorder import (
    EVENTS_ENV,
    LOGS_ENV,
    EventRecorder,
    file_size,
    read_events,
    read_lines,
)
from tests.helpers import start_manage, stop_process, wait_until

#: Django's reference backends run a task once; the conformance runs do the same. Retries (this
#: queue's own semantics) are covered in test_lease_backend.py.
CONFORMANCE_LEASING_TASKS = {"MAX_ATTEMPTS": 1, "BACKOFF_BASE": 0.01, "BACKOFF_MAX": 0.05}
QUEUES = ("default", "queue_1")
FINISHED = ("SUCCESSFUL", "FAILED")
WAIT = 30.0


class BackendTestCase(TransactionTestCase):
    """LeaseBackend with nothing serving the queue; every task signal of this process recorded."""

    mode: ClassVar[str] = "none"
    workdir: ClassVar[Path]
    events_path: ClassVar[str]
    worker_logs_path: ClassVar[str | None] = None
    _recorder: ClassVar[EventRecorder]

    @classmethod
    def setUpClass(cls) -> None:
        super().setUpClass()
        cls.workdir = Path(tempfile.mkdtemp(prefix="conformance-"))
        cls.events_path = str(cls.workdir / "events.jsonl")
        cls._recorder = EventRecorder(cls.events_path)
        cls._recorder.attach()

    @classmethod
    def tearDownClass(cls) -> None:
        cls._recorder.detach()
        shutil.rmtree(cls.workdir, ignore_errors=True)
        super().tearDownClass()

    def setUp(self) -> None:
        super().setUp()
        self._events_offset = file_size(self.events_path)

    # -- what the signals carried ------------------------------------------------------------

    def events(self, result_id: str | None = None, signal: str | None = None) -> list[dict[str, Any]]:
        """The signals recorded since this test began (of ``result_id``, of one kind)."""
        return [
            e
            for e in read_events(self.events_path, self._events_offset)
            if (result_id is None or e["id"] == result_id) and (signal is None or e["signal"] == signal)
        ]

    def _finished_event(self, result_id: str) -> dict[str, Any] | None:
        for event in self.events(result_id, "finished"):
            if event["status"] in FINISHED:
                return event
        return None

    def wait_signalled(self, result: TaskResult, timeout: float = WAIT) -> dict[str, Any]:
        """Wait until the worker sent ``task_finished`` for the result's last attempt (and so every
        receiver connected before the recorder, Django's own log receiver included, ran). Returns
        what the signal carried."""
        event = wait_until(lambda: self._finished_event(result.id), timeout, what=f"task {result.id} to finish")
        self.assert_sent_by_the_worker(event)
        return event

    def assert_sent_by_the_worker(self, event: dict[str, Any]) -> None:
        """The worker under test sent it: this process's in the thread mode, another's otherwise."""
        if self.mode == "process":
            assert event["pid"] != os.getpid(), event
        elif self.mode == "thread":
            assert event["pid"] == os.getpid(), event

    def wait_finished(self, result: TaskResult, timeout: float = WAIT) -> dict[str, Any]:
        """:meth:`wait_signalled`, then refresh the result."""
        event = self.wait_signalled(result, timeout)
        result.refresh()
        return event

    async def await_signalled(self, result: TaskResult, timeout: float = WAIT) -> dict[str, Any]:
        """:meth:`wait_signalled` for async tests (it reads only files while it polls)."""
        deadline = time.monotonic() + timeout
        while (event := self._finished_event(result.id)) is None:
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout}s waiting for task {result.id} to finish")
            await asyncio.sleep(0.02)
        self.assert_sent_by_the_worker(event)
        return event

    async def await_finished(self, result: TaskResult, timeout: float = WAIT) -> dict[str, Any]:
        """:meth:`await_signalled`, then refresh the result."""
        event = await self.await_signalled(result, timeout)
        await result.arefresh()
        return event

    # -- what django.tasks logged --------------------------------------------------------------

    @contextmanager
    def task_logs(self, level: str = "INFO") -> Iterator[LogCapture]:
        """``assertLogs("django.tasks", level)``, wherever the records are written: this process,
        and the worker process in the process mode (read from its log file)."""
        capture = LogCapture(logging.getLevelName(level), self.worker_logs_path)
        logger = logging.getLogger(LOGGER_NAME)
        saved = (logger.level, logger.propagate)
        logger.addHandler(capture.handler)
        logger.setLevel(capture.level)
        logger.propagate = False
        try:
            yield capture
        finally:
            logger.removeHandler(capture.handler)
            logger.setLevel(saved[0])
            logger.propagate = saved[1]
        if not capture.output:
            raise AssertionError(f"no logs of level {level} or higher triggered on {LOGGER_NAME}")


class LogCapture:
    def __init__(self, level: int, worker_logs_path: str | None) -> None:
        self.level = level
        self.records: list[logging.LogRecord] = []
        self.handler = _Collect(self)
        self.worker_logs_path = worker_logs_path
        self.offset = file_size(worker_logs_path) if worker_logs_path else 0

    @property
    def output(self) -> list[str]:
        formatter = logging.Formatter("%(levelname)s:%(name)s:%(message)s")
        local = [formatter.format(record) for record in self.records]
        if self.worker_logs_path is None:
            return local
        remote = read_lines(self.worker_logs_path, self.offset)
        return local + [r["output"] for r in remote if r["levelno"] >= self.level]


class _Collect(logging.Handler):
    def __init__(self, capture: LogCapture) -> None:
        super().__init__(capture.level)
        self.capture = capture

    def emit(self, record: logging.LogRecord) -> None:
        self.capture.records.append(record)


class ThreadWorkerTestCase(BackendTestCase):
    """A real :class:`~tasks.worker.Worker` serving the queue from a thread of this process."""

    mode = "thread"
    worker: ClassVar[Worker]
    _thread: ClassVar[threading.Thread]

    @classmethod
    def setUpClass(cls) -> None:
        super().setUpClass()
        cls.worker = Worker(
            queues=QUEUES,
            concurrency=2,
            ttl=5,
            poll_interval=0.05,
            recovery=False,
            install_signal_handlers=False,
            worker_id=f"conformance-thread-{cls.__name__}",
        )

        def serve() -> None:
            try:
                cls.worker.run()
            finally:
                connections.close_all()

        cls._thread = threading.Thread(target=serve, name="conformance-worker")
        cls._thread.start()

    @classmethod
    def tearDownClass(cls) -> None:
        cls.worker.request_stop()
        cls.worker.request_stop()
        cls._thread.join(30)
        alive = cls._thread.is_alive()
        super().tearDownClass()
        assert not alive, "the worker thread did not stop"


class ProcessWorkerTestCase(BackendTestCase):
    """``manage.py run_worker`` in another process, recording its signals and logs into files."""

    mode = "process"
    worker_id: ClassVar[str]
    _process: ClassVar[subprocess.Popen[bytes]]

    @classmethod
    def setUpClass(cls) -> None:
        super().setUpClass()
        cls.worker_logs_path = str(cls.workdir / "worker-logs.jsonl")
        cls.worker_id = f"conformance-process-{cls.__name__}"
        cls._process = start_manage(
            cls.workdir / "worker.log",
            "run_worker",
            "--queues",
            ",".join(QUEUES),
            "--concurrency",
            "2",
            "--ttl",
            "5",
            "--poll-interval",
            "0.05",
            "--no-recovery",
            "--worker-id",
            cls.worker_id,
            DJANGO_SETTINGS_MODULE="tests.conformance.worker_settings",
            **{EVENTS_ENV: cls.events_path, LOGS_ENV: cls.worker_logs_path},
        )
        from tasks.models import Worker as WorkerRow

        try:
            wait_until(
                lambda: cls._process.poll() is not None or WorkerRow.objects.filter(name=cls.worker_id).exists(),
                WAIT,
                what="the worker process to start",
            )
        except BaseException:
            stop_process(cls._process)  # never left running to claim the next classes' tasks
            super().tearDownClass()
            raise
        if cls._process.poll() is not None:
            log = (cls.workdir / "worker.log").read_text()
            super().tearDownClass()
            raise AssertionError(f"the worker process exited at start: {log}")

    @classmethod
    def tearDownClass(cls) -> None:
        code = stop_process(cls._process)
        log = (cls.workdir / "worker.log").read_text()
        super().tearDownClass()
        assert code == 0, f"the worker process exited with {code}: {log}"
