"""The hot paths' statements run prepared on a direct connection, with the worker's bounds riding
in the same round trip and ending with the statement; never prepared where the user or a pooler says
no, and an undeclared transaction pooler costs a fallback, not a failure (tasks/lifecycle/prepared.py)."""

from __future__ import annotations

import subprocess

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from leasing.bounds import bound, unbound
from tasks.lifecycle import prepared
from tasks.models import Task
from tests.helpers import ROOT, child_env
from tests.helpers.zygote import popen_python

pytestmark = pytest.mark.django_db


def prepared_inserts() -> int:
    """Statements this session holds prepared that insert tasks (the enqueue's)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_prepared_statements WHERE statement LIKE '%%INSERT INTO tasks_task%%'")
        return int(cursor.fetchone()[0])


def test_an_enqueue_is_prepared_once_and_reused(fresh_session):
    first = Task.objects.enqueue("tests.testapp.handlers.noop", kwargs={"i": 1})
    assert prepared_inserts() == 1
    second = Task.objects.enqueue("tests.testapp.handlers.noop", kwargs={"i": 2})
    assert prepared_inserts() == 1  # the same statement, not one per call
    assert second.id > first.id
    assert list(Task.objects.filter(pk__in=[first.id, second.id]).values_list("kwargs", flat=True)) in (
        [{"i": 1}, {"i": 2}],
        [{"i": 2}, {"i": 1}],
    )


@pytest.mark.django_db(transaction=True)  # the statement's own transaction, not the test's
def test_the_worker_bounds_hold_for_the_prepared_statement_and_end_with_it(fresh_session):
    bound(connection, statement_ms=4321, lock_ms=765)
    try:
        assert prepared.preparable(connection)
        query = "SELECT current_setting('statement_timeout'), current_setting('lock_timeout'), %(n)s::int"
        assert prepared.rows(connection, query, {"n": 7}) == [("4321ms", "765ms", 7)]
    finally:
        unbound(connection)
    # Local to the statement's implicit transaction: nothing left on the session (or a pooled server).
    with connection.cursor() as cursor:
        cursor.execute("SELECT current_setting('statement_timeout'), current_setting('lock_timeout')")
        assert cursor.fetchone() == ("0", "0")


@pytest.mark.django_db(transaction=True)  # the statement's own transaction, not the test's
def test_the_bounds_inside_a_transaction_last_for_that_transaction(fresh_session):
    bound(connection, statement_ms=4321, lock_ms=765)
    try:
        with transaction.atomic():
            prepared.rows(connection, "SELECT %(n)s::int", {"n": 1})
            with connection.cursor() as cursor:
                unbound(connection)
                cursor.execute("SELECT current_setting('statement_timeout')")
                assert cursor.fetchone() == ("4321ms",)
    finally:
        unbound(connection)
    with connection.cursor() as cursor:
        cursor.execute("SELECT current_setting('statement_timeout')")
        assert cursor.fetchone() == ("0",)


def test_a_bounded_statement_is_stopped_by_its_statement_timeout(fresh_session):
    bound(connection, statement_ms=50, lock_ms=50)
    try:
        with pytest.raises(Exception, match="statement timeout"):
            prepared.rows(connection, "SELECT pg_sleep(%(s)s::float8)", {"s": 5})
    finally:
        unbound(connection)


@pytest.mark.parametrize(
    "tasks_settings",
    [{"POOLED_DATABASES": ["default"]}, {"PREPARED_STATEMENTS": False}],
    ids=["pooled alias", "turned off"],
)
def test_not_prepared_where_the_settings_say_no(fresh_session, settings, tasks_settings):
    settings.LEASING_TASKS = tasks_settings
    assert not prepared.preparable(connection)
    Task.objects.enqueue("tests.testapp.handlers.noop")
    assert prepared_inserts() == 0


def test_not_prepared_where_the_database_options_turn_psycopg_preparing_off(fresh_session, monkeypatch):
    options = {**(connection.settings_dict.get("OPTIONS") or {}), "prepare_threshold": None}
    monkeypatch.setitem(connection.settings_dict, "OPTIONS", options)
    assert not prepared.preparable(connection)
    Task.objects.enqueue("tests.testapp.handlers.noop")
    assert prepared_inserts() == 0


def test_recorded_queries_and_foreign_wrappers_see_every_statement(fresh_session):
    with CaptureQueriesContext(connection) as captured:
        Task.objects.enqueue("tests.testapp.handlers.noop")
    assert any("INSERT INTO tasks_task" in q["sql"] for q in captured.captured_queries)
    seen: list[str] = []

    def spy(execute, sql, params, many, context):
        seen.append(sql)
        return execute(sql, params, many, context)

    with connection.execute_wrapper(spy):
        Task.objects.enqueue("tests.testapp.handlers.noop")
    assert any("INSERT INTO tasks_task" in sql for sql in seen)
    assert prepared_inserts() == 0


# An undeclared transaction pooler: PgBouncer 1.18 (Debian's) does not track prepared statements, so
# a statement prepared on one server connection is missing (or its name taken) on the next. Four
# processes enqueue and claim through it at once; every call must succeed.
CLIENT = """
import logging, sys
import django
django.setup()
from tasks.models import Task
refused = []
class Catch(logging.Handler):
    def emit(self, record):
        if "refused a prepared statement" in record.getMessage():
            refused.append(record)
