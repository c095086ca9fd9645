"""Fair queues (LEASING_TASKS["FAIR_QUEUES"]): a claim takes turns between the keys (tenants) of the
queue instead of draining the oldest key first (tasks/lifecycle/statements.py, ``_PICK_FAIR``)."""

from __future__ import annotations

import datetime as dt
from collections import Counter
from typing import Any

import pytest
from django.db import connection, connections, transaction

from tasks.lifecycle.values import ClaimedTask, fair_after_claim
from tasks.models import Task
from tests.helpers.task_paths import NOOP

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("fair_queues")]


class Claimer:
    """Claims as the dispatcher does: each claim's turns start after the last key the one before served."""

    def __init__(self, name: str = "w", queue: str = "fair") -> None:
        self.name, self.queue = name, queue
        self.after: str | None = None

    def claim(self, limit: int) -> list[ClaimedTask]:
        claimed = Task.objects.claim(self.name, limit=limit, queues=[self.queue], fair_after=self.after)
        self.after = fair_after_claim(claimed, self.after)
        return claimed


def keys(claimed: list[ClaimedTask]) -> Counter[str]:
    return Counter(c.fair_key or "(none)" for c in claimed)


def test_a_claim_interleaves_the_keys_instead_of_draining_the_oldest_first() -> None:
    Task.objects.bulk_enqueue(NOOP, [{}] * 200, queue="fair", fair_key="big")
    small = Task.objects.bulk_enqueue(NOOP, [{}] * 10, queue="fair", fair_key="small")
    claimed = Claimer().claim(10)
    assert keys(claimed) == {"big": 5, "small": 5}
    # each key's own tasks in their order
    assert sorted(c.id for c in claimed if c.fair_key == "small") == small[:5]


def test_the_turns_rotate_over_many_keys() -> None:
    for k in range(30):
        Task.objects.bulk_enqueue(NOOP, [{}] * 3, queue="fair", fair_key=f"tenant-{k:02}")
    claimer = Claimer()
    served: list[str] = []
    for _ in range(3):
        claimed = claimer.claim(10)
        assert len(claimed) == 10 and len(keys(claimed)) == 10  # one each, ten keys per claim
        served += sorted(keys(claimed))
    assert served == [f"tenant-{k:02}" for k in range(30)]  # every key once before any twice
    claimed = claimer.claim(10)
    assert sorted(keys(claimed)) == [f"tenant-{k:02}" for k in range(10)]  # wrapped around


def test_a_lone_key_fills_the_claim_and_rows_without_a_key_are_taken() -> None:
    ids = Task.objects.bulk_enqueue(NOOP, [{}] * 20, queue="fair", fair_key="only")
    assert [c.id for c in Claimer().claim(8)] == ids[:8]
    Task.objects.filter(pk__in=ids).delete()
    # rows of the queue from before it was fair (no key): the fill takes them in the plain order
    Task.objects.bulk_enqueue(NOOP, [{}] * 3, queue="fair", fair_key="k")
    with connection.cursor() as cursor:
        cursor.execute("UPDATE tasks_task SET fair_key = NULL WHERE id = (SELECT max(id) FROM tasks_task)")
    assert len(Claimer().claim(10)) == 3


def test_a_task_of_a_fair_queue_without_a_key_gets_the_shared_key() -> None:
    task = Task.objects.enqueue(NOOP, queue="fair")
    plain = Task.objects.enqueue(NOOP, queue="plain")
    assert Task.objects.get(pk=task.id).fair_key == ""
    assert Task.objects.get(pk=plain.id).fair_key is None


def test_priorities_order_a_keys_own_tasks_not_the_turns() -> None:
    low = Task.objects.bulk_enqueue(NOOP, [{}] * 4, queue="fair", fair_key="a", priority=0)
    high = Task.objects.bulk_enqueue(NOOP, [{}] * 4, queue="fair", fair_key="a", priority=9)
    other = Task.objects.bulk_enqueue(NOOP, [{}] * 4, queue="fair", fair_key="b", priority=-5)
    claimed = Claimer().claim(4)
    assert sorted(c.id for c in claimed) == sorted(high[:2] + other[:2])
    # three each: a gives its last high ones, then its low ones; b has two left; the fill takes the
    # next in the plain order (low[2]: priority 0 before b's -5, which the claim already took)
    claimed = Task.objects.claim("w", limit=6, queues=["fair"])
    assert sorted(c.id for c in claimed) == sorted(high[2:] + low[:1] + other[2:] + low[1:2])


