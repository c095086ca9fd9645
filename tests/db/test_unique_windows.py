"""Uniqueness over a window and debounce, one connection at a time (the races from 8 processes are in
tests/concurrency/test_unique_windows.py): the promised tasks, the caller's transaction, bad input,
a plain dedup enqueue racing a window, concurrency keys, retention, and statements that stay the same."""

from __future__ import annotations

import datetime as dt
import math
import threading
from typing import Any

import pytest
from django.db import connection, connections, transaction

from tasks.lifecycle import statements as sql
from tasks.lifecycle import windows
from tasks.maintenance.retention import prune
from tasks.models import Failure, Task, TaskStatus, UniqueKey
from tasks.models.task import TaskQuerySet
from tests.helpers import db_now, enqueue_params, wait_until
from tests.helpers.api import Api
from tests.helpers.task_paths import NOOP

pytestmark = pytest.mark.django_db


def rolled_back(enqueue: Any) -> Any:
    """Run ``enqueue`` in a transaction the caller then rolls back; return what it returned."""
    with transaction.atomic():
        got = enqueue()
        transaction.set_rollback(True)
    return got


def close_window(key: str) -> None:
    """The window passes: its end moved to the past (as the database clock would)."""
    UniqueKey.objects.filter(key=key).update(expires_at=db_now() - dt.timedelta(seconds=1))


# -- unique for a period ----------------------------------------------------------------------


def test_a_duplicate_inside_the_window_returns_the_first_task_and_inserts_nothing() -> None:
    first = Task.objects.enqueue(NOOP, kwargs={"n": 1}, dedup_key="k", unique_for=60)
    Task.objects.filter(pk=first.id).cancel()  # finished: the window still holds
    again = Task.objects.enqueue(NOOP, kwargs={"n": 2}, dedup_key="k", unique_for=dt.timedelta(minutes=1))
    assert first.created and (again.id, again.created, again.enqueued_at) == (first.id, False, None)
    assert Task.objects.count() == 1
    key = UniqueKey.objects.get(key="k")
    assert key.task_id == first.id
    assert (key.expires_at - key.accepted_at).total_seconds() == pytest.approx(60, abs=0.01)


def test_after_the_window_the_next_enqueue_is_accepted_and_opens_a_new_window() -> None:
    first = Task.objects.enqueue(NOOP, dedup_key="k", unique_for=60)
    Task.objects.filter(pk=first.id).cancel()
    close_window("k")
    second = Task.objects.enqueue(NOOP, dedup_key="k", unique_for=30)
    assert second.created and second.id != first.id
    key = UniqueKey.objects.get(key="k")
    assert key.task_id == second.id and key.expires_at > db_now() + dt.timedelta(seconds=25)
    assert not Task.objects.enqueue(NOOP, dedup_key="k", unique_for=30).created


def test_an_unfinished_task_still_holds_its_key_after_the_window() -> None:
    first = Task.objects.enqueue(NOOP, dedup_key="k", unique_for=60)
    close_window("k")
    before = UniqueKey.objects.get(key="k")
    again = Task.objects.enqueue(NOOP, dedup_key="k", unique_for=60)
    assert (again.id, again.created) == (first.id, False)
    assert UniqueKey.objects.get(key="k").expires_at == before.expires_at  # the window was left alone
    assert Task.objects.count() == 1


