"""Concurrency keys on one connection and a few more: admission, release on every exit, the limit
rule, validation, and the claim's plan with a full key's large backlog (tasks/lifecycle/concurrency.py)."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import pytest
from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from tasks.lifecycle import concurrency
from tasks.models import ConcurrencyKey, Failure, Task, TaskStatus
from tests.helpers import wait_until
from tests.helpers.api import Api
from tests.helpers.task_paths import NOOP

pytestmark = pytest.mark.django_db(transaction=True)


def keyed(key: str = "k", limit: int = 2, **kwargs: Any) -> int:
    return Task.objects.enqueue(NOOP, concurrency_key=key, concurrency_limit=limit, **kwargs).id


def statuses(ids: list[int]) -> list[str]:
    found = dict(Task.objects.filter(pk__in=ids).values_list("id", "status"))
    return [found[i] for i in ids]


def admitted(key: str = "k") -> int:
    return Task.objects.filter(concurrency_key=key, status__in=["READY", "RUNNING"]).count()


def test_a_key_admits_its_limit_and_the_rest_wait_blocked() -> None:
    ids = [keyed() for _ in range(5)]
    other = Task.objects.enqueue(NOOP).id
    assert statuses(ids) == ["READY", "READY", "BLOCKED", "BLOCKED", "BLOCKED"]
    assert statuses([other]) == ["READY"]
    claimed = Task.objects.claim("w1", limit=10)
    assert sorted(c.id for c in claimed) == sorted([*ids[:2], other])


def test_every_exit_frees_the_slot_for_the_next_waiting_task() -> None:
    ids = [keyed(limit=1) for _ in range(6)]
    (first,) = Task.objects.claim("w1", limit=10)
    assert first.id == ids[0]
    assert Task.objects.complete(first.id, "w1", first.token)  # success
    assert statuses(ids[:2]) == ["SUCCESSFUL", "READY"]
    (second,) = Task.objects.claim("w1", limit=10)
    outcome = Task.objects.fail(Failure(second.id, second.token, "E", "boom", retry=False), "w1")  # final failure
    assert outcome is not None and outcome.status == "FAILED"
    assert statuses(ids[1:3]) == ["FAILED", "READY"]
    Task.objects.filter(pk=ids[2]).cancel()  # cancel of an admitted task
    assert statuses(ids[2:4]) == ["CANCELLED", "READY"]
    Task.objects.filter(pk=ids[5]).cancel()  # cancel of a waiting one frees nothing
    assert statuses(ids[3:]) == ["READY", "BLOCKED", "CANCELLED"]
    Task.objects.filter(pk=ids[3]).delete()  # delete of an admitted task
    assert statuses([ids[4]]) == ["READY"]
    assert admitted() == 1


def test_a_retry_backing_off_gives_its_slot_up_and_a_hand_back_keeps_it() -> None:
    ids = [keyed(limit=1) for _ in range(3)]
    (first,) = Task.objects.claim("w1")
    assert Task.objects.hand_back("w1", [first.key]) == {first.key}
    assert statuses(ids) == ["READY", "BLOCKED", "BLOCKED"]  # runnable at once: it keeps its slot
    (first,) = Task.objects.claim("w1")
    outcome = Task.objects.fail(Failure(first.id, first.token, "E", "boom"), "w1")
    assert outcome is not None and outcome.retried and outcome.status == "BLOCKED"
    assert statuses(ids) == ["BLOCKED", "READY", "BLOCKED"]
    # Once due, the sweep (the recovery round) admits it when a slot is free.
    (second,) = Task.objects.claim("w1")
    Task.objects.filter(pk=ids[0]).update(run_after=timezone.now() - dt.timedelta(seconds=1))
    assert Task.objects.complete(second.id, "w1", second.token)
    assert statuses(ids) == ["READY", "SUCCESSFUL", "BLOCKED"]  # due and best by run_after


def test_deferred_keyed_tasks_are_admitted_when_due_by_the_sweep() -> None:
    later = keyed(limit=2, run_after=timezone.now() + dt.timedelta(seconds=1))
    assert statuses([later]) == ["BLOCKED"]  # a deferred task does not hold a slot while it waits
    wait_until(lambda: concurrency.admit_waiting() == 1, 10, what="the deferred task to come due")
    assert statuses([later]) == ["READY"]


def test_recovery_keeps_the_slot_of_an_uncharged_return_and_frees_it_when_it_gives_up(settings: Any) -> None:
    settings.LEASING_TASKS = {"MAX_CRASHES": 1}
    ids = [keyed(limit=1) for _ in range(2)]
    (first,) = Task.objects.claim("w1", ttl=0.05)  # never started: returned uncharged
    wait_until(lambda: Task.objects.stuck().exists(), what="expiry")
    Task.objects.recover_expired()
    assert statuses(ids) == ["READY", "BLOCKED"]
    (first,) = Task.objects.claim("w1", ttl=0.05, start=True)  # started and isolated: a crash, charged
    Task.objects.filter(pk=first.id).update(attempt_isolated=True)
    wait_until(lambda: Task.objects.stuck().exists(), what="expiry")
    (recovered,) = Task.objects.recover_expired()
    assert recovered.status == "FAILED"
    assert statuses(ids) == ["FAILED", "READY"]


def test_requeue_of_a_finished_keyed_task_goes_through_the_gate() -> None:
    ids = [keyed(limit=1) for _ in range(2)]
    Task.objects.filter(pk=ids[0]).cancel()
    assert statuses(ids) == ["CANCELLED", "READY"]
    Task.objects.filter(pk=ids[0]).requeue()
    assert statuses(ids) == ["BLOCKED", "READY"]
    # An edit that tries to skip the queue is turned back too.
    Task.objects.filter(pk=ids[0]).update(status="READY")
    assert statuses(ids) == ["BLOCKED", "READY"]


def test_the_latest_enqueue_sets_the_limit() -> None:
    ids = [keyed(limit=2) for _ in range(4)]
    assert admitted() == 2
    ids.append(keyed(limit=3))  # raising it admits at once
    assert admitted() == 3 and ConcurrencyKey.objects.get(key="k").max_running == 3
    ids.append(keyed(limit=1))  # lowering it admits nothing more until the key is below it
    assert admitted() == 3 and ConcurrencyKey.objects.get(key="k").max_running == 1
    for _ in range(3):
        (task,) = Task.objects.claim("w1")
        assert Task.objects.complete(task.id, "w1", task.token)
    assert admitted() == 1
    assert statuses(ids).count("BLOCKED") == 2


def test_dedup_covers_blocked_tasks() -> None:
    keyed(limit=1)
    first = Task.objects.enqueue(NOOP, concurrency_key="k", concurrency_limit=1, dedup_key="d")
    again = Task.objects.enqueue(NOOP, concurrency_key="k", concurrency_limit=1, dedup_key="d")
    assert first.created and not again.created and again.id == first.id
    assert statuses([first.id]) == ["BLOCKED"]
    assert admitted() == 1


def test_bulk_enqueue_admits_exactly_the_limit() -> None:
    ids = Task.objects.bulk_enqueue(NOOP, [{}] * 500, concurrency_key="bulk", concurrency_limit=3)
    assert statuses(ids[:4]) == ["READY", "READY", "READY", "BLOCKED"]
    assert admitted("bulk") == 3


@pytest.mark.parametrize(
    ("key", "limit", "message"),
    [
        ("k", None, "go together"),
        (None, 2, "go together"),
        ("", 2, "non-empty"),
        ("x" * 256, 2, "at most 255"),
        ("a\x00b", 2, "NUL"),
        ("\ud800", 2, "surrogates"),
        ("k", 0, "from 1"),
        ("k", True, "from 1"),
        ("k", 2.5, "from 1"),
        ("k", 2**31, "from 1"),
    ],
)
def test_bad_keys_and_limits_are_refused_and_change_nothing(key: Any, limit: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Task.objects.enqueue(NOOP, concurrency_key=key, concurrency_limit=limit)
    assert not Task.objects.exists() and not ConcurrencyKey.objects.exists()


def test_the_database_refuses_a_key_without_a_limit_and_a_changed_key() -> None:
    with pytest.raises(IntegrityError), transaction.atomic():
        Task.objects.create(task_path=NOOP, concurrency_key="k")
    task_id = keyed()
    with pytest.raises(IntegrityError), transaction.atomic():
        Task.objects.filter(pk=task_id).update(concurrency_key="other")


def test_key_states_show_keys_at_their_limit() -> None:
    for _ in range(4):
        keyed("busy", 2)
    keyed("idle", 5)
    Task.objects.claim("w1", limit=1)
    states = {s.key: s for s in concurrency.key_states()}
    busy = states["busy"]
    assert (busy.limit, busy.admitted, busy.waiting, busy.full) == (2, 2, 2, True)
    assert busy.running + states["idle"].running == 1
    assert not states["idle"].full
    assert concurrency.key_states()[0].key == "busy"


def _plan(sql: str, params: dict[str, Any]) -> dict[str, Any]:
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sql, params)
        explained = cursor.fetchone()[0]
        transaction.set_rollback(True)
    return (json.loads(explained) if isinstance(explained, str) else explained)[0]["Plan"]


def _nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    return [plan, *(node for child in plan.get("Plans", []) for node in _nodes(child))]


@pytest.mark.slow
def test_a_full_keys_backlog_costs_the_claim_nothing() -> None:
    """100,000 waiting tasks of one full key, ahead of everything else in priority: the claim reads
    the two unkeyed tasks behind them and nothing of the backlog."""
    from tasks.lifecycle.statements import CLAIM_SQL, claim_params

    Task.objects.bulk_enqueue(NOOP, [{}] * 100_000, priority=50, concurrency_key="full", concurrency_limit=2)
    Task.objects.claim("holder", limit=2)  # the key's two slots are running
    others = [Task.objects.enqueue(NOOP).id for _ in range(2)]
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE tasks_task")
    params = {
        "worker": "plan",
        "ttl": 30.0,
        "limit": 10,
        "start": False,
        "isolate_after": 2,
        **claim_params(["default"], busy=False, isolate_after=2),
    }
    plan = _plan(CLAIM_SQL[0], params)
    nodes = _nodes(plan)
    assert all(n.get("Relation Name") != "tasks_task" for n in nodes if n["Node Type"] == "Seq Scan")
    # Only READY rows are read (through the claim index or, READY rows being few, the status index):
    # none of the blocked backlog.
    assert {n.get("Index Name") for n in nodes} & {"tasks_task_claim_idx", "tasks_task_state_idx"}
    assert "tasks_task_blocked_idx" not in {n.get("Index Name") for n in nodes}
    assert plan["Actual Rows"] == len(others)
    assert plan["Shared Hit Blocks"] + plan["Shared Read Blocks"] < 150
    # And the finish that frees a slot admits one task with a few index probes, not a scan.
    task = Task.objects.filter(status="RUNNING", concurrency_key="full").first()
    assert task is not None and task.token is not None
    assert Task.objects.complete(task.id, "holder", task.token)
    assert admitted("full") == 2
    assert Task.objects.filter(status=TaskStatus.BLOCKED).count() == 100_000 - 3


def test_the_api_enqueues_keyed_tasks(task_api: Api) -> None:
    bodies = [{"task_path": NOOP, "concurrency_key": "api", "concurrency_limit": 1} for _ in range(2)]
    (s1, first), (s2, second) = (task_api.enqueue(b) for b in bodies)
    assert (s1, s2) == (201, 201)
    assert (first["task"]["status"], second["task"]["status"]) == ("READY", "BLOCKED")
    assert (second["task"]["concurrency_key"], second["task"]["concurrency_limit"]) == ("api", 1)


@pytest.mark.parametrize(
    "extra",
    [
        {"concurrency_key": "k"},
        {"concurrency_limit": 2},
        {"concurrency_key": "k", "concurrency_limit": 0},
        {"concurrency_key": "k", "concurrency_limit": -1},
        {"concurrency_key": "k", "concurrency_limit": 2**31},
        {"concurrency_key": "k", "concurrency_limit": 1.5},
        {"concurrency_key": "k", "concurrency_limit": "2"},
        {"concurrency_key": "k", "concurrency_limit": True},
        {"concurrency_key": "", "concurrency_limit": 2},
        {"concurrency_key": "   ", "concurrency_limit": 2},
        {"concurrency_key": "x" * 256, "concurrency_limit": 2},
        {"concurrency_key": 5, "concurrency_limit": 2},
        {"concurrency_key": ["k"], "concurrency_limit": 2},
        {"concurrency_key": "a\u0000b", "concurrency_limit": 2},
    ],
)
def test_the_api_refuses_bad_concurrency_fields_with_400_and_changes_nothing(
    task_api: Api, extra: dict[str, Any]
) -> None:
    status, body = task_api.enqueue({"task_path": NOOP, **extra})
    assert status == 400, body
    assert body["error"] and body.get("field") in ("concurrency_key", "concurrency_limit"), body
    assert not Task.objects.exists() and not ConcurrencyKey.objects.exists()


def test_the_api_refuses_a_lone_surrogate_in_the_key(task_api: Api) -> None:
    raw = '{"task_path": "' + NOOP + '", "concurrency_key": "\\ud800", "concurrency_limit": 2}'
    status, body = task_api.enqueue(raw=raw)
    assert status == 400, body
    assert not Task.objects.exists()


def test_the_django_tasks_backend_maps_task_paths_to_keys(settings: Any) -> None:
    from tests.conformance.tasks import noop_task

    settings.TASKS = {
        "default": {
            "BACKEND": "tasks.backends.LeaseBackend",
            "OPTIONS": {"concurrency": {noop_task.module_path: {"key": "noop:{0}", "limit": 1}}},
        }
    }
    first, second, other = noop_task.enqueue(1), noop_task.enqueue(1, 2), noop_task.enqueue(2)
    rows = dict(Task.objects.values_list("id", "status"))
    assert [rows[int(r.id)] for r in (first, second, other)] == ["READY", "BLOCKED", "READY"]
    assert Task.objects.get(pk=int(second.id)).concurrency_key == "noop:1"
    second.refresh()
    assert second.status == "READY"  # django.tasks has no BLOCKED: a waiting task is READY
    with pytest.raises(ValueError, match="does not fit"):
        noop_task.enqueue()  # the template needs a first argument
    assert Task.objects.count() == 3


def test_the_backend_check_reports_a_bad_concurrency_mapping(settings: Any) -> None:
    from tasks.compat import task_backends

    settings.TASKS = {
        "default": {"BACKEND": "tasks.backends.LeaseBackend", "OPTIONS": {"concurrency": {"a.b": {"key": "k"}}}}
    }
    assert [e.id for e in task_backends["default"].check()] == ["tasks.E012"]


def test_the_dashboard_and_metrics_show_keys_at_their_limit(client: Any, settings: Any) -> None:
    from django.contrib.auth import get_user_model
    from prometheus_client.parser import text_string_to_metric_families

    for _ in range(3):
        keyed("tenant-<7>", 1)
    Task.objects.claim("w1")
    client.force_login(get_user_model().objects.create_superuser("conc", "conc@example.com", "pw"))
    page = client.get("/dashboard/").content.decode()
    assert 'id="concurrency-keys"' in page
    assert "tenant-&lt;7&gt;" in page and "1 / 1 (full)" in page  # escaped, and at its limit
    blocked = client.get("/dashboard/tasks/blocked/")
    assert blocked.status_code == 200 and blocked.content.decode().count("/dashboard/tasks/") >= 2
    settings.LEASING_METRICS_PUBLIC = True
    samples = {
        (family.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(client.get("/metrics").content.decode())
        for sample in family.samples
    }
    at = (("database", "default"),)
    assert samples[("tasks_concurrency_running", (*at, ("key", "tenant-<7>")))] == 1
    assert samples[("tasks_concurrency_waiting", (*at, ("key", "tenant-<7>")))] == 2
    assert samples[("tasks_concurrency_keys_full", at)] == 1
    assert samples[("tasks_tasks", (*at, ("state", "blocked")))] == 2


def test_retry_now_admits_deferred_keyed_tasks_at_once() -> None:
    later = timezone.now() + dt.timedelta(hours=1)
    ids = [keyed("deferred", 1, run_after=later) for _ in range(2)]
    assert statuses(ids) == ["BLOCKED", "BLOCKED"]
    assert Task.objects.filter(pk__in=ids).retry_now() == 2
    assert statuses(ids) == ["READY", "BLOCKED"]


def test_a_long_transaction_that_enqueued_a_keyed_task_does_not_stall_a_finish_of_its_key() -> None:
    """An application enqueues a keyed task inside its own transaction and keeps it open: the key's
    row stays locked until it commits. A worker finishing a task of that key does not wait for that
    commit (the admission's lock wait is bounded, 200 ms): it returns while the application's
    transaction is still open, and the recovery sweep admits for the key afterwards."""
    import threading

    from django.db import connections

    ids = [keyed("busy", 1) for _ in range(2)]
    (running,) = Task.objects.claim("w1")
    holding, release = threading.Event(), threading.Event()
    late: list[int] = []

    def application() -> None:
        try:
            with transaction.atomic():
                late.append(keyed("busy", 1))
                holding.set()
                release.wait(120)  # a hang guard: the test releases it
        finally:
            connections["default"].close()

    thread = threading.Thread(target=application)
    thread.start()
    try:
        assert holding.wait(10)
        assert Task.objects.complete(running.id, "w1", running.token)
        # Not blocked until the application commits: its task is still invisible, uncommitted.
        assert not Task.objects.filter(pk=late[0]).exists()
        assert statuses(ids) == ["SUCCESSFUL", "BLOCKED"]  # nobody could admit for the key yet
    finally:
        release.set()
        thread.join(30)
    assert concurrency.admit_waiting() == 1  # the sweep, once the application committed
    assert statuses([ids[1], late[0]]) == ["READY", "BLOCKED"]


def test_idle_keys_are_forgotten_and_busy_ones_kept() -> None:
    done = keyed("done", 1)
    Task.objects.filter(pk=done).cancel()
    keyed("busy", 1)
    keyed("busy", 1)
    ConcurrencyKey.objects.update(updated_at=timezone.now() - dt.timedelta(hours=2))
    assert concurrency.prune_idle_keys() == 1
    assert list(ConcurrencyKey.objects.values_list("key", flat=True)) == ["busy"]
    # A key that comes back gets its row (and the new enqueue's limit) again.
    assert statuses([keyed("done", 3)]) == ["READY"]
    assert ConcurrencyKey.objects.get(key="done").max_running == 3


@pytest.mark.parametrize(
    "template",
    ["noop:{", "noop:}", "noop:{0!z}", "{0.__class__}", "{0[id].__class__.__mro__}", "{0:{1.real}}", "{0.real}"],
)
def test_the_backend_check_refuses_a_malformed_or_attribute_reading_key_template(settings: Any, template: str) -> None:
    from tasks.compat import task_backends
    from tests.conformance.tasks import noop_task

    settings.TASKS = {
        "default": {
            "BACKEND": "tasks.backends.LeaseBackend",
            "OPTIONS": {"concurrency": {noop_task.module_path: {"key": template, "limit": 1}}},
        }
    }
    assert [e.id for e in task_backends["default"].check()] == ["tasks.E012"]


@pytest.mark.parametrize(
    ("template", "args", "kwargs", "why"),
    [
        ("noop:{0[0]}", [7], {}, "does not fit"),  # an int has no items: TypeError
        ("noop:{0[id]}", [[1, 2]], {}, "does not fit"),  # a list indexed by a name
        ("noop:{0:d}", ["x"], {}, "does not fit"),  # a format spec the value cannot take
        ("noop:{who}", [], {"other": 1}, "does not fit"),
        ("noop:{0}", [], {}, "does not fit"),
        ("noop:{0}", ["x" * 300], {}, "at most 255"),
        ("noop:{0:>255}", [1], {}, "at most 255"),  # wider fields are refused by the check
        ("{0}", [""], {}, "non-empty"),
    ],
)
def test_a_call_that_does_not_fit_the_key_template_is_refused_and_writes_nothing(
    settings: Any, template: str, args: list[Any], kwargs: dict[str, Any], why: str
) -> None:
    from tests.conformance.tasks import noop_task

    settings.TASKS = {
        "default": {
            "BACKEND": "tasks.backends.LeaseBackend",
            "OPTIONS": {"concurrency": {noop_task.module_path: {"key": template, "limit": 1}}},
        }
    }
    with pytest.raises(ValueError, match=why):
        noop_task.enqueue(*args, **kwargs)
    assert not Task.objects.exists() and not ConcurrencyKey.objects.exists()