def test_deferred_rows_are_not_taken_early() -> None:
    later = dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=1)
    Task.objects.bulk_enqueue(NOOP, [{}] * 5, queue="fair", fair_key="a", run_after=later)
    Task.objects.bulk_enqueue(NOOP, [{}] * 5, queue="fair", fair_key="b", run_after=later, priority=5)
    due = Task.objects.bulk_enqueue(NOOP, [{}] * 2, queue="fair", fair_key="b")
    assert sorted(c.id for c in Claimer().claim(10)) == due


def test_a_paused_fair_queue_gives_nothing() -> None:
    from tasks.models import QueueControl

    Task.objects.bulk_enqueue(NOOP, [{}] * 5, queue="fair", fair_key="a")
    QueueControl.objects.create(name="fair", paused=True)
    assert Claimer().claim(10) == []


@pytest.mark.django_db(transaction=True)
def test_two_claimers_on_separate_connections_skip_each_others_rows() -> None:
    Task.objects.bulk_enqueue(NOOP, [{}] * 20, queue="fair", fair_key="a")
    Task.objects.bulk_enqueue(NOOP, [{}] * 20, queue="fair", fair_key="b")
    other = connections.create_connection("default")
    try:
        with transaction.atomic():
            mine = Claimer("w1").claim(6)  # locked until this transaction commits
            with other.cursor() as cursor:
                from tasks.lifecycle import statements as sql

                params = {
                    "worker": "w2",
                    "ttl": 30.0,
                    "limit": 6,
                    "start": False,
                    "isolate_after": 2,
                    **sql.claim_params(["fair"], busy=False, isolate_after=2),
                }
                cursor.execute(sql.FAIR_CLAIM_SQL, params)
                theirs = [row[0] for row in cursor.fetchall()]
            other.commit()
    finally:
        other.close()
    assert len(mine) == 6 and len(theirs) == 6
    assert not {c.id for c in mine} & set(theirs)


FAIR_ROWS_SQL = """
INSERT INTO tasks_task (queue, priority, task_path, args, kwargs, status, run_after, enqueued_at, finished_at,
    attempts, max_attempts, errors, worker_ids, renewals, transitions, failures, crashes, shared_crashes,
    unstarted_returns, attempt_started, attempt_isolated, fair_key)
SELECT %(queue)s, 0, %(path)s, '[]', '{}', %(status)s, now() - interval '1 minute', now(),
       CASE WHEN %(status)s = 'SUCCESSFUL' THEN now() END, 0, 3, '[]', '[]', 0, 0, 0, 0, 0, 0, false, false,
       'tenant-' || lpad((g %% %(keys)s)::text, 5, '0')
FROM generate_series(1, %(n)s) AS g
"""


def _fair_claim_blocks(queue: str, after: str | None) -> tuple[int, int]:
    """Blocks a fair claim of 10 touches (run under EXPLAIN (ANALYZE, BUFFERS), rolled back: the
    second of two runs, as in a running system), and the rows it claims."""
    from tasks.lifecycle import statements as sql

    params = {
        "worker": "plan",
        "ttl": 30.0,
        "limit": 10,
        "start": False,
        "isolate_after": 2,
        **sql.claim_params([queue], busy=False, isolate_after=2, fair_after=after),
    }
    for _ in range(2):
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sql.FAIR_CLAIM_SQL, params)
            plan = cursor.fetchone()[0][0]["Plan"]
            transaction.set_rollback(True)
    # the pick: the ARRAY(...) InitPlan of the UPDATE, whose reading runs the CTEs it reads (the walk,
    # the keys' turns, the levels: InitPlans too, whose counts are part of its); the rest is the
    # update of the 10 rows claimed and the cursor read from the walk already run
    picks = [node for node in plan["Plans"] if node.get("Parent Relationship") == "InitPlan"]
    return max(node["Shared Hit Blocks"] + node["Shared Read Blocks"] for node in picks), plan["Actual Rows"]


