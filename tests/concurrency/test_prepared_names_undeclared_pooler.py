"""Prepared statement names behind an undeclared transaction pooler (PgBouncer 1.18, transaction mode, pool of 2).

psycopg names prepared statements ``_pg3_0``, ``_pg3_1``, … per client connection, so two clients
(processes) use the same names for different statements. Behind a transaction pooler a client's
later run of ``_pg3_0`` (Bind only, no Parse) can land on a server connection where another client
prepared a *different* statement under that name. The server then does not answer "does not
exist" / "already exists" (the two refusals prepared.py detects): it runs the other client's
statement with these parameters, or refuses the Bind with a ProtocolViolation that nobody treats as
a pooler. The server connections are steered deterministically by holding them in transactions
through the pooler.


Found by breaker 22 (the bug hunt on issue 22: prepared statements and pipelined bounds)."""

from __future__ import annotations

from contextlib import ExitStack

import psycopg
import pytest
from django.db import connection

from tasks.models import Task
from tests.helpers import ensure_ended, read_message, send, start_child
from tests.helpers.pgbouncer import Bouncer

pytestmark = pytest.mark.django_db(transaction=True)


def child(stack: ExitStack, url: str):
    """A prepclient process on ``url``, killed and its pipes closed on the way out."""
    proc = start_child("prepclient", DATABASE_URL=url)

    def close_pipes() -> None:
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()

    stack.callback(close_pipes)
    return stack.enter_context(ensure_ended(proc))


def ask(proc, **cmd):
    send(proc, cmd)
    return read_message(proc, timeout=60)


class Holder:
    """A client of the pool that holds one server connection in an open transaction."""

    def __init__(self, bouncer: Bouncer) -> None:
        self.conn = psycopg.connect(bouncer.conninfo(connection.settings_dict["NAME"]))

    def hold(self) -> int:
        row = self.conn.execute("SELECT pg_backend_pid()").fetchone()
        assert row is not None
        return int(row[0])

    def release(self) -> None:
        self.conn.rollback()

    def close(self) -> None:
        self.conn.close()


def test_a_dedup_enqueue_through_an_undeclared_pooler_runs_another_clients_plain_insert(bouncer_pool_of_2):
    """Client 1's first statement is a plain enqueue (its ``_pg3_0``), client 2's an enqueue with a
    dedup key (its ``_pg3_0`` too). Client 2's second enqueue with the same key, landing on client
    1's server connection, runs the plain INSERT: instead of returning the existing task it fails
    with an IntegrityError on the dedup index (and nothing marks the alias refused)."""
    url = bouncer_pool_of_2.url(connection.settings_dict["NAME"])
    with ExitStack() as stack:
        plain = child(stack, url)
        dedup = child(stack, url)
        z1, z2 = Holder(bouncer_pool_of_2), Holder(bouncer_pool_of_2)
        stack.callback(z1.close)
        stack.callback(z2.close)

        # 1. the only server connection S1 gets client 1's _pg3_0 = the plain INSERT
        assert ask(plain, op="enqueue", task_path="tests.testapp.handlers.noop", queue="names")["ok"]
        s1 = z1.hold()  # 2. S1 held
        # 3. client 2 prepares its _pg3_0 = the INSERT ... ON CONFLICT on a second server connection S2
        first = ask(dedup, op="enqueue", task_path="tests.testapp.handlers.noop", queue="names", dedup_key="k")
        assert first["ok"] and first["created"], first
        s2 = z2.hold()  # 4. S2 held (S1 is)
        assert s2 != s1
        z1.release()  # 5. only S1 is free
        # 6. the same dedup enqueue again: must return the unfinished task holding the key
        again = ask(dedup, op="enqueue", task_path="tests.testapp.handlers.noop", queue="names", dedup_key="k")
        state = ask(dedup, op="state")
        z2.release()
    assert again == {"ok": True, "id": first["id"], "created": False}, (again, state)
    assert Task.objects.filter(queue="names", dedup_key="k").count() == 1


def test_an_enqueue_through_an_undeclared_pooler_binds_to_a_workers_bounds_prefix(bouncer_pool_of_2):
    """A bounded client (the worker's dispatcher: its bounds prefix is its ``_pg3_0``) and a web
    client (a plain enqueue: its ``_pg3_0``). The web client's next enqueue, landing on the worker's
    server connection, binds 12 parameters to the worker's 0-parameter prefix: the enqueue fails with
    a ProtocolViolation ("bind message supplies 12 parameters, but prepared statement "_pg3_0"
    requires 0"), which is neither a fallback nor detected (the alias stays preparing, no warning)."""
    url = bouncer_pool_of_2.url(connection.settings_dict["NAME"])
    with ExitStack() as stack:
        web = child(stack, url)
        worker = child(stack, url)
        z1, z2 = Holder(bouncer_pool_of_2), Holder(bouncer_pool_of_2)
        stack.callback(z1.close)
        stack.callback(z2.close)

        assert ask(worker, op="bound", statement_ms=5000, lock_ms=1000)["ok"]
        # S1: the worker's _pg3_0 = its bounds prefix, _pg3_1 = the claim (one pipeline, one Sync)
        assert ask(worker, op="claim", worker="w", queues=["names"], ttl=60)["ok"]
        s1 = z1.hold()
        # S2: the web client's _pg3_0 = the plain INSERT
        assert ask(web, op="enqueue", task_path="tests.testapp.handlers.noop", queue="names")["ok"]
        assert z2.hold() != s1
        z1.release()  # only S1 is free
        again = ask(web, op="enqueue", task_path="tests.testapp.handlers.noop", queue="names")
        state = ask(web, op="state")
        z2.release()
    assert again["ok"], (again, state)
    assert Task.objects.filter(queue="names").count() == 2