def test_a_plain_dedup_enqueue_and_a_window_share_the_key() -> None:
    plain = Task.objects.enqueue(NOOP, dedup_key="k")
    windowed = Task.objects.enqueue(NOOP, dedup_key="k", unique_for=60)
    assert (windowed.id, windowed.created) == (plain.id, False)
    assert not UniqueKey.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_a_plain_dedup_enqueue_committing_first_wins_and_the_window_is_given_back() -> None:
    """The windowed enqueue took the key row but its insert met a plain dedup enqueue that committed
    after its snapshot: it answers with that task and leaves no window naming a task never inserted."""
    other = connections.create_connection("default")
    result: dict[str, Any] = {}
    try:
        other.set_autocommit(False)
        with other.cursor() as cursor:
            cursor.execute(
                "INSERT INTO tasks_task (queue, priority, task_path, args, kwargs, status, run_after, enqueued_at,"
                " attempts, max_attempts, dedup_key, errors, worker_ids, renewals, transitions, failures, crashes,"
                " shared_crashes, unstarted_returns, attempt_started, attempt_isolated)"
                " VALUES ('default', 0, %s, '[]', '{}', 'READY', now(), now(), 0, 3, 'k', '[]', '[]', 0, 0, 0, 0,"
                " 0, 0, false, false) RETURNING id",
                [NOOP],
            )
            plain_id = cursor.fetchone()[0]

        def enqueue() -> None:
            try:
                result["got"] = Task.objects.enqueue(NOOP, dedup_key="k", unique_for=60)
            finally:
                connections.close_all()

        thread = threading.Thread(target=enqueue)
        thread.start()
        wait_until(lambda: lock_waiters() >= 1, 10, what="the windowed enqueue waiting for the plain insert")
        other.commit()
        thread.join(30)
    finally:
        other.close()
    assert (result["got"].id, result["got"].created) == (plain_id, False)
    assert not UniqueKey.objects.exists()
    assert Task.objects.count() == 1
    # The key's next windowed enqueue, once the plain task finished, is accepted at once.
    Task.objects.filter(pk=plain_id).cancel()
    assert Task.objects.enqueue(NOOP, dedup_key="k", unique_for=60).created


def lock_waiters() -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
        return int(cursor.fetchone()[0])


def test_a_rolled_back_windowed_enqueue_leaves_no_task_and_no_window() -> None:
    rolled_back(lambda: Task.objects.enqueue(NOOP, dedup_key="k", unique_for=60))
    assert not Task.objects.exists() and not UniqueKey.objects.exists()
    assert Task.objects.enqueue(NOOP, dedup_key="k", unique_for=60).created


def test_retention_deletes_windows_that_passed_and_keeps_open_ones() -> None:
    Task.objects.enqueue(NOOP, dedup_key="old", unique_for=60)
    Task.objects.enqueue(NOOP, dedup_key="open", unique_for=60)
    close_window("old")
    assert prune({"UNIQUE_KEYS": dt.timedelta(0)}) == {"UNIQUE_KEYS": 1}
    assert list(UniqueKey.objects.values_list("key", flat=True)) == ["open"]
    assert Task.objects.count() == 2  # retention of windows never touches tasks


def test_retention_keeps_windows_that_passed_less_than_their_age_ago() -> None:
    Task.objects.enqueue(NOOP, dedup_key="old", unique_for=60)
    close_window("old")
    assert prune({"UNIQUE_KEYS": dt.timedelta(hours=1)}) == {"UNIQUE_KEYS": 0}
    assert UniqueKey.objects.count() == 1


# -- debounce ---------------------------------------------------------------------------------


def test_a_debounce_replaces_the_arguments_and_pushes_the_start_of_the_waiting_task() -> None:
    first = Task.objects.enqueue(NOOP, args=[1], kwargs={"v": 1}, dedup_key="d", debounce=10)
    task = Task.objects.get(pk=first.id)
    assert first.created and task.debounce_key == "d" and task.dedup_key is None
    assert task.run_after == task.enqueued_at + dt.timedelta(seconds=10) and task.debounce_until is None
    again = Task.objects.enqueue(NOOP, args=[2], kwargs={"v": 2}, dedup_key="d", debounce=20)
    assert (again.id, again.created) == (first.id, False)
    task.refresh_from_db()
    assert (task.args, task.kwargs, task.debounces) == ([2], {"v": 2}, 1)
    assert task.run_after >= db_now() + dt.timedelta(seconds=19)
    assert Task.objects.count() == 1


