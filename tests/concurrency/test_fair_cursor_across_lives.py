"""A fair queue's turns across real ``run_worker`` lives (``--max-tasks`` recycling), with
the shared cursor (tasks_faircursor) in between: through PgBouncer in transaction pooling, in a second
database (LEASING_TASKS["QUEUE_DATABASES"]), with the cursor on a key that has no rows any more or
past the last key, and with the queue made plain and fair again between lives.

Each life claims one batch of 4 and exits cleanly (its flush writes where its turns went): the next
life must deal on from the keys after it, never from the first key again, never skipping one.


Found by breaker 34 (the bug hunt on the shared fair cursor)."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest
from django.db import connection, connections

from tasks.models import FairCursor, Task
from tests.helpers.pgbouncer import Bouncer
from tests.helpers.task_paths import NOOP
from tests.helpers.workers import Workers

pytestmark = [pytest.mark.slow, pytest.mark.one_stack]

QUEUE = "fair34lives"
KEYS = [f"t{n:02d}" for n in range(12)]
CLAIM = 4
ARGS = ("--queues", QUEUE, "--concurrency", str(CLAIM), "--batch-size", str(CLAIM), "--no-scheduler")
#: A worker hands back at once what it claimed but expects no slot to start within PREFETCH_WINDOW
#: (0.25 s, judged by how fast its slots free): on a loaded machine a claim of 0.2 s tasks went back,
#: its keys passed over for a RESCAN_INTERVAL, by speed alone. These workers keep what they claim.
KEEP_CLAIMS = json.dumps({"PREFETCH_WINDOW": 60})
FAIR: dict[str, Any] = {"LEASING_TEST_FAIR_QUEUES": QUEUE, "LEASING_TEST_TASKS": KEEP_CLAIMS}


def enqueue(using: str = "default", per_key: int = 3) -> None:
    for key in KEYS:
        Task.objects.db_manager(using).bulk_enqueue(NOOP, [{}] * per_key, queue=QUEUE, fair_key=key)


def started(using: str = "default") -> Counter[str]:
    rows = Task.objects.using(using).filter(queue=QUEUE, started_at__isnull=False)
    return Counter(key or "" for key in rows.values_list("fair_key", flat=True))


def cursor(using: str = "default") -> str | None:
    return FairCursor.objects.using(using).filter(queue=QUEUE).values_list("fair_after", flat=True).first()


def life(
    workers: Workers, name: str, using: str = "default", *, fair: bool = True, env: dict[str, str] | None = None
) -> list[str]:
    """One worker life of one claim; the keys it started, in order."""
    before = started(using)
    env = dict(env or {})
    if fair:
        env["LEASING_TEST_FAIR_QUEUES"] = QUEUE
    env.setdefault("LEASING_TEST_TASKS", KEEP_CLAIMS)
    extra = ("--database", using) if using != "default" else ()
    proc = workers.start(name, *ARGS, *extra, "--max-tasks", str(CLAIM), may_die=True, **env)
    proc.wait(60)
    assert proc.returncode == 0, workers.log(name)
    return sorted((started(using) - before).elements())


def next_keys(after: str | None) -> list[str]:
    start = 0 if after is None else next((i for i, k in enumerate(KEYS) if k > after), 0)
    return [KEYS[(start + i) % len(KEYS)] for i in range(CLAIM)]


@pytest.mark.django_db(transaction=True)
def test_lives_through_pgbouncer_deal_on_from_each_others_cursor(bouncer_pool_of_2: Bouncer, workers: Workers) -> None:
    enqueue()
    pooled: dict[str, str] = {
        "DATABASE_URL": bouncer_pool_of_2.url(connection.settings_dict["NAME"]),
        "DATABASE_POOLED": "true",
    }
    expected_after: str | None = None
    for n in range(6):  # two laps; every other life direct, the rest through the pooler
        env: dict[str, str] = pooled if n % 2 == 0 else {}
        keys = life(workers, f"life-{n}", env=env)
        assert keys == next_keys(expected_after), (n, keys, expected_after)
        expected_after = keys[-1]
        assert cursor() == keys[-1], (n, cursor())
    # nothing the workers set on the pooler's server connections outlives their transactions
    with connections["default"].cursor() as c:
        c.execute("SELECT 1")
    import psycopg

    with psycopg.connect(bouncer_pool_of_2.conninfo(connection.settings_dict["NAME"]), autocommit=True) as raw:
        for _ in range(4):
            settings_seen = raw.execute("SELECT current_setting('lock_timeout'), current_setting('statement_timeout')")
            assert settings_seen.fetchone() == ("0", "0")


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(("stored", "first"), [("t05", "t06"), ("zzz", "t00"), ("", "t00")])
def test_a_cursor_on_a_key_without_rows_deals_on_from_the_next_one(workers: Workers, stored: str, first: str) -> None:
    """t05 has no rows left (all done and pruned); "zzz" is past every key; "" is the shared key of
    keyless rows, none of which is due."""
    enqueue()
    Task.objects.filter(queue=QUEUE, fair_key="t05").delete()
    FairCursor.objects.create(queue=QUEUE, fair_after=stored, updated_at="2026-01-01T00:00:00Z")
    keys = life(workers, "after-gone")
    want = [k for k in KEYS if k != "t05"]
    start = want.index(first)
    assert keys == sorted(want[start : start + CLAIM]), keys
    assert cursor() == want[start + CLAIM - 1]


@pytest.mark.django_db(transaction=True)
def test_a_queue_made_plain_and_fair_again_between_lives(workers: Workers) -> None:
    enqueue()
    assert life(workers, "fair-1") == ["t00", "t01", "t02", "t03"]
    assert cursor() == "t03"
    plain = life(workers, "plain", fair=False)
    assert len(plain) == CLAIM and cursor() == "t03"  # a plain life leaves the cursor alone
    assert life(workers, "fair-2") == ["t04", "t05", "t06", "t07"]
    assert cursor() == "t07"


@pytest.mark.django_db(databases=["default", "second"], transaction=True)
def test_lives_of_a_fair_queue_in_a_second_database(settings: Any, workers: Workers) -> None:
    routes = {QUEUE: "second"}
    settings.LEASING_TASKS = {"QUEUE_DATABASES": routes, "FAIR_QUEUES": [QUEUE]}
    env = {
        "LEASING_TEST_SECOND_DATABASE": connections["second"].settings_dict["NAME"],
        "LEASING_TEST_QUEUE_DATABASES": json.dumps(routes),
    }
    enqueue("second")
    assert life(workers, "second-1", "second", env=env) == ["t00", "t01", "t02", "t03"]
    assert cursor("second") == "t03" and cursor("default") is None
    assert life(workers, "second-2", "second", env=env) == ["t04", "t05", "t06", "t07"]
    assert cursor("second") == "t07" and cursor("default") is None


@pytest.mark.django_db(transaction=True)
def test_a_life_of_several_claims_within_the_interval_leaves_its_last_turn(workers: Workers) -> None:
    """Three claims inside one second: the first move is written at once, the next two only by the
    flush at the clean stop that --max-tasks makes."""
    enqueue()
    proc = workers.start("three", *ARGS, "--max-tasks", "12", may_die=True, **FAIR)
    proc.wait(60)
    assert proc.returncode == 0, workers.log("three")
    assert sorted(started().elements()) == KEYS and cursor() == "t11"
    assert life(workers, "after-three") == ["t00", "t01", "t02", "t03"]


@pytest.mark.django_db(transaction=True)
def test_a_life_stopped_by_sigterm_mid_stream_leaves_its_last_turn(workers: Workers) -> None:
    """A life SIGTERMed two claims in: the next life deals on from the key after the last turn the
    first life started. Two ways it did not (stop 61): a claim an executor returned unstarted before
    the drain (no free slot of its kind) was never rewound, so its keys went without a turn for a
    lap; and a stop inside a claim rewound to the claim's start, so its turns that had started were
    dealt again. Both showed in one run of several, more often with forked (faster-starting) workers."""
    many = [f"k{n:02d}" for n in range(40)]
    for key in many:
        Task.objects.bulk_enqueue("tests.testapp.handlers.work", [{"seconds": 0.2}] * 2, queue=QUEUE, fair_key=key)
    proc = workers.start("drained", *ARGS, **FAIR)
    from tests.helpers import wait_until

    wait_until(lambda: sum(started().values()) >= 8, 60, what="two claims started")
    proc.send_signal(15)
    proc.wait(30)
    assert proc.returncode == 0, workers.log("drained")
    served = started()
    last = max(served)
    assert len(served) < len(many) and all(v == 1 for v in served.values()), served
    stored = cursor()
    touched = list(
        Task.objects.filter(queue=QUEUE)
        .exclude(status="READY", attempts=0, worker_ids=[])
        .order_by("fair_key", "pk")
        .values_list("fair_key", "status", "attempts", "worker_ids")
    )
    proc = workers.start("next", *ARGS, "--max-tasks", str(CLAIM), may_die=True, **FAIR)
    proc.wait(60)
    after = started() - served
    at = many.index(last)
    assert sorted(after.elements()) == many[at + 1 : at + 1 + CLAIM], (
        f"the first life started {sorted(served)} and left the cursor at {stored!r}; the next life started "
        f"{sorted(after)}: the tenants after {last} with due tasks were passed over for a lap; rows touched: {touched}"
    )


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("stop", ["sigterm", "max-tasks"])
def test_tenants_get_turns_when_workers_are_stopped_cleanly_again_and_again(workers: Workers, stop: str) -> None:
    """A rolling deploy: each life is SIGTERMed once it has started two claims' worth. A life claims
    ahead of its slots, hands the unstarted claims back at its drain, and flushes a cursor past them,
    so the next life starts beyond tenants that got no start. After starts enough for two laps of
    the keys, every tenant must have started a task (the breaker 33 promise, across clean stops)."""
    many = [f"k{n:02d}" for n in range(40)]
    for key in many:
        Task.objects.bulk_enqueue("tests.testapp.handlers.work", [{"seconds": 0.2}] * 4, queue=QUEUE, fair_key=key)
    from tests.helpers import wait_until

    lives = 0
    while sum(started().values()) < 2 * len(many) and lives < 30:
        before = sum(started().values())
        recycle = ("--max-tasks", str(2 * CLAIM)) if stop == "max-tasks" else ()
        proc = workers.start(f"deploy-{lives}", *ARGS, *recycle, may_die=True, **FAIR)
        wait_until(lambda: sum(started().values()) >= before + 2 * CLAIM, 60, what="two claims started")  # noqa: B023
        if stop == "sigterm":
            proc.send_signal(15)
        proc.wait(30)
        lives += 1
    starts = started()
    starved = [key for key in many if starts[key] == 0]
    assert not starved, (
        f"{len(starved)} of {len(many)} tenants never started a task in {lives} lives "
        f"({sum(starts.values())} starts): {starved}"
    )