def test_a_fair_claims_reads_do_not_grow_with_keys_or_rows() -> None:
    """A claim of 10 over 10 keys of 100 tasks, then beside 100,000 tasks over 1,000 keys and
    100,000 finished ones: about the same blocks (its walk visits at most 10 keys, one probe each,
    and each key gives its first rows)."""
    with connection.cursor() as cursor:
        cursor.execute(FAIR_ROWS_SQL, {"queue": "few", "path": NOOP, "status": "READY", "keys": 10, "n": 1000})
        cursor.execute("ANALYZE tasks_task")
    small = [_fair_claim_blocks("few", after) for after in (None, "tenant-00004", "tenant-00009")]
    with connection.cursor() as cursor:
        for status in ("READY", "SUCCESSFUL"):
            cursor.execute(FAIR_ROWS_SQL, {"queue": "many", "path": NOOP, "status": status, "keys": 1000, "n": 100_000})
        cursor.execute("ANALYZE tasks_task")
    large = [_fair_claim_blocks("many", after) for after in (None, "tenant-00500", "tenant-00995")]
    assert all(rows == 10 for _blocks, rows in small + large), (small, large)
    worst_small = max(blocks for blocks, _rows in small)
    worst_large = max(blocks for blocks, _rows in large)
    assert worst_large < 1.5 * worst_small + 20, (small, large)
    assert worst_large < 200, large  # a few blocks per key visited (its walk probe, its level probe, its scan)


@pytest.mark.django_db(transaction=True)
def test_a_worker_goes_round_the_keys_rather_than_starting_from_the_first_each_claim() -> None:
    """The dispatcher passes the last key it served (its rotating cursor) to its next claim: with 50
    keys and claims of at most 10, the first 50 starts cover (nearly) every key. Starting each claim
    from the first key, they would cover the first few keys over and over."""
    from tasks.worker.process import Worker
    from tests.helpers import wait_until, worker_in_thread

    for k in range(50):
        Task.objects.bulk_enqueue(NOOP, [{}] * 6, queue="fair", fair_key=f"tenant-{k:02}")
    worker = Worker(queues=["fair"], concurrency=2, batch_size=10, install_signal_handlers=False, worker_id="rr")
    with worker_in_thread(worker):
        wait_until(lambda: Task.objects.filter(queue="fair", status="SUCCESSFUL").count() >= 100, 30, what="100 done")
    started = Task.objects.filter(queue="fair", started_at__isnull=False).order_by("started_at", "id")
    first = list(started.values_list("fair_key", flat=True)[:50])
    assert len(set(first)) >= 45, Counter(first)


class FinishClaimer(Claimer):
    """Claims as the dispatcher's usual round does: through the finish-and-claim statement."""

    def claim(self, limit: int) -> list[ClaimedTask]:
        _finished, _started, claimed = Task.objects.finish_start_claim(
            self.name, [], limit=limit, queues=[self.queue], fair_after=self.after
        )
        self.after = fair_after_claim(claimed, self.after)
        return claimed


@pytest.mark.parametrize("claimer", [Claimer, FinishClaimer])
@pytest.mark.parametrize("limit", [1, 2])
def test_a_key_with_nothing_due_passes_its_turn_on_instead_of_sending_it_back_to_the_oldest_key(
    claimer: type[Claimer], limit: int
) -> None:
    """Breaker 32's starvation: keys a (due, oldest), b (READY, nothing due), c (due). The claim that
    visits b fills from the plain pick (a's oldest rows); the next turn must start after b, not
    after a again, or c is never served."""
    later = dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=1)
    Task.objects.bulk_enqueue(NOOP, [{}] * 50, queue="fair", fair_key="a")
    Task.objects.bulk_enqueue(NOOP, [{}] * 5, queue="fair", fair_key="b", run_after=later)
    Task.objects.bulk_enqueue(NOOP, [{}] * 5, queue="fair", fair_key="c")
    served: Counter[str] = Counter()
    claim = claimer()
    for _ in range(6):
        served += keys(claim.claim(limit))
    assert served["c"] >= 2 * limit, served
    assert "b" not in served


@pytest.mark.parametrize("claimer", [Claimer, FinishClaimer])
@pytest.mark.parametrize(("tenants", "limit"), [(5, 4), (5, 3), (3, 2), (7, 10), (4, 6)])
def test_equal_keys_get_equal_shares_when_the_walk_wraps_around(
    claimer: type[Claimer], tenants: int, limit: int
) -> None:
    """Breaker 32's wrap-around: five equal tenants claimed four at a time were served 50/50/50/25/25.
    Claim after claim, every key's count stays within one of every other's."""
    names = [f"tenant-{k}" for k in range(tenants)]
    for name in names:
        Task.objects.bulk_enqueue(NOOP, [{}] * 40, queue="fair", fair_key=name)
    claim = claimer()
    served: Counter[str] = Counter({name: 0 for name in names})
    for n in range(12):
        claimed = claim.claim(limit)
        assert len(claimed) == limit
        served += keys(claimed)
        assert max(served.values()) - min(served[name] for name in names) <= 1, (n, served)