def test_max_wait_caps_how_far_debounces_push_the_start() -> None:
    first = Task.objects.enqueue(NOOP, dedup_key="d", debounce=5, max_wait=8)
    for _ in range(3):
        Task.objects.enqueue(NOOP, dedup_key="d", debounce=5, max_wait=8)
    task = Task.objects.get(pk=first.id)
    assert task.debounce_until == task.enqueued_at + dt.timedelta(seconds=8)
    assert task.run_after <= task.debounce_until
    Task.objects.enqueue(NOOP, dedup_key="d", debounce=60, max_wait=60)  # a later call cannot widen it
    task.refresh_from_db()
    assert task.run_after == task.debounce_until == task.enqueued_at + dt.timedelta(seconds=8)


def test_once_the_debounced_task_is_claimed_the_next_enqueue_is_a_new_task() -> None:
    first = Task.objects.enqueue(NOOP, kwargs={"v": 1}, dedup_key="d", debounce=0.001)
    wait_until(lambda: Task.objects.filter(pk=first.id, run_after__lte=db_now()).exists(), 5, what="due")
    claimed = Task.objects.claim("w1", limit=1)
    assert [c.id for c in claimed] == [first.id]
    second = Task.objects.enqueue(NOOP, kwargs={"v": 2}, dedup_key="d", debounce=30)
    assert second.created and second.id != first.id
    assert Task.objects.get(pk=first.id).kwargs == {"v": 1}  # the claimed attempt kept its arguments
    assert Task.objects.complete_many("w1", [(first.id, claimed[0].token, "null")]) == {(first.id, claimed[0].token)}
    third = Task.objects.enqueue(NOOP, kwargs={"v": 3}, dedup_key="d", debounce=30)
    assert (third.id, third.created) == (second.id, False)


def test_a_claimed_debounced_task_going_back_to_wait_never_meets_the_newer_one() -> None:
    """A claimed debounced task has left the key for good: its retry, hand-back or requeue puts it
    back to waiting beside the key's newer waiting task (no unique violation), and later enqueues
    fold into the newer one only."""
    first = Task.objects.enqueue(NOOP, kwargs={"v": 1}, dedup_key="d", debounce=0.001)
    wait_until(lambda: Task.objects.filter(pk=first.id, run_after__lte=db_now()).exists(), 5, what="due")
    claimed = Task.objects.claim("w1", limit=1, start=True)[0]
    newer = Task.objects.enqueue(NOOP, kwargs={"v": 2}, dedup_key="d", debounce=30)
    assert newer.created
    outcome = Task.objects.fail(Failure(first.id, claimed.token, "builtins.ValueError", "again", delay=0.001), "w1")
    assert outcome is not None and outcome.status == TaskStatus.READY
    folded = Task.objects.enqueue(NOOP, kwargs={"v": 3}, dedup_key="d", debounce=30)
    assert (folded.id, folded.created) == (newer.id, False)
    assert Task.objects.get(pk=first.id).kwargs == {"v": 1}
    # Claimed again and handed back; cancelled and requeued: still beside the newer one.
    wait_until(lambda: Task.objects.filter(pk=first.id, run_after__lte=db_now()).exists(), 5, what="due again")
    again = Task.objects.claim("w1", limit=1)
    assert [c.id for c in again] == [first.id]
    assert Task.objects.hand_back("w1", [(first.id, again[0].token)])
    Task.objects.filter(pk=first.id).cancel()
    assert Task.objects.filter(pk=first.id).requeue() == 1
    assert Task.objects.filter(debounce_key="d", status=TaskStatus.READY).count() == 2


def test_a_rolled_back_debounce_leaves_the_waiting_task_as_it_was() -> None:
    first = Task.objects.enqueue(NOOP, kwargs={"v": 1}, dedup_key="d", debounce=10)
    before = Task.objects.get(pk=first.id)
    assert not rolled_back(lambda: Task.objects.enqueue(NOOP, kwargs={"v": 2}, dedup_key="d", debounce=50)).created
    after = Task.objects.get(pk=first.id)
    assert (after.kwargs, after.run_after, after.debounces) == (before.kwargs, before.run_after, 0)
    assert rolled_back(lambda: Task.objects.enqueue(NOOP, dedup_key="fresh", debounce=10)).created
    assert not Task.objects.filter(debounce_key="fresh").exists()


