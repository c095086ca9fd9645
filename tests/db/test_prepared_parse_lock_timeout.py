"""A bounded (pipelined) statement whose first run fails while being *prepared* (its
Parse waits for a table lock, e.g. a migration's ALTER TABLE, and the worker's own lock_timeout,
set by the prefix in the same pipeline, stops it) is remembered as prepared all the same:
``NamedByText.validate`` keeps every name whatever the run's results, including a Parse the server
refused. The next run then Binds a statement the server never had: "prepared statement ... does not
exist", which ``rows`` takes for an undeclared transaction pooler: the alias stops preparing for the
rest of the process (with a warning blaming a pooler), and inside a transaction the caller gets
the error although nothing is wrong with the connection any more.


Found by breaker 22b (a second bug hunt on issue 22's prepared statements)."""

from __future__ import annotations

import psycopg
import pytest
from django.db import connection, transaction

from leasing.bounds import bound
from tasks.lifecycle import prepared
from tasks.models import Task
from tests.helpers import test_database_url as direct_url
from tests.helpers.task_paths import NOOP

pytestmark = pytest.mark.django_db(transaction=True)


def _lock_timeout_while_preparing() -> None:
    """The first (preparing) run of the claim, while another session holds the table."""
    bound(connection, statement_ms=5000, lock_ms=50)
    with psycopg.connect(direct_url()) as other:
        other.execute("LOCK TABLE tasks_task IN ACCESS EXCLUSIVE MODE")
        with pytest.raises(Exception, match="lock timeout"):
            Task.objects.claim("parse-w", queues=["parse"], ttl=600)
        other.rollback()


def test_a_parse_stopped_by_the_lock_timeout_is_not_taken_for_a_pooler(fresh_session):
    Task.objects.enqueue(NOOP, queue="parse")
    _lock_timeout_while_preparing()
    claimed = Task.objects.claim("parse-w", queues=["parse"], ttl=600)
    assert len(claimed) == 1
    assert connection.alias not in prepared._refused, (
        "a lock timeout during the first run's Parse made the alias stop preparing for the process "
        "(taken for an undeclared pooler)"
    )


def test_a_transaction_after_a_parse_stopped_by_the_lock_timeout_runs(fresh_session):
    Task.objects.enqueue(NOOP, queue="parse")
    _lock_timeout_while_preparing()
    with transaction.atomic():
        claimed = Task.objects.claim("parse-w", queues=["parse"], ttl=600)
    assert len(claimed) == 1
