"""Requeue of a cancelled debounced task (never claimed: it would wait again in the key's
debounce index) inside a caller's transaction, against the key's waiting task in the same
transaction and in another session's uncommitted one (real connections).

Found by breaker 33 (the bug hunt on fair queues, unique windows and debounce)."""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest
from django.db import connections, transaction

from tasks.exceptions import TaskError
from tasks.lifecycle import statements as sql
from tasks.models import Task
from tests.helpers import enqueue_params, wait_until
from tests.helpers import test_database_url as database_url  # not collected as a test
from tests.helpers.task_paths import NOOP

QUEUE = "requeue33"


def debounced(key: str, value: str, **extra: Any) -> Any:
    return Task.objects.enqueue(NOOP, kwargs={"v": value}, queue=QUEUE, dedup_key=key, debounce=60, **extra)


@pytest.mark.django_db(transaction=True)
def test_a_refused_requeue_inside_the_callers_transaction_names_the_waiting_task_and_the_transaction_goes_on() -> None:
    first = debounced("rq:a", "first")
    Task.objects.filter(pk=first.id).cancel()
    with transaction.atomic():
        waiting = debounced("rq:a", "second")
        assert waiting.created and waiting.id != first.id
        with pytest.raises(TaskError) as refused:
            Task.objects.filter(pk=first.id).requeue()
        assert str(waiting.id) in str(refused.value) and "rq:a" in str(refused.value), refused.value
        later = Task.objects.enqueue(NOOP, queue=QUEUE)  # the transaction is usable
        folded = debounced("rq:a", "third")
        assert folded.id == waiting.id and not folded.created
    rows = dict(Task.objects.filter(queue=QUEUE).values_list("pk", "status"))
    assert rows == {first.id: "CANCELLED", waiting.id: "READY", later.id: "READY"}
    assert Task.objects.get(pk=waiting.id).kwargs == {"v": "third"}


@pytest.mark.django_db(transaction=True)
def test_a_requeue_that_waited_for_another_sessions_debounced_enqueue_is_refused_naming_it() -> None:
    """Another session's uncommitted debounced enqueue of the key: the requeue's UPDATE waits for it
    (the unique index), then fails when it commits; the refusal (read after the wait) names the task
    it committed, and the caller's transaction goes on."""
    first = debounced("rq:b", "first")
    Task.objects.filter(pk=first.id).cancel()
    holder = psycopg.connect(database_url())
    try:
        params = enqueue_params(
            queue=QUEUE,
            task_path=NOOP,
            kwargs='{"v": "other"}',
            debounce_key="rq:b",
            debounce=60.0,
            max_wait=None,
        )
        row = holder.execute(sql.ENQUEUE_DEBOUNCE_SQL, params).fetchone()
        assert row is not None and row[2]  # inserted, not committed
        other_id = row[0]
        outcome: dict[str, Any] = {}

        def requeue() -> None:
            try:
                with transaction.atomic():
                    try:
                        Task.objects.filter(pk=first.id).requeue()
                    except TaskError as exc:
                        outcome["error"] = str(exc)
                    outcome["after"] = Task.objects.enqueue(NOOP, queue=QUEUE).id
            finally:
                connections.close_all()

        thread = threading.Thread(target=requeue)
        thread.start()
        wait_until(_waiting_for_a_lock, 30, what="the requeue waiting for the other session")
        holder.commit()
        thread.join(30)
        assert not thread.is_alive()
    finally:
        holder.close()
    assert "error" in outcome, outcome
    assert str(other_id) in outcome["error"] and "rq:b" in outcome["error"], outcome["error"]
    rows = dict(Task.objects.filter(queue=QUEUE).values_list("pk", "status"))
    assert rows == {first.id: "CANCELLED", other_id: "READY", outcome["after"]: "READY"}


@pytest.mark.django_db(transaction=True)
def test_a_debounced_enqueue_waiting_for_a_rolled_back_requeue_inserts_its_own_task() -> None:
    first = debounced("rq:c", "first")
    Task.objects.filter(pk=first.id).cancel()
    outcome: dict[str, Any] = {}
    started = threading.Event()

    def enqueue() -> None:
        try:
            started.wait(30)
            outcome["got"] = debounced("rq:c", "second")
        finally:
            connections.close_all()

    thread = threading.Thread(target=enqueue)
    with transaction.atomic():
        assert Task.objects.filter(pk=first.id).requeue() == 1
        thread.start()
        started.set()
        wait_until(_waiting_for_a_lock, 30, what="the enqueue waiting for the requeue")
        transaction.set_rollback(True)
    thread.join(30)
    got = outcome["got"]
    assert got.created and got.id != first.id
    assert Task.objects.get(pk=first.id).status == "CANCELLED"
    assert Task.objects.get(pk=got.id).kwargs == {"v": "second"}


def _waiting_for_a_lock() -> bool:
    """Another session waits for a lock (read on a connection of its own: inside a transaction the
    statistics views keep what they first showed)."""
    with psycopg.connect(database_url(), autocommit=True) as probe:
        row = probe.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
        ).fetchone()
        return bool(row and row[0])