@pytest.mark.django_db(transaction=True)
def test_a_debounced_task_with_a_concurrency_key_waits_blocked_and_is_debounced_there() -> None:
    holder = Task.objects.enqueue(NOOP, concurrency_key="c", concurrency_limit=1)
    assert Task.objects.get(pk=holder.id).status == TaskStatus.READY
    first = Task.objects.enqueue(
        NOOP, kwargs={"v": 1}, dedup_key="d", debounce=30, concurrency_key="c", concurrency_limit=1
    )
    assert Task.objects.get(pk=first.id).status == TaskStatus.BLOCKED
    again = Task.objects.enqueue(
        NOOP, kwargs={"v": 2}, dedup_key="d", debounce=30, concurrency_key="c", concurrency_limit=1
    )
    assert (again.id, again.created) == (first.id, False)
    task = Task.objects.get(pk=first.id)
    assert (task.status, task.kwargs, task.debounces) == (TaskStatus.BLOCKED, {"v": 2}, 1)
    assert Task.objects.filter(concurrency_key="c").count() == 2


# -- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"unique_for": 60}, "unique_for needs a dedup_key"),
        ({"debounce": 5}, "debounce needs a dedup_key"),
        ({"dedup_key": "k", "unique_for": 60, "debounce": 5}, "not both"),
        ({"dedup_key": "k", "max_wait": 5}, "max_wait bounds a debounce"),
        ({"dedup_key": "k", "debounce": 10, "max_wait": 5}, "max_wait must be at least debounce"),
        (
            {"dedup_key": "k", "debounce": 5, "run_after": dt.datetime(2030, 1, 1, tzinfo=dt.timezone.utc)},
            "no run_after",
        ),
        ({"dedup_key": "k", "unique_for": 0}, "more than 0"),
        ({"dedup_key": "k", "unique_for": -1}, "more than 0"),
        ({"dedup_key": "k", "unique_for": math.nan}, "more than 0"),
        ({"dedup_key": "k", "unique_for": math.inf}, "more than 0"),
        ({"dedup_key": "k", "unique_for": windows.MAX_WINDOW_SECONDS + 1}, "at most"),
        ({"dedup_key": "k", "unique_for": True}, "a number of seconds"),
        ({"dedup_key": "k", "unique_for": "60"}, "a number of seconds"),
        ({"dedup_key": "k", "debounce": dt.timedelta(seconds=-1)}, "more than 0"),
        ({"dedup_key": "", "unique_for": 60}, "non-empty string"),
        ({"dedup_key": "x" * 256, "debounce": 5}, "at most 255"),
        ({"dedup_key": "a\x00b", "unique_for": 60}, "NUL"),
        ({"dedup_key": "\ud800", "debounce": 5}, "lone surrogates"),
    ],
)
def test_bad_windows_are_refused_and_change_nothing(kwargs: dict[str, Any], message: str) -> None:
    Task.objects.enqueue(NOOP, dedup_key="k", debounce=5)
    before = list(Task.objects.values())
    with pytest.raises(ValueError, match=message):
        Task.objects.enqueue(NOOP, kwargs={"v": "changed"}, **kwargs)
    assert list(Task.objects.values()) == before
    assert not UniqueKey.objects.exists()


def test_a_window_cannot_go_with_depends_on() -> None:
    parent = Task.objects.enqueue(NOOP)
    with pytest.raises(ValueError, match="depends_on cannot have a dedup_key"):
        Task.objects.enqueue(NOOP, dedup_key="k", unique_for=60, depends_on=[parent])
    assert Task.objects.count() == 1 and not UniqueKey.objects.exists()


# -- costs -----------------------------------------------------------------------------------