logging.getLogger("tasks.worker").addHandler(Catch())
index = int(sys.argv[1])
for i in range(150):
    Task.objects.enqueue("tests.testapp.handlers.noop", kwargs={"client": index, "i": i}, queue="pooled-prepare")
claimed = 0
while True:
    got = Task.objects.claim(f"pooled-{index}", limit=7, queues=["pooled-prepare"], ttl=60, start=True)
    if not got:
        break
    claimed += len(got)
    done = Task.objects.complete_many(f"pooled-{index}", [(t.id, t.token, "null") for t in got])
    assert len(done) == len(got), (len(done), len(got))
print(claimed, len(refused))
"""


@pytest.mark.django_db(transaction=True)
def test_an_undeclared_transaction_pooler_costs_a_fallback_not_a_failure(bouncer_pool_of_2):
    url = bouncer_pool_of_2.url(connection.settings_dict["NAME"])
    clients = [
        popen_python(
            ["-c", CLIENT, str(index)],
            cwd=ROOT,
            env=child_env(DATABASE_URL=url),  # not declared pooled
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for index in range(4)
    ]
    results = []
    for client in clients:
        out, err = client.communicate(timeout=180)
        assert client.returncode == 0, err[-3000:]
        results.append(tuple(int(x) for x in out.split()))
    assert sum(claimed for claimed, _ in results) == 600
    assert Task.objects.filter(queue="pooled-prepare", status="SUCCESSFUL").count() == 600
    # The pooler did refuse prepared statements, and each refusal was taken in stride.
    assert sum(refusals for _, refusals in results) >= 1


@pytest.mark.django_db(transaction=True)  # it closes the connection
def test_statements_are_named_by_their_text_on_psycopgs_own_bookkeeping(fresh_session):
    """The naming rides on psycopg's PrepareManager (a private class): if a psycopg release changes
    it, this fails and the hot paths run unprepared until prepared.py follows."""
    assert prepared.PrepareManager is not None
    Task.objects.enqueue("tests.testapp.handlers.noop")
    assert isinstance(connection.connection._prepared, prepared.NamedByText)
    with connection.cursor() as cursor:
        cursor.execute("SELECT name FROM pg_prepared_statements WHERE statement LIKE '%%INSERT INTO tasks_task%%'")
        (name,) = cursor.fetchone()
    assert name.startswith("_dl_") and len(name) == 4 + 24
    connection.close()  # a new connection: the same text gets the same name
    Task.objects.enqueue("tests.testapp.handlers.noop")
    with connection.cursor() as cursor:
        cursor.execute("SELECT name FROM pg_prepared_statements WHERE statement LIKE '%%INSERT INTO tasks_task%%'")
        assert cursor.fetchone() == (name,)
