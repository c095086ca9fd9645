"""Helpers for tests that start real processes against the test database."""

from __future__ import annotations

import datetime as dt
import json
import os
import select
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any
from urllib.parse import quote

from django.db import connection

from tests.helpers import zygote

ROOT = Path(__file__).resolve().parents[2]


def test_database_url() -> str:
    """A DATABASE_URL naming the test database that pytest-django created."""
    s = connection.settings_dict
    auth = quote(s["USER"] or "")
    if s["PASSWORD"]:
        auth += ":" + quote(s["PASSWORD"])
    host = s["HOST"] or ""
    port = f":{s['PORT']}" if s["PORT"] else ""
    query = ""
    options = s.get("OPTIONS") or {}
    socket_host = options.get("host")
    if socket_host:
        query = f"?host={quote(socket_host)}"
        if options.get("port"):  # a server on another port than 5432 (Debian's PostgreSQL 15 in CI)
            query += f"&port={options['port']}"
    return f"postgres://{auth}@{host}{port}/{s['NAME']}{query}"


def iso_time(text: str) -> dt.datetime:
    """A date-time as PostgreSQL's JSON and the API write it (1 to 6 fraction digits: the zeros at the
    end are dropped), read alike on every Python (3.10's ``fromisoformat`` takes 3 or 6 digits only)."""
    from django.utils.dateparse import parse_datetime

    parsed = parse_datetime(text)
    assert parsed is not None, f"not a date-time: {text!r}"
    return parsed


def db_now() -> dt.datetime:
    """The database clock now (``clock_timestamp()``: the time as the server reads it, inside a test's
    transaction too), what the statements under test compare their times with."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT clock_timestamp()")
        now: dt.datetime = cursor.fetchone()[0]
    return now


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(DATABASE_URL=test_database_url(), DJANGO_SETTINGS_MODULE="tests.settings", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def start_child(helper: str, *args: str, **env: str) -> subprocess.Popen[str]:
    """Start ``tests/helpers/<helper>.py``'s ``main(args)`` in a new process, with pipes for JSON lines."""
    return zygote.popen_python(
        ["-m", "tests.helpers.child", helper, *args],
        cwd=ROOT,
        env=child_env(**env),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@contextmanager
def ensure_ended(proc: subprocess.Popen[str]) -> Iterator[subprocess.Popen[str]]:
    """On the way out, resume and kill a child that is still running (a failed test), and close its
    pipes (left to the garbage collector, they fail a later test with a ResourceWarning)."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            with suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait(30)
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()


@contextmanager
def sql_installed(create: str, drop: str) -> Iterator[None]:
    """The test's own tables, functions and triggers (``create``) for the block; ``drop`` runs before
    (what a killed run left behind goes too) and after."""
    with connection.cursor() as cursor:
        cursor.execute(drop)
        cursor.execute(create)
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute(drop)


def read_message(proc: subprocess.Popen[str], timeout: float = 120.0) -> dict[str, Any]:
    """The next JSON line the child prints, or fail after ``timeout`` seconds: a ceiling for a child
    that hangs, not a claim of speed (a child's start took over 30 s once beside the suite's load).

    Read from the pipe a byte at a time, never past the line: ``communicate()`` reads the pipe itself,
    not the file object's buffer, so a buffered read here lost what the child printed after the line
    (a child that raced on while the test waited for another's start: a grant's JSON cut in two)."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    deadline = time.monotonic() + timeout
    line = bytearray()
    while not line.endswith(b"\n"):
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            raise AssertionError(f"child printed no whole line within {timeout}s: {bytes(line)!r}")
        byte = os.read(fd, 1)
        if not byte:
            stderr = proc.stderr.read() if proc.stderr else ""
            raise AssertionError(f"child exited ({proc.wait()}) without a message: {bytes(line)!r} {stderr}")
        line += byte
    return json.loads(line)


def send(proc: subprocess.Popen[str], message: dict[str, Any]) -> None:
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(message) + "\n")
    proc.stdin.flush()


#: The least time wait_until gives a condition before it fails the test: a hang guard, not a
#: deadline. A loaded two-core machine may take many times as long as a quiet one, and a test that is
#: right waits only as long as the work takes (three clean-clone runs each failed on one shorter
#: guard, on a condition that came a little later).
HANG_GUARD = 60.0