def test_plain_and_dedup_enqueues_send_the_statements_they_always_sent(django_assert_num_queries: Any) -> None:
    """A plain enqueue and a plain dedup enqueue pay nothing for windows: one statement each, the
    same text as before (no tasks_uniquekey, no debounce arbiter in them)."""
    for text in (sql.ENQUEUE_SQL, sql.ENQUEUE_DEDUP_SQL):
        assert "tasks_uniquekey" not in text and "debounce" not in text
    with django_assert_num_queries(1) as queries:
        Task.objects.enqueue(NOOP)
    assert queries.captured_queries[0]["sql"].lstrip().startswith("INSERT INTO tasks_task")
    with django_assert_num_queries(1):
        Task.objects.enqueue(NOOP, dedup_key="plain")
    with django_assert_num_queries(1):
        Task.objects.enqueue(NOOP, dedup_key="w", unique_for=60)
    with django_assert_num_queries(1):
        Task.objects.enqueue(NOOP, dedup_key="d", debounce=60)
    with django_assert_num_queries(1):
        Task.objects.enqueue(NOOP, dedup_key="d", debounce=60)


def test_the_window_statements_read_indexes_whatever_the_number_of_keys() -> None:
    """With 20,000 windows and 20,000 finished tasks of other keys, a windowed enqueue probes the key's
    row and the dedup index, and a debounce probes its arbiter: no sequential scan in either plan."""
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO tasks_uniquekey (key, task_id, accepted_at, expires_at)"
            " SELECT 'k' || g, g, now(), now() + interval '1 hour' FROM generate_series(1, 20000) AS g"
        )
        # The finished tasks of other keys, and the statistics that say so: a plan read off statistics
        # an earlier test left (a few rows analysed inside a rolled-back test stay: pg_class is
        # written in place) chose a sequential scan of a table it thought tiny.
        cursor.execute(
            "INSERT INTO tasks_task (queue, priority, task_path, args, kwargs, status, run_after, enqueued_at,"
            " finished_at, attempts, max_attempts, errors, worker_ids, renewals, transitions, failures, crashes,"
            " shared_crashes, unstarted_returns, attempt_started, attempt_isolated, errors_dropped, dedup_key)"
            " SELECT 'default', 0, %s, '[]', '{}', 'SUCCESSFUL', now(), now(), now(), 1, 1, '[]', '[]',"
            " 0, 0, 0, 0, 0, 0, false, false, 0, 'other-' || g FROM generate_series(1, 20000) AS g",
            [NOOP],
        )
        cursor.execute("ANALYZE tasks_uniquekey; ANALYZE tasks_task")
    params = enqueue_params(task_path=NOOP, dedup_key="k5", unique_for=60.0)
    for statement, extra in (
        (sql.ENQUEUE_UNIQUE_SQL, {}),
        (sql.ENQUEUE_DEBOUNCE_SQL, {"dedup_key": None, "debounce_key": "d", "debounce": 5.0, "max_wait": None}),
    ):
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("EXPLAIN (FORMAT TEXT) " + statement, {**params, **extra})
            plan = "\n".join(row[0] for row in cursor.fetchall())
            transaction.set_rollback(True)
        assert "Seq Scan" not in plan, plan


def test_queryset_keeps_its_public_enqueue_signature() -> None:
    import inspect

    names = inspect.signature(TaskQuerySet.enqueue).parameters
    assert {"unique_for", "debounce", "max_wait", "dedup_key"} <= set(names)


def test_a_debounce_key_is_per_task_path() -> None:
    """An enqueue of one path never rewrites the arguments of another path's task with the same key."""
    first = Task.objects.enqueue(NOOP, kwargs={"v": 1}, dedup_key="d", debounce=30)
    other = Task.objects.enqueue("tests.testapp.handlers.record", kwargs={"v": 2}, dedup_key="d", debounce=30)
    assert other.created and other.id != first.id
    assert Task.objects.get(pk=first.id).kwargs == {"v": 1}


# -- the JSON API -----------------------------------------------------------------------------