def _deferred_keys(n: int, *, prefix: str = "d-") -> None:
    """``n`` keys whose one READY row each is deferred an hour (tenants with only snoozed or
    scheduled tasks), inserted in one statement."""
    deferred = FAIR_ROWS_SQL.replace("now() - interval '1 minute'", "now() + interval '1 hour'")
    with connection.cursor() as cursor:
        cursor.execute(
            deferred.replace("'tenant-' ||", "%(prefix)s ||"),
            {"queue": "fair", "path": NOOP, "status": "READY", "keys": n, "n": n, "prefix": prefix},
        )


@pytest.mark.parametrize("claimer", [Claimer, FinishClaimer])
def test_keys_with_nothing_due_take_no_turn(claimer: type[Claimer]) -> None:
    """Breaker 33: a backlog key, 30 keys with nothing due, then three keys with due rows. Each claim
    of 4 gives the four keys with due rows one turn each; a walk that gave the deferred keys their
    turns spent them on keys a-big, d-…, d-…, d-…, and the fill gave the room to a-big's backlog."""
    Task.objects.bulk_enqueue(NOOP, [{}] * 100, queue="fair", fair_key="a-big")
    _deferred_keys(30)
    for k in range(3):
        Task.objects.bulk_enqueue(NOOP, [{}] * 5, queue="fair", fair_key=f"s-{k}")
    claim = claimer()
    for _ in range(4):
        assert keys(claim.claim(4)) == {"a-big": 1, "s-0": 1, "s-1": 1, "s-2": 1}


