"""Fixtures shared by every kind of test: each defined once, here or in the conftest.py of the one
folder that uses it (tests/db, tests/concurrency)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from django.db import DEFAULT_DB_ALIAS, connection, connections

from leasing.holder import default_holder_id
from tests.helpers import flush, order, start_manage, stop_process, zygote
from tests.helpers import test_database_url as database_url  # not collected as a test
from tests.helpers.api import TOKEN, Api
from tests.helpers.pgbouncer import Bouncer, pgbouncer
from tests.helpers.pgproxy import PgProxy
from tests.helpers.task_paths import NOOP

# The time each lane took, at the end of every run (docs/CONTRIBUTING.md); a repair fails its test.
pytest_plugins = ["tests.helpers.lanes", "tests.helpers.repairs"]

# A transactional test ends by emptying the tables it wrote to, not all of them (tests/helpers/flush.py).
flush.install()


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[Any]) -> None:
    """The longest files first (tests/helpers/order.py): xdist hands out files in this order."""
    items[:] = order.longest_first(items)


@pytest.fixture(autouse=True)
def no_finished_history_left(request: pytest.FixtureRequest, django_db_blocker: Any) -> Iterator[None]:
    """After a transactional test, empties ``tasks_finished``. Django's flush empties every model's
    table, but the finished history's day partitions are no model's (the mover's, tasks/models/
    finished.py): what a test's real leader moved there would outlive the test and show on the next
    one's lists (the demo walk once listed 44 FAILED rows an earlier test had made)."""
    yield
    marker = request.node.get_closest_marker("django_db")
    transactional = bool(marker and marker.kwargs.get("transaction")) or bool(
        {"transactional_db", "live_server"} & set(request.fixturenames)
    )
    if not transactional:
        return  # a test in a transaction leaves nothing: it is rolled back
    aliases = (marker.kwargs.get("databases") if marker else None) or [DEFAULT_DB_ALIAS]
    if aliases == "__all__":
        aliases = list(connections)
    with django_db_blocker.unblock():
        for alias in aliases:
            with connections[alias].cursor() as cursor:
                # A test that migrated backwards may have left no tasks_finished at all.
                cursor.execute("SELECT to_regclass('tasks_finished') IS NOT NULL")
                if cursor.fetchone()[0]:
                    cursor.execute("SELECT EXISTS (SELECT FROM tasks_finished)")
                    if cursor.fetchone()[0]:
                        cursor.execute("TRUNCATE tasks_finished")


@pytest.fixture(autouse=True)
def no_child_left() -> Iterator[None]:
    """A child process the test started (``start_manage``, ``start_child``, ``popen_python``) and left
    running is killed when the test ends, and fails it: a test that failed before its ``finally``
    once left a worker that claimed the next tests' tasks in its worker's database, and one of them
    waited for a task that worker had taken until the run was stopped. Set up before, so ended after,
    the test's own function-scoped fixtures: what they stop on the way out is not counted."""
    place = zygote.mark()
    yield
    left = zygote.end_started_since(place)
    assert not left, f"the test left these processes running (killed now): {left}"


@pytest.fixture
def holder_id() -> str:
    return default_holder_id()


@pytest.fixture
def other_holder_id() -> str:
    return default_holder_id()


@pytest.fixture
def short_leasing(settings: Any) -> None:
    """Fast clocks for holder tests: short backoff so retries do not dominate the run time."""
    settings.LEASING = {"DEFAULT_TTL": 1.0, "BACKOFF_INITIAL": 0.01, "BACKOFF_MAX": 0.1}


# -- real processes and servers beside the test ------------------------------------------------------


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Any]:
    """Starts ``manage.py <command>`` processes, stopped after the test: ``processes(command, *args,
    name=..., **env)`` returns the process, which logs to ``processes.logs / f"{name}.log"`` (the name
    defaults to the command and a count)."""
    started: list[subprocess.Popen[bytes]] = []

    def start(command: str, *args: str, name: str | None = None, **env: str) -> subprocess.Popen[bytes]:
        proc = start_manage(tmp_path / f"{name or f'{command}-{len(started)}'}.log", command, *args, **env)
        started.append(proc)
        return proc

    start.logs = tmp_path  # type: ignore[attr-defined]
    yield start
    for proc in started:
        stop_process(proc)


def _bouncer(pool_size: int) -> Iterator[Bouncer]:
    with pgbouncer(connection.settings_dict, pool_size=pool_size) as running:
        yield running


@pytest.fixture
def bouncer_pool_of_1() -> Iterator[Bouncer]:
    """A real PgBouncer in transaction pooling with ONE server connection: every client's transactions
    take turns on the same server session (what one leaves behind, the next finds)."""
    yield from _bouncer(1)


@pytest.fixture
def bouncer_pool_of_2() -> Iterator[Bouncer]:
    """A real PgBouncer in transaction pooling with two server connections (a test that holds one in a
    transaction steers every other client onto the other)."""
    yield from _bouncer(2)


@pytest.fixture
def bouncer_pool_of_3() -> Iterator[Bouncer]:
    """A real PgBouncer in transaction pooling with three server connections, fewer than its clients."""
    yield from _bouncer(3)


@pytest.fixture
def bouncer_pool_of_4() -> Iterator[Bouncer]:
    """A real PgBouncer in transaction pooling with four server connections, fewer than its clients."""
    yield from _bouncer(4)


@pytest.fixture
def proxy() -> Iterator[PgProxy]:
    """The fault-injecting proxy in front of the test database (tests/helpers/pgproxy.py). A test that
    also starts workers through it requests ``proxy`` before ``workers``, so that it stops after them."""
    with PgProxy.from_database_url(database_url()) as running:
        yield running


@pytest.fixture
def old_snapshot() -> Iterator[None]:
    """Another session holding a REPEATABLE READ snapshot (an analytics query, a forgotten
    transaction, pg_dump): no row version dead since it began can be removed, nor its index entries
    marked dead, for the test."""
    with psycopg.connect(database_url()) as holder:
        holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT count(*) FROM tasks_task").fetchone()
        yield
        holder.rollback()


# -- settings ----------------------------------------------------------------------------------------


@pytest.fixture
def schedule_api_settings(settings: Any) -> None:
    """The JSON API may enqueue the no-op handler and answers the test token: what the stored-schedule
    tests write schedules with."""
    settings.LEASING_TASKS = {"API_TASKS": [NOOP]}
    settings.LEASING_API_TOKENS = [TOKEN]


@pytest.fixture
def task_api(client: Any, settings: Any) -> Api:
    """The JSON API for a test that enqueues the test app's handlers through it: ``TOKEN`` may call
    it, and the handlers are allowed (API_TASK_PATTERNS)."""
    settings.LEASING_API_TOKENS = [TOKEN]
    settings.LEASING_TASKS = {"API_TASK_PATTERNS": ["tests.testapp.handlers.*"]}
    return Api(client)


@pytest.fixture
def fair_queue_api(settings: Any) -> None:
    """The queue "fair" is fair, ``TOKEN`` (tests/helpers/api.py) may call the API and enqueue the test
    app's handlers, and no fair cursor an earlier test's API claims kept in this process is left."""
    from tasks.web.api import tasks as api_tasks

    settings.LEASING_API_TOKENS = [TOKEN]
    settings.LEASING_TASKS = {
        **getattr(settings, "LEASING_TASKS", {}),
        "API_TASK_PATTERNS": ["tests.testapp.handlers.*"],
        "FAIR_QUEUES": ["fair"],
    }
    api_tasks._fair_cursors.clear()