def test_the_api_enqueues_under_a_window_and_shows_it(task_api: Api) -> None:
    status, first = task_api.enqueue({"task_path": NOOP, "dedup_key": "api:1", "unique_for": 60})
    assert status == 201 and first["created"] and first["task_id"] == first["task"]["id"]
    window = first["task"]["unique_window"]
    assert window["key"] == "api:1" and window["expires_at"] > window["accepted_at"]
    Task.objects.filter(pk=first["task_id"]).cancel()
    status, again = task_api.enqueue({"task_path": NOOP, "dedup_key": "api:1", "unique_for": 60, "kwargs": {"n": 2}})
    assert (status, again["created"], again["task_id"]) == (200, False, first["task_id"])
    status, detail = task_api.call("GET", f"/api/tasks/{first['task_id']}")
    assert status == 200 and detail["task"]["unique_window"]["key"] == "api:1"

    status, d1 = task_api.enqueue(
        {"task_path": NOOP, "dedup_key": "api:d", "debounce": 30, "max_wait": 60, "kwargs": {"n": 1}}
    )
    status2, d2 = task_api.enqueue(
        {"task_path": NOOP, "dedup_key": "api:d", "debounce": 30, "max_wait": 60, "kwargs": {"n": 2}}
    )
    assert (status, status2, d2["created"], d2["task_id"]) == (201, 200, False, d1["task_id"])
    assert d2["task"]["kwargs"] == {"n": 2} and d2["task"]["debounces"] == 1
    assert d2["task"]["debounce_key"] == "api:d" and d2["task"]["debounce_until"] is not None


def test_the_api_answers_a_window_whose_task_was_pruned_with_its_id(task_api: Api) -> None:
    status, first = task_api.enqueue({"task_path": NOOP, "dedup_key": "gone", "unique_for": 600})
    Task.objects.filter(pk=first["task_id"]).delete()
    status, again = task_api.enqueue({"task_path": NOOP, "dedup_key": "gone", "unique_for": 600})
    assert (status, again["task"], again["task_id"], again["created"]) == (200, None, first["task_id"], False)


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"unique_for": 60}, "unique_for"),
        ({"debounce": 5}, "debounce"),
        ({"dedup_key": "k", "unique_for": 0}, "unique_for"),
        ({"dedup_key": "k", "unique_for": -5}, "unique_for"),
        ({"dedup_key": "k", "unique_for": "60"}, "unique_for"),
        ({"dedup_key": "k", "unique_for": True}, "unique_for"),
        ({"dedup_key": "k", "unique_for": windows.MAX_WINDOW_SECONDS + 1}, "unique_for"),
        ({"dedup_key": "k", "debounce": 5, "unique_for": 60}, "debounce"),
        ({"dedup_key": "k", "max_wait": 5}, "max_wait"),
        ({"dedup_key": "k", "debounce": 10, "max_wait": 5}, "max_wait"),
        ({"dedup_key": "k", "debounce": 5, "run_after": "2030-01-01T00:00:00Z"}, "run_after"),
        ({"dedup_key": "k", "debounce": []}, "debounce"),
    ],
)
def test_the_api_refuses_bad_windows_with_400_and_changes_nothing(
    task_api: Api, extra: dict[str, Any], field: str
) -> None:
    Task.objects.enqueue(NOOP, kwargs={"v": 1}, dedup_key="k", debounce=30)
    before = list(Task.objects.values())
    status, body = task_api.enqueue({"task_path": NOOP, "kwargs": {"v": "changed"}, **extra})
    assert status == 400, body
    assert body["error"] and body.get("field") == field, body
    assert list(Task.objects.values()) == before and not UniqueKey.objects.exists()


def test_the_openapi_document_describes_the_window_fields(task_api: Api) -> None:
    _status, document = task_api.call("GET", "/api/openapi.json")
    fields = document["paths"]["/tasks"]["post"]["requestBody"]["content"]["application/json"]["schema"]["properties"]
    assert {"unique_for", "debounce", "max_wait"} <= set(fields)
    assert fields["unique_for"]["maximum"] == windows.MAX_WINDOW_SECONDS