@pytest.mark.parametrize("claimer", [Claimer, FinishClaimer])
def test_keys_with_due_rows_are_reached_behind_more_keys_with_nothing_due_than_a_walk_visits(
    claimer: type[Claimer],
) -> None:
    """1,000 keys with nothing due between a backlog key and three keys with due rows: more than a
    claim's walk visits (statements.py, _WALK_KEYS: 40 for a claim of 2). The walk stops at its
    bound, the cursor moves past the keys it passed over, and the next claims go on from there: the
    three are served within a lap of about 1,000 / 40 claims (a walk of 2 keys a claim, giving the
    keys with nothing due their turns, took 500), and the walk keeps going round."""
    from tasks.lifecycle import statements as sql

    Task.objects.bulk_enqueue(NOOP, [{}] * 200, queue="fair", fair_key="a-big")
    _deferred_keys(1000)
    for k in range(3):
        Task.objects.bulk_enqueue(NOOP, [{}] * 5, queue="fair", fair_key=f"s-{k}")
    walk = 2 * sql.FAIR_WALK_KEYS_PER_TURN + sql.FAIR_WALK_KEYS_EXTRA
    # claims whose walks cover every key once: 1,004 keys, ``walk`` a claim, and the claims whose walk
    # stops early at 2 keys with due rows (s-0 and s-1; s-2 and a-big)
    lap = -(-1004 // walk) + 2
    claim = claimer()
    served: Counter[str] = Counter()
    for _ in range(lap):
        claimed = claim.claim(2)
        assert len(claimed) == 2  # never short: the fill takes a-big's rows when the walk found none
        served += keys(claimed)
    assert all(served[f"s-{k}"] >= 1 for k in range(3)), served
    for _ in range(lap):
        served += keys(claim.claim(2))
    assert all(served[f"s-{k}"] >= 2 for k in range(3)), served  # and again the next lap


def test_a_claim_passing_over_100000_keys_with_nothing_due_reads_a_bounded_walk() -> None:
    """A claim of 10 whose walk starts among 100,000 keys with nothing due: it visits at most
    FAIR_WALK_KEYS_PER_TURN * 10 + FAIR_WALK_KEYS_EXTRA keys (two probes each: the key's entry, the
    level below it), and reads about what it reads among 1,000 such keys; the fill gives the claim
    its 10 rows (a key with due rows sorts after them)."""
    _deferred_keys(1000, prefix="d-")
    Task.objects.bulk_enqueue(NOOP, [{}] * 20, queue="fair", fair_key="z-due")
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE tasks_task")
    few = [_fair_claim_blocks("fair", after) for after in (None, "d-00500")]
    _deferred_keys(100_000, prefix="e-")
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE tasks_task")
    many = [_fair_claim_blocks("fair", after) for after in ("d-00999", "e-50000")]
    assert all(rows == 10 for _blocks, rows in few + many), (few, many)
    worst_few = max(blocks for blocks, _rows in few)
    worst_many = max(blocks for blocks, _rows in many)
    assert worst_many < 1.5 * worst_few + 20, (few, many)
    assert worst_many < 800, many  # 72 keys of a few blocks each (100,000 keys: about 600,000)


def test_a_keys_deferred_higher_priority_rows_are_not_read_to_reach_its_due_ones() -> None:
    """Breaker 32's cost finding: a key whose 20,000 priority-5 rows are deferred, in front of its
    due priority-0 ones. Its turn walks its own priorities (one probe per level), so the claim reads
    about what it reads when the same deferred rows sit behind (priority -5); a range scan over the
    key stepped over every one of them (about 130 more blocks on PostgreSQL 15; 18's skip scan steps
    over them by itself)."""
    deferred = FAIR_ROWS_SQL.replace("now() - interval '1 minute'", "now() + interval '1 hour'")
    with connection.cursor() as cursor:
        for queue, priority in (("behind", -5), ("front", 5)):
            cursor.execute(FAIR_ROWS_SQL, {"queue": queue, "path": NOOP, "status": "READY", "keys": 10, "n": 1000})
            cursor.execute(
                deferred.replace("SELECT %(queue)s, 0,", f"SELECT %(queue)s, {priority},"),
                {"queue": queue, "path": NOOP, "status": "READY", "keys": 1, "n": 20_000},
            )
        cursor.execute("ANALYZE tasks_task")
    behind, rows = _fair_claim_blocks("behind", None)
    assert rows == 10
    front, rows = _fair_claim_blocks("front", None)
    assert rows == 10
    assert front < behind + 20, (behind, front)


# sha256 of the plain claim statements (CLAIM_SQL, FINISH_AND_CLAIM_SQL, FINISH_START_CLAIM_SQL, both
# forms each, joined by newlines) as they were before fair queues' fixes: a change to them must be
# deliberate (their plans are pinned by tests/db/test_claim_plans.py), never a side effect of the
# fair forms. Changed once since, deliberately: the claim's suspect column named, and the round's
# ``handing`` CTE (issue 38: what the worker hands to its executors, named on its row); the round's
# finish and start name their rows' ids on the table's side (issue 59: ``owned()``, a generic plan made
# on a small table read the whole primary key).
PLAIN_CLAIMS_SHA256 = "9a0ad5d01b544740b8e8689319cfd187b974aa637dcf21949d8e563bbbc1326c"


def test_plain_queues_send_the_plain_statements_byte_for_byte(monkeypatch: pytest.MonkeyPatch) -> None:
    import hashlib

    from tasks.lifecycle import prepared
    from tasks.lifecycle import statements as sql

    text = "\n".join([*sql.CLAIM_SQL, *sql.FINISH_AND_CLAIM_SQL, *sql.FINISH_START_CLAIM_SQL])
    assert hashlib.sha256(text.encode()).hexdigest() == PLAIN_CLAIMS_SHA256
    assert "fair" not in text
    Task.objects.bulk_enqueue(NOOP, [{}] * 4, queue="plain")
    Task.objects.bulk_enqueue(NOOP, [{}] * 4, queue="fair", fair_key="a")
    sent: list[str] = []
    rows = prepared.rows

    def recorded(conn: Any, statement: str, params: dict[str, Any]) -> Any:
        sent.append(statement)  # the statement still runs: the claims below really claim
        return rows(conn, statement, params)

    monkeypatch.setattr(prepared, "rows", recorded)
    Task.objects.claim("w", limit=1, queues=["plain"])
    Task.objects.claim("w", limit=1, queues=["fair", "plain"])  # several queues: the plain order
    Task.objects.finish_start_claim("w", [], limit=1, queues=["plain"])
    Task.objects.finish_start_claim("w", [], [(0, 0, None)], limit=1, queues=["plain"])
    Task.objects.claim("w", limit=1, queues=["fair"])
    assert sent == [
        sql.CLAIM_SQL[0],
        sql.CLAIM_SQL[1],
        sql.FINISH_AND_CLAIM_SQL[0],
        sql.FINISH_START_CLAIM_SQL[0],
        sql.FAIR_CLAIM_SQL,
    ]
