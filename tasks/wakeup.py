"""How an idle worker learns of new work: LISTEN where a session is its own, polling where it is not.

Behind a transaction pooler (PgBouncer ``pool_mode = transaction``) a LISTEN holds on whichever server
connection ran it, which the pooler hands to other clients between transactions; notifications are
then lost or delivered to someone else. So a worker LISTENs on the alias's own connection settings
only when the alias is not pooled (``LEASING_TASKS["POOLED_DATABASES"]``), on a direct URL when one is
given (``LEASING_TASKS["LISTEN_URLS"]``), and otherwise polls every poll interval. The worker's start
line says which.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import psycopg
from django.db import connections
from psycopg.conninfo import conninfo_to_dict

from tasks.conf import get_settings


@dataclass(frozen=True, slots=True)
class WakeUp:
    description: str  # for the start line: never a password
    connect: Callable[[], psycopg.Connection] | None  # an autocommit connection to LISTEN on; None: poll


def wakeup_for(using: str, poll_interval: float) -> WakeUp:
    conf = get_settings()
    url = conf.LISTEN_URLS.get(using)
    if url and not parsable(url):
        # libpq's parse error quotes the token it could not read (a password, say): never log it.
        # Refused by tasks.E106 at start; with the checks skipped, the worker polls.
        return WakeUp(f"polling every {poll_interval:g}s (the LISTEN_URLS entry of {using} cannot be parsed)", None)
    if url:
        return WakeUp(
            f"LISTEN on the direct URL of {using} ({where(url)})", lambda: psycopg.connect(url, autocommit=True)
        )
    if using in conf.POOLED_DATABASES:
        return WakeUp(f"polling every {poll_interval:g}s ({using} is pooled and has no LISTEN_URLS entry)", None)
    wrapper = connections[using]

    def connect() -> psycopg.Connection:
        conn = wrapper.get_new_connection(wrapper.get_connection_params())
        conn.autocommit = True
        return conn

    return WakeUp(f"LISTEN on {using}", connect)


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