# -- the django.tasks backend -----------------------------------------------------------------


def backend_settings(settings: Any, **options: Any) -> Any:
    from tasks.compat import task_backends

    settings.TASKS = {"default": {"BACKEND": "tasks.backends.LeaseBackend", "OPTIONS": options}}
    return task_backends["default"]


def test_the_backend_maps_task_paths_to_a_unique_window(settings: Any) -> None:
    from tests.conformance.tasks import noop_task

    backend_settings(settings, unique={noop_task.module_path: {"key": "noop:{0}", "for": 60}})
    first, again, other = noop_task.enqueue(1), noop_task.enqueue(1, 2), noop_task.enqueue(2)
    assert again.id == first.id and other.id != first.id
    assert again.args == [1]  # the result is the existing task's
    assert Task.objects.count() == 2 and UniqueKey.objects.get(key="noop:1").task_id == int(first.id)
    with pytest.raises(ValueError, match="unique key template"):
        noop_task.enqueue()
    assert Task.objects.count() == 2


def test_the_backend_maps_task_paths_to_a_debounce(settings: Any) -> None:
    from tests.conformance.tasks import noop_task

    backend_settings(settings, debounce={noop_task.module_path: {"key": "noop", "delay": 30, "max_wait": 40}})
    first, again = noop_task.enqueue(1), noop_task.enqueue(2)
    assert again.id == first.id and again.args == [2]
    task = Task.objects.get(pk=int(first.id))
    assert (task.args, task.debounce_key, task.debounces) == ([2], "noop", 1)
    assert task.debounce_until == task.enqueued_at + dt.timedelta(seconds=40)


@pytest.mark.parametrize(
    "options",
    [
        {"unique": []},
        {"unique": {"a.b": {"key": "k"}}},
        {"unique": {"a.b": {"key": "k", "for": 0}}},
        {"unique": {"a.b": {"key": "k", "for": "1m"}}},
        {"unique": {"a.b": {"key": "", "for": 5}}},
        {"unique": {"a.b": {"key": "k:{0.__class__}", "for": 5}}},
        {"unique": {"a.b": {"key": "k", "for": 5, "delay": 5}}},
        {"debounce": {"a.b": {"key": "k"}}},
        {"debounce": {"a.b": {"key": "k", "delay": 10, "max_wait": 5}}},
        {"debounce": {"a.b": {"key": "k", "delay": math.nan}}},
        {"debounce": {"a.b": {"key": "k:{0:>{1}}", "delay": 5}}},
        {"unique": {"a.b": {"key": "k", "for": 5}}, "debounce": {"a.b": {"key": "k", "delay": 5}}},
    ],
)
def test_the_backend_check_reports_malformed_windows(settings: Any, options: dict[str, Any]) -> None:
    from tests.conformance.tasks import noop_task

    backend = backend_settings(settings, **options)
    assert {e.id for e in backend.check()} == {"tasks.E014"}
    # A malformed mapping applies nothing: a plain task.
    noop_task.enqueue(1)
    assert not UniqueKey.objects.exists() and not Task.objects.filter(debounce_key__isnull=False).exists()


def test_well_formed_windows_pass_the_check(settings: Any) -> None:
    backend = backend_settings(
        settings,
        unique={"a.b": {"key": "report:{0}", "for": 3600}},
        debounce={"c.d": {"key": "reindex:{id}", "delay": 2.5}, "e.f": {"key": "x", "delay": 1, "max_wait": 10}},
    )
    assert backend.check() == []


# -- where a user looks -------------------------------------------------------------------------


