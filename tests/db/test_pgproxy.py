"""The fault-injecting proxy, proven with real psycopg connections against the test PostgreSQL."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import environ
import psycopg
import pytest
from django.db import connection

from tests.helpers import ROOT, child_env, wait_until
from tests.helpers import test_database_url as database_url  # not collected as a test
from tests.helpers.pgproxy import PgProxy
from tests.helpers.zygote import run_python

pytestmark = pytest.mark.django_db(transaction=True)

INSERT_DROPPED = "INSERT INTO pgproxy_probe (id, note) VALUES (2, 'dropped')"
# Shaped like the worker's outcome write, whose pattern is a statement prefix with a line break.
UPDATE_DROPPED = "UPDATE pgproxy_probe AS t SET\n    note = 'dropped'\nWHERE t.id = 1"


# autouse: set up before ``proxy``, so that the proxy stops (closing every proxied connection) before the drop.
@pytest.fixture(autouse=True)
def probe_table() -> Iterator[None]:
    with connection.cursor() as cursor:
        cursor.execute("CREATE TABLE pgproxy_probe (id integer PRIMARY KEY, note text NOT NULL)")
    yield
    with connection.cursor() as cursor:
        cursor.execute("DROP TABLE pgproxy_probe")


@pytest.fixture
def proxy_url(proxy: PgProxy) -> str:
    return proxy.url_for(database_url())


def connect(url: str, **kwargs: Any) -> psycopg.Connection[Any]:
    return psycopg.connect(url, autocommit=True, connect_timeout=5, **kwargs)


def committed_notes() -> list[str]:
    """What a direct connection (the unix socket, no proxy) sees committed."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT note FROM pgproxy_probe ORDER BY id")
        return [note for (note,) in cursor.fetchall()]


class InThread:
    """Runs ``function`` in a thread; ``finished`` is set when it returned or raised."""

    def __init__(self, function: Callable[[], Any]) -> None:
        self.finished = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None

        def run() -> None:
            try:
                self.result = function()
            except BaseException as exc:
                self.error = exc
            finally:
                self.finished.set()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()


def test_url_for_keeps_user_and_database_but_points_at_the_proxy(proxy: PgProxy, proxy_url: str) -> None:
    direct = environ.Env.db_url_config(database_url())
    proxied = environ.Env.db_url_config(proxy_url)
    assert (proxied["HOST"], proxied["PORT"]) == ("127.0.0.1", proxy.port)
    assert (proxied["NAME"], proxied["USER"]) == (direct["NAME"], direct["USER"])
    assert proxied["OPTIONS"] == {"sslmode": "disable"}


def test_forwards_a_session_unchanged(proxy: PgProxy, proxy_url: str) -> None:
    with connect(proxy_url) as conn:
        assert (conn.info.host, conn.info.port) == ("127.0.0.1", proxy.port)
        conn.execute("INSERT INTO pgproxy_probe (id, note) VALUES (%s, %s)", [1, "through the proxy"])
        # A reply far larger than one read, so that messages straddle the proxy's chunks.
        ((note, padding),) = conn.execute("SELECT note, repeat('x', 300000) FROM pgproxy_probe").fetchall()
        assert (note, len(padding)) == ("through the proxy", 300000)
        assert proxy.connection_count == 1
    wait_until(lambda: proxy.connection_count == 0, what="the proxy to notice the client left")
    assert committed_notes() == ["through the proxy"]


def test_passes_the_ssl_request_and_the_servers_refusal_through(proxy: PgProxy, proxy_url: str) -> None:
    with connect(proxy_url.replace("sslmode=disable", "sslmode=prefer")) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)
        assert not conn.pgconn.ssl_in_use


@pytest.mark.parametrize(
    ("statement", "pattern"),
    [(INSERT_DROPPED, b"INSERT INTO pgproxy_probe"), (UPDATE_DROPPED, b"UPDATE pgproxy_probe AS t SET\n    note =")],
    ids=["insert", "update"],
)
def test_a_dropped_reply_leaves_the_statement_committed(
    proxy: PgProxy, proxy_url: str, statement: str, pattern: bytes
) -> None:
    with connection.cursor() as cursor:
        cursor.execute("INSERT INTO pgproxy_probe (id, note) VALUES (1, 'before')")
    fault = proxy.drop_reply_after(pattern)
    with connect(proxy_url) as conn:
        assert conn.execute("SELECT count(*) FROM pgproxy_probe").fetchone() == (1,)  # not the armed pattern
        assert not fault.matched.is_set()
        with pytest.raises(psycopg.OperationalError, match="server closed the connection unexpectedly"):
            conn.execute(statement)
        assert conn.closed and conn.broken  # psycopg does not reconnect on its own
    assert fault.fired.is_set() and fault.status == b"I"  # idle after it: committed, not in a transaction
    assert "dropped" in committed_notes()
    assert proxy.connection_count == 0


