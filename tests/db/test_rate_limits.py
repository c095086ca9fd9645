"""Rate limits per key (issue 24): RATE_START_SQL against the real database. A start is granted iff
fewer than the limit's count of grants lie in the window ending now (database clock); a refusal
hands the attempt back uncharged with run_after pushed to a distinct reserved time; a lapsed claim
takes nothing; a lost reply is answered again. The 3-process test is
tests/concurrency/test_rate_limit_processes.py."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import pytest
from django.db import connection

from tasks.lifecycle import statements as sql
from tasks.lifecycle.ratelimits import (
    Rate,
    parse_rate,
    prune_idle_keys,
    queue_rate,
    rate_key_states,
)
from tasks.models import RateLimit, RateRefused, Started, Task, TaskStatus
from tests.helpers import db_now
from tests.helpers.api import Api
from tests.helpers.task_paths import NOOP

pytestmark = pytest.mark.django_db(transaction=True)

W = "rate-worker"


def enqueue_and_claim(n: int, *, key: str = "mail", limit: Any = "3/s", **kwargs: Any) -> list[tuple[int, int]]:
    Task.objects.bulk_enqueue("tests.testapp.handlers.noop", [{}] * n, rate_key=key, rate_limit=limit, **kwargs)
    claimed = Task.objects.claim(W, limit=n, queues=[kwargs.get("queue", "default")], ttl=30)
    assert len(claimed) == n
    assert all(c.rate_key == key for c in claimed)
    return [(c.id, c.token) for c in claimed]


def start(attempt: tuple[int, int], **kwargs: Any) -> Started | RateRefused | None:
    return Task.objects.rate_start(attempt[0], W, attempt[1], **kwargs)


@pytest.mark.parametrize(
    ("text", "rate"),
    [
        ("14/s", Rate(14, 1.0)),
        ("100/min", Rate(100, 60.0)),
        ("100/m", Rate(100, 60.0)),
        ("5/10s", Rate(5, 10.0)),
        ("2 / 1.5 seconds", Rate(2, 1.5)),
        ("1000/h", Rate(1000, 3600.0)),
        ((20, 1), Rate(20, 1.0)),
        ([3, 0.5], Rate(3, 0.5)),
    ],
)
def test_rates_parse(text: Any, rate: Rate) -> None:
    assert parse_rate(text) == rate


@pytest.mark.parametrize(
    "bad", ["", "14", "14/", "0/s", "-1/s", "14/fortnight", "1/0s", (1,), (True, 1), (1, "s"), (10**6, 1), 14, None]
)
def test_bad_rates_are_refused_and_nothing_is_inserted(bad: Any) -> None:
    with pytest.raises(ValueError, match="rate limit"):
        parse_rate(bad)
    with pytest.raises(ValueError, match="rate"):
        Task.objects.enqueue("tests.testapp.handlers.noop", rate_key="mail", rate_limit=bad)
    with pytest.raises(ValueError, match="rate"):
        Task.objects.bulk_enqueue("tests.testapp.handlers.noop", [{}], rate_key="mail", rate_limit=bad)
    assert not Task.objects.exists()


@pytest.mark.parametrize(("key", "limit"), [("mail", None), (None, "1/s"), ("", "1/s"), ("x" * 256, "1/s")])
def test_a_key_and_a_limit_go_together(key: Any, limit: Any) -> None:
    with pytest.raises(ValueError, match="rate_"):
        Task.objects.enqueue("tests.testapp.handlers.noop", rate_key=key, rate_limit=limit)
    assert not Task.objects.exists()


def test_grants_up_to_the_count_then_refuses_uncharged_to_distinct_future_times() -> None:
    attempts = enqueue_and_claim(6, limit="3/s")
    before = db_now()
    results = [start(a) for a in attempts]
    granted = [r for r in results if isinstance(r, Started)]
    refused = [r for r in results if isinstance(r, RateRefused)]
    assert len(granted) == 3 and len(refused) == 3
    assert all(g.attempt == 1 for g in granted)
    # Refused: READY again, not an attempt, not a crash, not an unstarted return; later and apart.
    times = [r.run_after for r in refused]
    assert len(set(times)) == 3 and min(times) > before
    for r in refused:
        row = Task.objects.get(pk=r.id)
        assert row.status == TaskStatus.READY
        assert (row.attempts, row.crashes, row.unstarted_returns, row.rate_refusals) == (0, 0, 0, 1)
        assert not row.attempt_started and row.worker_ids == []
        assert row.released_at is not None and row.run_after == r.run_after
    # The reservations are one period / count apart, from when the oldest grant leaves the window.
    oldest = min(g.last_attempted_at for g in granted)
    assert sorted(times)[0] >= oldest + dt.timedelta(seconds=1)
    steps = [(b - a).total_seconds() for a, b in zip(sorted(times), sorted(times)[1:], strict=False)]
    assert steps == pytest.approx([1 / 3, 1 / 3], abs=1e-5)
    # The granted ones are started at the grant's clock, recorded in the key's window.
    key = RateLimit.objects.get(key="mail")
    assert sorted(key.starts) == sorted(g.last_attempted_at for g in granted)
    assert (key.grants, key.refusals, key.max_starts, key.period) == (3, 3, 3, 1.0)
    for g in granted:
        row = Task.objects.get(pk=g.id)
        assert row.status == TaskStatus.RUNNING and row.attempt_started and row.worker_ids == [W]
        assert row.last_attempted_at == g.last_attempted_at


def test_the_window_slides_a_start_is_granted_once_the_oldest_leaves_it() -> None:
    attempts = enqueue_and_claim(3, limit=(2, 0.3))
    first, second = start(attempts[0]), start(attempts[1])
    assert isinstance(first, Started) and isinstance(second, Started)
    # Still inside the window of the first grant: refused (the claim is handed back).
    assert isinstance(start(attempts[2]), RateRefused)
    # Claimed again once due, after the first grant left the window: granted.
    task = Task.objects.get(pk=attempts[2][0])
    while db_now() < task.run_after:
        pass  # the database clock, not a sleep: the window is the database's
    again = Task.objects.claim(W, limit=1, ttl=30)
    assert [c.id for c in again] == [task.id]
    third = start((again[0].id, again[0].token))
    assert isinstance(third, Started)
    assert third.last_attempted_at > first.last_attempted_at + dt.timedelta(seconds=0.3)
    # The window holds only the grants of the last period.
    assert len(RateLimit.objects.get(key="mail").starts) <= 2


def test_no_window_holds_more_than_the_count_however_starts_interleave() -> None:
    attempts = enqueue_and_claim(40, limit=(5, 0.05))
    grants: list[dt.datetime] = []
    pending = list(attempts)
    while pending:
        attempt = pending.pop(0)
        result = start(attempt)
        if isinstance(result, Started):
            grants.append(result.last_attempted_at)
            continue
        assert isinstance(result, RateRefused)
        while db_now() < result.run_after:
            pass
        claimed = Task.objects.claim(W, limit=1, ttl=30)
        pending += [(c.id, c.token) for c in claimed]
    grants.sort()
    assert len(grants) == 40
    window = dt.timedelta(seconds=0.05)
    for i, at in enumerate(grants):
        inside = [g for g in grants[i:] if g < at + window]
        assert len(inside) <= 5, (at, inside)


def test_a_lapsed_claim_takes_no_start_and_a_resent_start_is_answered_again() -> None:
    attempts = enqueue_and_claim(2, limit="1/min")
    assert start((attempts[0][0], attempts[0][1] + 1000)) is None  # not our token
    assert Task.objects.rate_start(attempts[0][0], "someone-else", attempts[0][1]) is None
    assert not RateLimit.objects.exists()
    first = start(attempts[0])
    assert isinstance(first, Started)
    again = start(attempts[0])  # the reply was lost: sent again, same answer, nothing taken twice
    assert again == first
    assert RateLimit.objects.get(key="mail").grants == 1
    assert Task.objects.get(pk=attempts[0][0]).attempts == 1


def test_a_refused_attempt_comes_back_at_its_reservation_and_is_not_sent_to_the_back_of_the_line() -> None:
    attempts = enqueue_and_claim(4, limit=(1, 0.2))
    assert isinstance(start(attempts[0]), Started)
    refused = [start(a) for a in attempts[1:]]
    assert all(isinstance(r, RateRefused) for r in refused)
    tail = RateLimit.objects.get(key="mail").next_due
    # The first refused comes due at its reservation, but the window is made full again by a start
    # granted in between (as a late grant would): sent to when that one leaves, not behind the tail.
    first = refused[0]
    assert isinstance(first, RateRefused)
    while db_now() < first.run_after:
        pass
    claimed = Task.objects.claim(W, limit=1, ttl=30)
    assert [c.id for c in claimed] == [first.id]
    with connection.cursor() as cursor:
        cursor.execute("UPDATE tasks_ratelimit SET starts = ARRAY[clock_timestamp()]")
    second = start((claimed[0].id, claimed[0].token))
    assert isinstance(second, RateRefused)
    assert second.run_after < tail
    assert RateLimit.objects.get(key="mail").next_due == tail  # no new reservation taken
    assert Task.objects.get(pk=first.id).rate_refusals == 2


def test_a_lower_limit_applies_to_the_next_start() -> None:
    Task.objects.bulk_enqueue("tests.testapp.handlers.noop", [{}] * 3, rate_key="api", rate_limit="10/min")
    Task.objects.bulk_enqueue("tests.testapp.handlers.noop", [{}] * 2, rate_key="api", rate_limit="3/min")
    claimed = sorted(Task.objects.claim(W, limit=5, ttl=30), key=lambda c: c.id)
    results = [start((c.id, c.token)) for c in claimed]
    assert [isinstance(r, Started) for r in results] == [True, True, True, False, False]
    assert RateLimit.objects.get(key="api").max_starts == 3


def test_keys_do_not_share_a_window() -> None:
    a = enqueue_and_claim(2, key="a", limit="1/min")
    b = enqueue_and_claim(2, key="b", limit="1/min")
    assert [type(start(x)).__name__ for x in (a[0], b[0], a[1], b[1])] == [
        "Started",
        "Started",
        "RateRefused",
        "RateRefused",
    ]


def test_a_queue_wide_limit_from_settings(settings: Any) -> None:
    settings.LEASING_TASKS = {"RATE_LIMITS": {"mail": "2/min"}}
    assert queue_rate("mail") == ("queue:mail", Rate(2, 60.0))
    assert queue_rate("default") is None
    Task.objects.bulk_enqueue("tests.testapp.handlers.noop", [{}] * 3, queue="mail")
    claimed = Task.objects.claim(W, limit=3, queues=["mail"], ttl=30)
    results = [Task.objects.rate_start(c.id, W, c.token, queue="mail") for c in claimed]
    assert sum(isinstance(r, Started) for r in results) == 2
    assert RateLimit.objects.get(key="queue:mail").grants == 2


def test_a_keyed_task_refused_waits_blocked_and_gives_its_concurrency_slot_up() -> None:
    ids = Task.objects.bulk_enqueue(
        "tests.testapp.handlers.noop",
        [{}] * 2,
        rate_key="mail",
        rate_limit="1/min",
        concurrency_key="c",
        concurrency_limit=2,
    )
    claimed = Task.objects.claim(W, limit=2, ttl=30)
    assert sorted(c.id for c in claimed) == ids
    results = [start((c.id, c.token)) for c in claimed]
    refused = [r for r in results if isinstance(r, RateRefused)]
    assert len(refused) == 1
    assert Task.objects.get(pk=refused[0].id).status == TaskStatus.BLOCKED


def test_states_show_keys_at_their_limit_and_idle_keys_are_forgotten() -> None:
    attempts = enqueue_and_claim(3, limit="2/min")
    for a in attempts:
        start(a)
    [state] = rate_key_states(using="default")
    assert (state.key, state.count, state.in_window, state.grants, state.refusals, state.full) == (
        "mail",
        2,
        2,
        2,
        1,
        True,
    )
    assert prune_idle_keys(idle=3600) == 0
    with connection.cursor() as cursor:
        cursor.execute("UPDATE tasks_ratelimit SET decided_at = clock_timestamp() - interval '2 hours'")
    assert prune_idle_keys(idle=3600) == 1
    assert not RateLimit.objects.exists()


def test_the_take_reads_one_key_row_by_its_primary_key() -> None:
    attempts = enqueue_and_claim(2, limit="1/min")
    start(attempts[0])
    for n in range(2000):  # other keys: the take must not read them
        RateLimit.objects.create(
            key=f"other-{n}", max_starts=1, period=1, starts=[], next_due=db_now(), decided_at=db_now(), granted=True
        )
    # A table of realistic size: with two rows PostgreSQL 15 rightly reads tasks_task whole (breaker 32).
    Task.objects.bulk_enqueue(NOOP, [{}] * 5000, queue="finished")
    Task.objects.filter(queue="finished").update(status=TaskStatus.SUCCESSFUL)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE tasks_ratelimit")
        cursor.execute("ANALYZE tasks_task")
    params: dict[str, Any] = {
        "worker": W,
        "id": attempts[1][0],
        "token": attempts[1][1],
        "isolated": False,
        "key": None,
        "limit": None,
        "period": None,
    }
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN (ANALYZE, COSTS OFF) " + sql.RATE_START_SQL, params)
        text = "\n".join(row[0] for row in cursor.fetchall())
    assert "Conflict Arbiter Indexes: tasks_ratelimit_pkey" in text
    assert "Seq Scan on tasks_ratelimit" not in text
    assert "Seq Scan on tasks_task" not in text


# -- configuration surfaces --------------------------------------------------------------------


@pytest.mark.parametrize(
    "rates", [["mail"], {"mail": "14"}, {"mail": "0/s"}, {"mail": (1, -1)}, {"": "1/s"}, {"mail": "1/week"}]
)
def test_malformed_queue_rate_limits_fail_the_system_check(settings: Any, rates: Any) -> None:
    from django.core.management import call_command
    from django.core.management.base import SystemCheckError

    from tasks.checks import check_task_settings

    settings.LEASING_TASKS = {"RATE_LIMITS": rates}
    assert [e.id for e in check_task_settings()] == ["tasks.E110"]
    with pytest.raises(SystemCheckError, match="RATE_LIMITS"):
        call_command("check")


def test_well_formed_queue_rate_limits_pass_the_system_check(settings: Any) -> None:
    from tasks.checks import check_task_settings

    settings.LEASING_TASKS = {"RATE_LIMITS": {"mail": "14/s", "api": (100, 60)}}
    assert check_task_settings() == []


@pytest.mark.parametrize(
    "spec",
    [
        {"a.b": {"key": "k"}},
        {"a.b": {"key": "k", "limit": "14"}},
        {"a.b": {"key": "", "limit": "1/s"}},
        {"a.b": {"key": "k:{0.__class__}", "limit": "1/s"}},
        ["a.b"],
    ],
)
def test_the_backend_check_reports_a_bad_rate_limit_mapping(settings: Any, spec: Any) -> None:
    from tasks.compat import task_backends

    settings.TASKS = {"default": {"BACKEND": "tasks.backends.LeaseBackend", "OPTIONS": {"rate_limits": spec}}}
    assert [e.id for e in task_backends["default"].check()] == ["tasks.E015"]


def test_the_django_tasks_backend_maps_task_paths_to_rate_keys(settings: Any) -> None:
    from tests.conformance.tasks import noop_task

    settings.TASKS = {
        "default": {
            "BACKEND": "tasks.backends.LeaseBackend",
            "OPTIONS": {"rate_limits": {noop_task.module_path: {"key": "noop:{0}", "limit": "5/10s"}}},
        }
    }
    result = noop_task.enqueue(7)
    row = Task.objects.get(pk=int(result.id))
    assert (row.rate_key, row.rate_limit, row.rate_period) == ("noop:7", 5, 10.0)
    with pytest.raises(ValueError, match="rate key template"):
        noop_task.enqueue()
    assert Task.objects.count() == 1


def test_the_api_enqueues_with_a_rate_limit_and_shows_the_keys(task_api: Api) -> None:
    status, body = task_api.enqueue({"task_path": NOOP, "rate_key": "mail", "rate_limit": "14/s"})
    assert status == 201, body
    assert (body["task"]["rate_key"], body["task"]["rate_limit"], body["task"]["rate_refusals"]) == (
        "mail",
        [14, 1.0],
        0,
    )
    status, body = task_api.enqueue({"task_path": NOOP, "rate_key": "api", "rate_limit": [100, 60]})
    assert status == 201 and body["task"]["rate_limit"] == [100, 60.0]
    claimed = Task.objects.claim(W, limit=2, ttl=30)
    for c in claimed:
        start((c.id, c.token))
    status, body = task_api.call("GET", "/api/rate-keys")
    assert status == 200
    assert {k["key"]: (k["limit"], k["starts_in_window"], k["granted"]) for k in body["rate_keys"]} == {
        "mail": ([14, 1.0], 1, 1),
        "api": ([100, 60.0], 1, 1),
    }


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"rate_key": "mail"}, "rate_limit"),
        ({"rate_limit": "1/s"}, "rate_key"),
        ({"rate_key": "mail", "rate_limit": "fast"}, "rate_limit"),
        ({"rate_key": "mail", "rate_limit": "0/s"}, "rate_limit"),
        ({"rate_key": "mail", "rate_limit": [1]}, "rate_limit"),
        ({"rate_key": "mail", "rate_limit": {"count": 1}}, "rate_limit"),
        ({"rate_key": "mail", "rate_limit": "x" * 100_000}, "rate_limit"),
        ({"rate_key": 7, "rate_limit": "1/s"}, "rate_key"),
    ],
)
def test_the_api_refuses_bad_rate_limits_with_400_and_writes_nothing(task_api: Api, extra: Any, field: str) -> None:
    status, body = task_api.enqueue({"task_path": NOOP, **extra})
    assert status == 400, body
    assert body.get("field") == field, body
    assert len(json.dumps(body)) < 1000
    assert not Task.objects.exists()


def test_the_dashboard_and_metrics_show_keys_at_their_limit(client: Any) -> None:
    from django.contrib.auth import get_user_model
    from prometheus_client.parser import text_string_to_metric_families

    for a in enqueue_and_claim(3, key="smtp<1>", limit="2/min"):
        start(a)
    client.force_login(get_user_model().objects.create_superuser("rate", "rate@example.com", "pw"))
    page = client.get("/dashboard/").content.decode()
    assert 'id="rate-keys"' in page
    assert "smtp&lt;1&gt;" in page and "smtp<1>" not in page
    assert "2 / 2 per 60s (at its limit)" in page
    metrics = {
        (sample.name, sample.labels.get("key")): sample.value
        for family in text_string_to_metric_families(client.get("/metrics").content.decode())
        for sample in family.samples
    }
    assert metrics[("tasks_rate_starts_in_window", "smtp<1>")] == 2
    assert metrics[("tasks_rate_limit", "smtp<1>")] == 2
    assert metrics[("tasks_rate_period_seconds", "smtp<1>")] == 60
    assert metrics[("tasks_rate_granted_total", "smtp<1>")] == 2
    assert metrics[("tasks_rate_refused_total", "smtp<1>")] == 1
    assert metrics[("tasks_rate_keys_full", None)] == 1


def test_the_howto_examples_enqueue_as_documented() -> None:
    import re

    from tests.helpers import ROOT

    page = (ROOT / "docs" / "howto" / "rate-limits.md").read_text()
    [block] = re.findall(r"<!-- tested[^>]*-->\n```python\n(.*?)```", page, re.S)
    exec(compile(block, "rate-limits.md", "exec"), {})
    rows = {
        row.task_path: (row.rate_key, row.rate_limit, row.rate_period)
        for row in Task.objects.filter(task_path__in=["mail.tasks.send", "reports.tasks.build"])
    }
    assert rows == {"mail.tasks.send": ("smtp", 14, 1.0), "reports.tasks.build": ("reports", 5, 10.0)}
    assert (
        Task.objects.filter(task_path="crm.tasks.push", rate_key="crm:7", rate_limit=100, rate_period=60).count() == 500
    )


def test_an_api_claim_starts_only_what_the_rate_key_grants(task_api: Api) -> None:
    ids = Task.objects.bulk_enqueue(NOOP, [{}] * 3, rate_key="mail", rate_limit="2/min")
    plain = Task.objects.enqueue(NOOP).id
    status, body = task_api.call("POST", "/api/tasks/next", {"worker": "http-client", "limit": 4})
    assert status == 200, body
    returned = sorted(t["id"] for t in body["tasks"])
    assert len(returned) == 3 and plain in returned
    assert all(t["attempts"] == 1 and t["status"] == "RUNNING" for t in body["tasks"])
    [refused] = set(ids) - set(returned)
    row = Task.objects.get(pk=refused)
    assert (row.status, row.attempts, row.rate_refusals) == (TaskStatus.READY, 0, 1)
    assert RateLimit.objects.get(key="mail").grants == 2


def test_an_api_claim_of_a_queue_with_a_rate_limit_takes_its_starts(task_api: Api, settings: Any) -> None:
    settings.LEASING_TASKS = {**settings.LEASING_TASKS, "RATE_LIMITS": {"mail": "1/min"}}
    Task.objects.bulk_enqueue(NOOP, [{}] * 2, queue="mail")
    plain = Task.objects.enqueue(NOOP).id
    status, body = task_api.call(
        "POST", "/api/tasks/next", {"worker": "http-client", "queues": ["mail", "default"], "limit": 3}
    )
    assert status == 200, body
    assert len(body["tasks"]) == 2 and plain in [t["id"] for t in body["tasks"]]
    assert all(t["attempts"] == 1 for t in body["tasks"])
    assert RateLimit.objects.get(key="queue:mail").grants == 1
    assert Task.objects.filter(queue="mail", status=TaskStatus.READY, rate_refusals=1).count() == 1


@pytest.mark.parametrize("handler", [NOOP, "tests.testapp.handlers.async_double"])
def test_a_worker_runs_a_rate_limited_backlog_at_the_rate_waking_for_its_refused_claims(handler: str) -> None:
    from tasks.models import FINISHED
    from tasks.worker.process import Worker
    from tests.helpers import wait_until, worker_in_thread

    kwargs = {"n": 1} if "async" in handler else {}
    ids = Task.objects.bulk_enqueue(handler, [kwargs] * 12, rate_key="burst", rate_limit=(3, 0.5))
    # A poll interval far longer than the window: the worker must look again when a refused claim
    # comes due, not at its next poll (12 tasks at 3 per 0.5 s take 2 s; polls would take 20 s).
    worker = Worker(
        concurrency=4, ttl=10, poll_interval=5, recovery_interval=0.2, install_signal_handlers=False, worker_id="rw"
    )
    with worker_in_thread(worker):
        wait_until(lambda: Task.objects.filter(pk__in=ids, status__in=FINISHED).count() == 12, 12, what="the backlog")
    rows = list(Task.objects.filter(pk__in=ids))
    assert all(r.status == TaskStatus.SUCCESSFUL and r.attempts == 1 and r.failures == 0 for r in rows)
    starts = sorted(r.last_attempted_at for r in rows if r.last_attempted_at is not None)
    window = dt.timedelta(seconds=0.5)
    assert max(sum(1 for s in starts[i:] if s < at + window) for i, at in enumerate(starts)) <= 3
    assert worker.session.stats["rate_refused"] == sum(r.rate_refusals for r in rows) > 0
    # Every claim counts, the refused ones too: the counter behind tasks_worker_events_total never
    # goes down (Prometheus would read a fall as a restart and its rate() as a burst of claims).
    # (what was handed back, refused or returned unstarted, is kept apart for --max-tasks).
    assert worker.session.stats["claimed"] == 12 + worker.session.handed_back
    assert worker.session.handed_back >= worker.session.stats["rate_refused"]


def test_max_tasks_counts_the_claims_a_worker_kept_not_those_its_rate_key_refused() -> None:
    from tasks.models import FINISHED
    from tasks.worker.process import Worker

    ids = Task.objects.bulk_enqueue(NOOP, [{}] * 9, rate_key="capped", rate_limit=(2, 0.3))
    worker = Worker(
        concurrency=4, ttl=10, poll_interval=5, max_tasks=5, install_signal_handlers=False, worker_id="capped"
    )
    worker.run()  # returns once 5 attempts ended
    assert worker.session.stats["rate_refused"] > 0
    assert worker.session.stats["claimed"] == 5 + worker.session.handed_back
    assert worker.session.handed_back >= worker.session.stats["rate_refused"]
    assert Task.objects.filter(pk__in=ids, status__in=FINISHED).count() == 5
    assert Task.objects.filter(pk__in=ids, status=TaskStatus.READY).count() == 4


def test_workflow_members_and_dependants_carry_their_rate_keys(settings: Any) -> None:
    from tasks.workflows import chain, step
    from tests.conformance.tasks import noop_task

    settings.TASKS = {
        "default": {
            "BACKEND": "tasks.backends.LeaseBackend",
            "OPTIONS": {"rate_limits": {noop_task.module_path: {"key": "noop:{0}", "limit": "3/s"}}},
        }
    }
    chain(
        step(NOOP, pipe=1).options(rate_key="mail", rate_limit="14/s"), step(noop_task, 5), step(NOOP), pipe=False
    ).enqueue()
    rows = list(Task.objects.order_by("id").values_list("rate_key", "rate_limit", "rate_period"))
    assert rows == [("mail", 14, 1.0), ("noop:5", 3, 1.0), (None, None, None)]
    parent = Task.objects.order_by("id").first()
    assert parent is not None
    child = Task.objects.enqueue(NOOP, depends_on=[parent.id], rate_key="crm", rate_limit=(100, 60))
    assert Task.objects.filter(pk=child.id).values_list("rate_key", "rate_limit", "rate_period").get() == (
        "crm",
        100,
        60.0,
    )
    with pytest.raises(ValueError, match="rate limit"):
        chain(step(NOOP).options(rate_key="mail", rate_limit="fast"), step(NOOP)).enqueue()
    assert Task.objects.count() == 4


def test_a_dead_workers_claims_that_never_started_took_nothing_and_its_starts_leave_with_the_window() -> None:
    attempts = enqueue_and_claim(3, limit=(2, 0.3))
    granted = start(attempts[0])  # started, then the worker dies with it and the two unstarted claims
    assert isinstance(granted, Started)
    with connection.cursor() as cursor:
        cursor.execute("UPDATE tasks_task SET expires_at = clock_timestamp() - interval '1 second'")
    recovered = Task.objects.recover_expired()
    assert sorted(r.kind for r in recovered) == ["returned", "returned", "vanished"]
    key = RateLimit.objects.get(key="mail")
    assert (key.grants, key.refusals, len(key.starts)) == (1, 0, 1)  # the unstarted claims took nothing
    # The dead worker's start still counts until it leaves the window: one more start fits now, not two.
    again = sorted(Task.objects.claim("w2", limit=3, ttl=30), key=lambda c: c.id)
    results = [Task.objects.rate_start(c.id, "w2", c.token) for c in again]
    assert [isinstance(r, Started) for r in results] == [True, False, False]
    # Then it leaves the window: the first refused one, back at its reserved time (when the dead
    # worker's start leaves), is granted.
    first = results[1]
    assert isinstance(first, RateRefused)
    assert first.run_after == granted.last_attempted_at + dt.timedelta(seconds=0.3)
    while db_now() < first.run_after:
        pass
    [back] = Task.objects.claim("w2", limit=1, ttl=30)
    assert back.id == first.id
    assert isinstance(Task.objects.rate_start(back.id, "w2", back.token), Started)
