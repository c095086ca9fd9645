"""Where a process LISTENs on a database alias (the worker's wake-ups, a caller waiting for a task to
finish): on the alias's own connection settings when it is not pooled
(``LEASING_TASKS["POOLED_DATABASES"]``), on its direct URL when one is given
(``LEASING_TASKS["LISTEN_URLS"]``), else nowhere: the caller polls. See tasks/worker/listener.py."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import psycopg
from django.db import connections
from psycopg.conninfo import conninfo_to_dict

from tasks.conf import get_settings


@dataclass(frozen=True, slots=True)
class WakeUp:
    description: str  # for the start line: never a password
    connect: Callable[[], psycopg.Connection] | None  # an autocommit connection to LISTEN on; None: poll
    using: str = "default"  # the database alias it serves
    #: The same connection for async code (an event loop's waits), opened on the loop; None: poll.
    aconnect: Callable[[], Awaitable[psycopg.AsyncConnection]] | None = None


def wakeup_for(using: str, poll_interval: float) -> WakeUp:
    conf = get_settings()
    url = conf.LISTEN_URLS.get(using)
    if url and not parsable(url):
        # libpq's parse error quotes the token it could not read (a password, say): never log it.
        # Refused by tasks.E106 at start; with the checks skipped, the worker polls.
        return WakeUp(f"polling every {poll_interval:g}s (the LISTEN_URLS entry of {using} cannot be parsed)", None)
    if url:
        return WakeUp(
            f"LISTEN on the direct URL of {using} ({where(url)})",
            lambda: psycopg.connect(url, autocommit=True),
            using,
            lambda: psycopg.AsyncConnection.connect(url, autocommit=True),
        )
    if using in conf.POOLED_DATABASES:
        return WakeUp(f"polling every {poll_interval:g}s ({using} is pooled and has no LISTEN_URLS entry)", None)
    wrapper = connections[using]

    def connect() -> psycopg.Connection:
        conn = wrapper.get_new_connection(wrapper.get_connection_params())
        conn.autocommit = True
        return conn

    return WakeUp(f"LISTEN on {using}", connect, using, lambda: connect_async(using))


async def connect_async(using: str) -> psycopg.AsyncConnection:
    """An autocommit async connection to the alias's database, on its own settings (through its
    pooler, if it has one): Django's connection parameters, less its sync cursor class."""
    params: dict[str, Any] = connections[using].get_connection_params()
    params.pop("cursor_factory", None)
    return await psycopg.AsyncConnection.connect(**params, autocommit=True)


def through_a_pooler(conn: psycopg.Connection) -> bool:
    """Whether ``conn`` reaches PostgreSQL through a pooler: the backend pid its startup announced is
    not the pid of the server session that answers (see the module doc)."""
    row = conn.execute("SELECT pg_backend_pid()").fetchone()
    return row is not None and row[0] != conn.info.backend_pid


async def athrough_a_pooler(conn: psycopg.AsyncConnection) -> bool:
    """:func:`through_a_pooler` for an async connection."""
    row = await (await conn.execute("SELECT pg_backend_pid()")).fetchone()
    return row is not None and row[0] != conn.info.backend_pid


def parsable(url: str) -> bool:
    """Whether libpq can read ``url`` (a URL or a conninfo string)."""
    try:
        conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        return False
    return True


def where(url: str) -> str:
    """host:port/dbname of a URL or conninfo string, without its credentials."""
    try:
        parts = conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        return "an unparsable URL"
    host = parts.get("host") or "local socket"
    port = f":{parts['port']}" if parts.get("port") else ""
    return f"{host}{port}/{parts.get('dbname') or ''}"