def test_the_task_page_and_the_admin_show_the_key_and_its_window(staff: Any) -> None:
    unique = Task.objects.enqueue(NOOP, dedup_key="report:<7>", unique_for=90)
    debounced = Task.objects.enqueue(NOOP, dedup_key="feed:<1>", debounce=5, max_wait=60)
    Task.objects.enqueue(NOOP, dedup_key="feed:<1>", debounce=5, max_wait=60)
    page = staff.get(f"/dashboard/tasks/{unique.id}/").content.decode()
    assert 'id="task-unique-window"' in page and "a window of 90 s" in page
    assert "report:&lt;7&gt;" in page  # escaped
    page = staff.get(f"/dashboard/tasks/{debounced.id}/").content.decode()
    assert 'id="task-debounce"' in page and "feed:&lt;1&gt;" in page and "1 later enqueue folded in" in page
    assert "never pushed past" in page
    admin = staff.get(f"/admin/tasks/task/{unique.id}/change/").content.decode()
    assert "report:&lt;7&gt;: unique until" in admin and "(90 s window)" in admin
    close_window("report:<7>")
    page = staff.get(f"/dashboard/tasks/{unique.id}/").content.decode()
    assert 'id="task-unique-window"' not in page  # a window that passed is not shown


def test_a_window_is_shown_as_long_as_it_was_asked_though_its_ends_are_two_clock_reads(staff: Any) -> None:
    """The statement reads the clock once for each end: on a busy server they lie microseconds further
    apart than the window (CI's loaded run: the page said "a window of 90.0 s")."""
    unique = Task.objects.enqueue(NOOP, dedup_key="report:8", unique_for=90)
    row = UniqueKey.objects.get(key="report:8")
    UniqueKey.objects.filter(key="report:8").update(
        expires_at=row.accepted_at + dt.timedelta(seconds=90, microseconds=4)
    )
    assert UniqueKey.objects.get(key="report:8").seconds == 90
    assert "a window of 90 s" in staff.get(f"/dashboard/tasks/{unique.id}/").content.decode()
    assert "(90 s window)" in staff.get(f"/admin/tasks/task/{unique.id}/change/").content.decode()


def test_metrics_count_open_windows_and_debounces(client: Any, settings: Any) -> None:
    from leasing.metrics import scrape_values

    settings.LEASING_METRICS_PUBLIC = True
    Task.objects.enqueue(NOOP, dedup_key="open", unique_for=60)
    Task.objects.enqueue(NOOP, dedup_key="passed", unique_for=60)
    close_window("passed")
    for _ in range(3):
        Task.objects.enqueue(NOOP, dedup_key="d1", debounce=30)
    Task.objects.enqueue(NOOP, dedup_key="d2", debounce=30)
    claimed_key = Task.objects.enqueue(NOOP, dedup_key="d3", debounce=0.001)
    Task.objects.filter(pk=claimed_key.id).update(status="CANCELLED")  # not waiting: not counted
    values = scrape_values(client.get("/metrics").content.decode())
    assert values['tasks_unique_windows_open{database="default"}'] == 1
    assert values['tasks_debounced_waiting{database="default"}'] == 2
    assert values['tasks_debounces_folded{database="default"}'] == 2


def test_the_howto_page_runs_as_written() -> None:
    """docs/howto/pausing-and-keys.md: the windows block marked "tested" runs as written."""
    import re

    from tests.helpers import ROOT

    page = (ROOT / "docs" / "howto" / "pausing-and-keys.md").read_text()
    blocks = re.findall(r"<!-- tested: tests/db/test_unique_windows.py -->\n```python\n(.*?)```", page, re.S)
    assert len(blocks) == 1
    exec(compile(blocks[0], "pausing-and-keys.md", "exec"), {})
    assert Task.objects.count() == 2 and UniqueKey.objects.filter(key="report:7").exists()


def test_manage_py_check_refuses_malformed_windows_at_startup(settings: Any) -> None:
    from django.core.management import call_command
    from django.core.management.base import SystemCheckError

    settings.TASKS = {
        "default": {
            "BACKEND": "tasks.backends.LeaseBackend",
            "OPTIONS": {"debounce": {"a.b": {"key": "k", "delay": 10, "max_wait": 5}}},
        }
    }
    with pytest.raises(SystemCheckError, match=r"tasks\.E014.*'max_wait' must be at least 'delay'"):
        call_command("check")