def test_a_reply_dropped_inside_a_transaction_leaves_nothing_committed(proxy: PgProxy, proxy_url: str) -> None:
    fault = proxy.drop_reply_after(b"INSERT INTO pgproxy_probe")
    with psycopg.connect(proxy_url, connect_timeout=5) as conn, pytest.raises(psycopg.OperationalError):
        conn.execute(INSERT_DROPPED)
    assert fault.status == b"T"  # the server was inside the transaction that the disconnect rolls back
    assert committed_notes() == []


def test_a_dropped_reply_fails_a_django_process_whose_write_committed(proxy: PgProxy, proxy_url: str) -> None:
    fault = proxy.drop_reply_after(b"from a child")
    script = (
        "import django; django.setup()\n"
        "from django.db import connection\n"
        "connection.cursor().execute(\"INSERT INTO pgproxy_probe (id, note) VALUES (3, 'from a child')\")\n"
    )
    child = run_python(
        ["-c", script],
        cwd=ROOT,
        env=child_env(DATABASE_URL=proxy_url),
        timeout=60,
    )
    assert child.returncode == 1
    assert "django.db.utils.OperationalError: consuming input failed: server closed the connection" in child.stderr
    assert fault.status == b"I"
    assert committed_notes() == ["from a child"]


def test_killed_connections_fail_their_next_query_and_reconnecting_works(proxy: PgProxy, proxy_url: str) -> None:
    with connect(proxy_url) as first, connect(proxy_url) as second:
        assert proxy.kill_connections() == 2
        for conn in (first, second):
            with pytest.raises(psycopg.OperationalError):
                conn.execute("SELECT 1")
            assert conn.closed
    assert proxy.connection_count == 0
    with connect(proxy_url) as again:
        assert again.execute("SELECT 1").fetchone() == (1,)


def test_kill_connections_with_a_match_spares_the_others(proxy: PgProxy, proxy_url: str) -> None:
    with (
        connect(proxy_url, application_name="victim") as by_name,
        connect(proxy_url) as by_statement,
        connect(proxy_url) as bystander,
    ):
        by_statement.execute("SELECT 'heartbeat'")
        bystander.execute("SELECT 'other work'")
        assert proxy.kill_connections(match=b"victim") == 1
        assert proxy.kill_connections(match=b"heartbeat") == 1
        for conn in (by_name, by_statement):
            with pytest.raises(psycopg.OperationalError):
                conn.execute("SELECT 1")
        assert bystander.execute("SELECT 1").fetchone() == (1,)


def test_a_freeze_holds_the_statement_until_thawed(proxy: PgProxy, proxy_url: str) -> None:
    fault = proxy.freeze(b"INSERT INTO pgproxy_probe")
    with connect(proxy_url) as frozen, connect(proxy_url) as other:
        insert = InThread(
            lambda: frozen.execute("INSERT INTO pgproxy_probe (id, note) VALUES (4, 'frozen') RETURNING id").fetchone()
        )
        assert fault.fired.wait(5)
        assert not insert.finished.wait(0.3)
        assert committed_notes() == []  # held back: the server has not seen the statement
        assert other.execute("SELECT 1").fetchone() == (1,)  # only the matching connection is frozen
        assert proxy.thaw() == 1
        assert insert.finished.wait(5)
        assert (insert.result, insert.error) == ((4,), None)
        assert frozen.execute("SELECT 1").fetchone() == (1,)  # and it carries on as if nothing happened
    assert committed_notes() == ["frozen"]


def test_a_delivering_freeze_holds_only_the_reply(proxy: PgProxy, proxy_url: str) -> None:
    fault = proxy.freeze(b"INSERT INTO pgproxy_probe", deliver=True)
    with connect(proxy_url) as frozen:
        insert = InThread(lambda: frozen.execute("INSERT INTO pgproxy_probe (id, note) VALUES (5, 'delivered')"))
        assert fault.fired.wait(5)
        wait_until(lambda: committed_notes() == ["delivered"], what="the server to commit the frozen insert")
        assert not insert.finished.is_set()  # committed, and the client still waits to hear so
        assert proxy.thaw() == 1
        assert insert.finished.wait(5) and insert.error is None


def test_killing_a_frozen_connection_releases_its_client(proxy: PgProxy, proxy_url: str) -> None:
    fault = proxy.freeze(b"pg_sleep")
    with connect(proxy_url) as frozen:
        query = InThread(lambda: frozen.execute("SELECT pg_sleep(0)"))
        assert fault.fired.wait(5)
        assert proxy.kill_connections() == 1
        assert query.finished.wait(5)
        assert isinstance(query.error, psycopg.OperationalError)