def wait_until(
    predicate: Callable[[], Any],
    timeout: float = HANG_GUARD,
    interval: float = 0.02,
    what: str = "",
    *,
    expect_timeout: bool = False,
) -> Any:
    """Poll ``predicate`` until it returns something truthy, or fail after ``timeout`` seconds, but
    never sooner than HANG_GUARD: a shorter ``timeout`` is only honoured with ``expect_timeout=True``
    (a test that asserts a condition does NOT come within a while, under ``pytest.raises``)."""
    if not expect_timeout:
        timeout = max(timeout, HANG_GUARD)
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        time.sleep(interval)


def wait_while_moving(
    predicate: Callable[[], Any], progress: Callable[[], Any], stall: float = 120.0, what: str = ""
) -> Any:
    """Poll ``predicate`` until it returns something truthy, failing only when ``progress()`` (a
    count, a tuple of counts: anything that changes while the work moves) stayed the same for
    ``stall`` seconds: a hang fails, a slow machine only waits longer (a fixed deadline failed runs
    on a loaded two-core machine where the work was moving)."""
    seen = progress()
    moved = time.monotonic()
    while True:
        result = predicate()
        if result:
            return result
        now = progress()
        if now != seen:
            seen, moved = now, time.monotonic()
        elif time.monotonic() - moved > stall:
            raise AssertionError(f"nothing moved for {stall}s (still at {seen!r}) waiting for {what or predicate}")
        time.sleep(0.2)


def emit(**message: Any) -> None:
    """For child scripts: one JSON line on stdout."""
    print(json.dumps(message, default=str), flush=True)


def start_manage(log_path: Path, command: str, *args: str, **env: str) -> subprocess.Popen[bytes]:
    """Start ``python manage.py command args`` on the test database, logging to ``log_path``
    (a file, not a pipe: a worker that logs a lot would block on a full pipe nobody reads)."""
    with open(log_path, "ab") as log:  # the child has its own copy
        return zygote.popen_python(
            ["manage.py", command, *args],
            cwd=ROOT,
            env=child_env(**env),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def stop_process(proc: subprocess.Popen[Any], timeout: float = 30.0) -> int:
    """SIGCONT + SIGTERM, then SIGKILL after ``timeout``; returns the exit code."""
    if proc.poll() is None:
        with suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
            os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)
    return proc.returncode


def worker_names(ids: list[str]) -> list[str]:
    """The names behind worker ids (``name:suffix``, a suffix new at each start): what a test that
    started workers with ``--worker-id name`` compares ``worker_ids`` and holders with."""
    return [worker_id.rsplit(":", 1)[0] for worker_id in ids]


def worker_row(name: str, using: str = "default") -> Any:
    """The latest start of the worker named ``name``."""
    from tasks.models import Worker

    return Worker.objects.using(using).filter(name=name).order_by("-started_at").first()


@contextmanager
def worker_in_thread(worker: Any) -> Iterator[Any]:
    """Run a :class:`tasks.worker.process.Worker` in a thread of the test process for the block;
    stop it (twice: no grace) and join it after, its thread's connections closed."""
    import threading

    from django.db import connections

    def run() -> None:
        try:
            worker.run()
        finally:
            connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()
    try:
        yield worker
    finally:
        worker.request_stop()
        worker.request_stop()
        thread.join(30)
    assert not thread.is_alive(), "the worker thread did not stop"


def drain_one_by_one(worker: str = "w1") -> list[int]:
    """Claim and complete, one task at a time, until nothing is claimable; the ids in finishing order."""
    from tasks.models import Task

    done = []
    while claimed := Task.objects.claim(worker, limit=1):
        (task,) = claimed
        assert Task.objects.complete_many(worker, [(task.id, task.token, json.dumps(None))])
        done.append(task.id)
    return done


def enqueue_params(**overrides: Any) -> dict[str, Any]:
    """The parameters of the enqueue statements (tasks/lifecycle/statements.py, ENQUEUE_SQL and its
    window forms) for a plain no-op task of queue "default", for tests that send those statements
    themselves (on a second connection, through a pooler); ``overrides`` set or add the rest."""
    return {
        "queue": "default",
        "priority": 0,
        "task_path": "tests.testapp.handlers.noop",
        "args": "[]",
        "kwargs": "{}",
        "run_after": None,
        "max_attempts": 3,
        "timeout": None,
        "dedup_key": None,
        "backend_alias": None,
        "concurrency_key": None,
        "concurrency_limit": None,
        "retry_policy": None,
        "rate_key": None,
        "rate_limit": None,
        "rate_period": None,
        "trace_context": None,
        "fair_key": None,
        **overrides,
    }
