"""Fixtures shared by the database tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection
from django.test import Client
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from leasing.bounds import unbound
from tasks.lifecycle import prepared
from tests.factories import StaffFactory
from tests.helpers.api import TOKEN, Api
from tests.helpers.tracing import global_provider


@pytest.fixture
def staff(client: Client) -> Client:
    """The test client, logged in as a staff superuser."""
    client.force_login(StaffFactory.create())
    return client


@pytest.fixture
def api(client: Client) -> Api:
    """The JSON API, called with ``TOKEN`` (which the module's settings fixture must accept)."""
    return Api(client)


@pytest.fixture
def api_token(settings: Any) -> None:
    """``TOKEN`` is the one API token, with every scope."""
    settings.LEASING_API_TOKENS = [TOKEN]


@pytest.fixture
def api_token_and_reader(settings: Any) -> None:
    """``TOKEN`` with every scope, and the token ``reader`` that may only read tasks."""
    settings.LEASING_API_TOKENS = [TOKEN, "reader:tasks.view_task"]


@pytest.fixture
def routes(settings: Any) -> None:
    """Two databases: the queue "reports" and the lease namespace "billing:" live in "second", the rest
    in "default"; ``TOKEN`` may call the API and enqueue the test app's handlers."""
    settings.LEASING_TASKS = {
        "QUEUE_DATABASES": {"reports": "second"},
        "API_TASK_PATTERNS": ["tests.testapp.handlers.*"],
    }
    settings.LEASING = {"DATABASES": {"billing:": "second"}}
    settings.LEASING_API_TOKENS = [TOKEN]


@pytest.fixture
def fair_queues(settings: Any) -> None:
    """The queue "fair" is fair (LEASING_TASKS["FAIR_QUEUES"])."""
    settings.LEASING_TASKS = {**getattr(settings, "LEASING_TASKS", {}), "FAIR_QUEUES": ["fair"]}


@pytest.fixture
def fresh_session() -> Iterator[None]:
    """A session without prepared statements (another test's may still be on this connection), and
    none known to be refused; after the test, the connection without the worker's bounds again."""
    connection.ensure_connection()
    with connection.cursor() as cursor:
        cursor.execute("DEALLOCATE ALL")
    connection.connection._prepared.clear()
    prepared._refused.clear()
    yield
    unbound(connection)
    prepared._refused.clear()


@pytest.fixture
def spans(settings: Any) -> Iterator[InMemorySpanExporter]:
    """The spans the test makes, in memory (a global tracer provider for the test); retries come at
    once (TRACING: the default, None)."""
    settings.LEASING_TASKS = {"BACKOFF_BASE": 0.01, "BACKOFF_MAX": 0.05}
    with global_provider() as exporter:
        yield exporter


@pytest.fixture
def current() -> Iterator[None]:
    """A test that sets an attempt as the current task (tasks.runtime._set_current, as an executor
    does, for durable steps) ends with none set."""
    from tasks.runtime import _set_current

    yield
    _set_current(None)
