"""The claim and round statements under a generic plan (issues 55 and 59).

A worker sends its claim and round statements prepared (tasks/lifecycle/prepared.py). Left to itself
PostgreSQL plans them again on every run (its custom plans looked cheaper than the generic one):
6-8 ms of planning per round for 1-7 ms of execution, on every idle poll too. They are now run with
``plan_cache_mode = force_generic_plan`` (local to their transaction): planned once per connection.
That is only right if the one plan made without the parameters' values is as bounded as the custom
ones. Here each statement is prepared, executed under its generic plan beside 100,000 READY rows of
another queue and 100,000 deferred higher-priority rows of its own (EXPLAIN ANALYZE, rolled back),
and must claim the two due rows and finish the two held ones without reading the backlogs: no
sequential scan of tasks_task, and a bounded number of blocks (a scan of either backlog is thousands).

Each plan is checked twice: made on the empty table (as a quiet hour leaves it: vacuumed, its indexes
as large as the last burst made them) and kept while the backlogs arrive (a worker's
connection makes its plans at its first round: on a fresh install, a truncated table or in a quiet
hour, they were a sequential scan or a hash join over the whole primary key, kept until autovacuum's
ANALYZE: bench/sustained.py), and made again once the table has statistics."""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.db import connection, transaction

from tasks.lifecycle import statements as sql
from tasks.lifecycle.prepared import GENERIC_PLAN, GENERIC_PLAN_SETTINGS
from tasks.models import Task
from tests.helpers.task_paths import NOOP

pytestmark = pytest.mark.django_db(transaction=True)

FILL_SQL = """
INSERT INTO tasks_task (queue, priority, task_path, args, kwargs, status, run_after, enqueued_at,
    attempts, max_attempts, errors, worker_ids, renewals, transitions, failures, crashes,
    shared_crashes, unstarted_returns, attempt_started, attempt_isolated)
SELECT CASE WHEN g %% 2 = 0 THEN 'generic-bulk' ELSE %(queue)s END, CASE WHEN g %% 2 = 0 THEN 5 ELSE 10 END,
       %(path)s, '[]', '{}', 'READY', CASE WHEN g %% 2 = 0 THEN now() ELSE now() + interval '1 day' END, now(),
       0, 3, '[]', '[]', 0, 0, 0, 0, 0, 0, false, false
FROM generate_series(1, %(rows)s) AS g
"""

STATEMENTS = {
    "claim one queue": (sql.CLAIM_SQL[0], False),
    "claim several queues": (sql.CLAIM_SQL[1], False),
    "finish and claim, one queue": (sql.FINISH_AND_CLAIM_SQL[0], True),
    "finish and claim, several queues": (sql.FINISH_AND_CLAIM_SQL[1], True),
    "finish, start and claim, one queue": (sql.FINISH_START_CLAIM_SQL[0], True),
    "finish, start and claim, several queues": (sql.FINISH_START_CLAIM_SQL[1], True),
    "finish alone": (sql.COMPLETE_SQL, True),
    "fail alone": (sql.FAIL_SQL, True),
}


def numbered(text: str) -> tuple[str, list[str]]:
    """``text`` with its ``%(name)s`` placeholders as ``$n`` (one number per name) and the names in order."""
    names: list[str] = []

    def number(match: re.Match[str]) -> str:
        if match.group(1) not in names:
            names.append(match.group(1))
        return f"${names.index(match.group(1)) + 1}"

    return re.sub(r"%\((\w+)\)s", number, text).replace("%%", "%"), names


def nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    return [plan, *(node for child in plan.get("Plans", []) for node in nodes(child))]


def held(queue: str, worker: str) -> list[tuple[int, int]]:
    """Two tasks of ``queue`` RUNNING under ``worker``'s lease: (id, token) each."""
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO tasks_task (queue, priority, task_path, args, kwargs, status, run_after, enqueued_at,"
            " attempts, max_attempts, errors, worker_ids, renewals, transitions, failures, crashes,"
            " shared_crashes, unstarted_returns, attempt_started, attempt_isolated, holder, token, acquired_at,"
            " expires_at)"
            " SELECT %s, 0, %s, '[]', '{}', 'RUNNING', now(), now(), 0, 3, '[]', '[]', 0, 1, 0, 0, 0, 0,"
            " false, false, %s, nextval('leasing_fence_token_seq'), now(), now() + interval '1 hour'"
            " FROM generate_series(1, 2) RETURNING id, token",
            [queue, NOOP, worker],
        )
        return sorted(cursor.fetchall())


def test_the_generic_plans_read_only_the_rows_they_claim_and_finish() -> None:
    """One fill for the statements (it was one per statement: 48 s of the Django 5.2 / PostgreSQL 15
    leg), each statement then explained in a transaction rolled back, so that each finds the same two
    due rows (and its own two held ones): first under the plan it was given on the empty table before
    the fill, then under a plan made once the table has statistics."""
    with connection.cursor() as cursor:
        # Autovacuum's ANALYZE of the fill would make the plans again (invalidating the ones under test).
        cursor.execute("ALTER TABLE tasks_task SET (autovacuum_enabled = false)")
    try:
        quiet_hour()
        for index, name in enumerate(STATEMENTS):
            prepare(name, index)  # planned now, on the empty table, and kept with the statement
        with connection.cursor() as cursor:
            cursor.execute(FILL_SQL, {"queue": "generic-one", "path": NOOP, "rows": 200000})
            for priority in (0, 1):
                cursor.execute(
                    "INSERT INTO tasks_task (queue, priority, task_path, args, kwargs, status, run_after, enqueued_at,"
                    " attempts, max_attempts, errors, worker_ids, renewals, transitions, failures, crashes,"
                    " shared_crashes, unstarted_returns, attempt_started, attempt_isolated)"
                    " VALUES (%s, %s, %s, '[]', '{}', 'READY', now() - interval '1 second', now(), 0, 3, '[]', '[]',"
                    " 0, 0, 0, 0, 0, 0, false, false)",
                    ["generic-one", priority, NOOP],
                )
        kept = {name: problem for i, name in enumerate(STATEMENTS) if (problem := generic_plan_problem(name, i))}
        assert not kept, kept
        with connection.cursor() as cursor:
            cursor.execute("DEALLOCATE ALL")
            cursor.execute("ANALYZE tasks_task")
        for index, name in enumerate(STATEMENTS):
            prepare(name, index)
        made_again = {name: problem for i, name in enumerate(STATEMENTS) if (problem := generic_plan_problem(name, i))}
        assert not made_again, made_again
    finally:
        with connection.cursor() as cursor:
            cursor.execute("DEALLOCATE ALL")
            cursor.execute("ALTER TABLE tasks_task RESET (autovacuum_enabled)")


def quiet_hour() -> None:
    """The table as a quiet hour leaves it: the statistics of a backlog like the one to come, then the
    tasks gone (their last burst rolled back here), and the table vacuumed: known to be empty, its
    indexes still as large as the burst made them. Planned on it with only sequential scans turned
    off, each claim walked its queue's priorities and due rows through a bitmap of every READY row of
    another index, then sorted them (50,056 blocks for the one-queue claim on PostgreSQL 18 and 62,633 on
    15; 81,294 and 101,734 for several queues): a clean-clone run failed on it when the tests before had
    left the table so."""
    with connection.cursor() as cursor:
        cursor.execute(FILL_SQL, {"queue": "generic-one", "path": NOOP, "rows": 2000})
        cursor.execute("ANALYZE tasks_task")
        cursor.execute("TRUNCATE tasks_task CASCADE")
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(FILL_SQL, {"queue": "generic-one", "path": NOOP, "rows": 2000})
        transaction.set_rollback(True)
    with connection.cursor() as cursor:
        cursor.execute("VACUUM tasks_task")


def params_of(name: str, mine: list[tuple[int, int]]) -> list[Any]:
    """Statement ``name``'s parameters (in ``$n`` order), finishing ``mine``."""
    queues = ["generic-one"] if "one queue" in name or "alone" in name else ["generic-one", "generic-empty"]
    params: dict[str, Any] = {
        "worker": "plan",
        "ttl": 30.0,
        "limit": 10,
        "start": False,
        "isolate_after": 2,
        "ids": [i for i, _ in mine],
        "tokens": [t for _, t in mine],
        "values": ["null" for _ in mine],
        "started": [None for _ in mine],
        "hand": False,
        "handed": "{}",
        "release": 0,
        "rated_queues": [],
        "start_ids": [],
        "start_tokens": [],
        "start_at": [],
        # A failure of each (retried: READY again), as fail_many sends it.
        "errors": ['{"exception_class_path": "x.Error", "message": "", "traceback": ""}' for _ in mine],
        "retry": [True for _ in mine],
        "kinds": ["fail" for _ in mine],
        "delays": [None for _ in mine],
        "max_attempts": [None for _ in mine],
        "backoff_base": 1.0,
        "backoff_max": 60.0,
        **sql.claim_params(queues, busy=True, isolate_after=2),
    }
    return [params[n] for n in numbered(STATEMENTS[name][0])[1]]


def prepare(name: str, index: int) -> None:
    """Statement ``name`` prepared as ``generic_<index>`` with its generic plan made now (EXPLAIN
    EXECUTE makes and keeps it, under the settings the worker sends it with)."""
    text, _finishes = STATEMENTS[name]
    numbered_text, names = numbered(text)
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(f"PREPARE generic_{index} AS {numbered_text}")
        cursor.execute(GENERIC_PLAN_SETTINGS)
        cursor.execute(f"EXPLAIN EXECUTE generic_{index}({', '.join(['%s'] * len(names))})", params_of(name, []))


def generic_plan_problem(name: str, index: int) -> str | None:
    """What is wrong with statement ``name``'s generic plan beside the backlogs (None: nothing)."""
    text, finishes = STATEMENTS[name]
    if text not in GENERIC_PLAN:
        return "the worker does not run this statement under a generic plan"
    with transaction.atomic(), connection.cursor() as cursor:
        mine = held("generic-one", "plan") if finishes else []
        params = params_of(name, mine)
        cursor.execute(GENERIC_PLAN_SETTINGS)
        cursor.execute(
            f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE generic_{index}({', '.join(['%s'] * len(params))})",
            params,
        )
        explained = cursor.fetchone()[0][0]
        transaction.set_rollback(True)  # the next statement finds the same due rows
    if "JIT" in explained:  # a server built with JIT (Debian's PostgreSQL 15): not the embedded one
        return f"JIT-compiled: {explained['JIT']['Functions']} functions, {explained['JIT']['Timing']}"
    plan = explained["Plan"]
    found = nodes(plan)
    # A generic plan: the index conditions name parameters, not the values sent.
    conditions = " ".join(node.get("Index Cond", "") + node.get("Filter", "") for node in found)
    if not re.search(r"\$\d", conditions):
        return f"not a generic plan: {conditions}"
    seq_scans = [n for n in found if n["Node Type"] == "Seq Scan" and n.get("Relation Name") == "tasks_task"]
    if seq_scans:
        return f"a sequential scan of tasks_task: {[node['Node Type'] for node in found]}"
    # Two due rows claimed (and, in a round, the two held ones finished): one result row each; the
    # finish alone, the two held ones.
    claims = 0 if "alone" in name else 2
    if plan["Actual Rows"] != claims + len(mine):
        return f"{plan['Actual Rows']} rows, not {claims + len(mine)}"
    # Index maintenance for the rows it updates aside (the earlier statements' dead entries): a read
    # of either backlog (100,000 rows) would be thousands of blocks.
    touched = plan["Shared Hit Blocks"] + plan["Shared Read Blocks"]
    return f"{touched} blocks read" if touched >= 2_500 else None


def claim_plans() -> tuple[int, int]:
    """How often this connection's prepared claim statement ran its generic plan, and a custom one."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT generic_plans, custom_plans FROM pg_prepared_statements WHERE statement LIKE %s",
            ["%UPDATE tasks_task AS t SET%FOR UPDATE SKIP LOCKED%"],
        )
        rows = cursor.fetchall()
    assert len(rows) == 1, rows  # one claim statement prepared on this connection
    return rows[0]


def plan_cache_mode() -> str:
    with connection.cursor() as cursor:
        cursor.execute("SELECT current_setting('plan_cache_mode')")
        return str(cursor.fetchone()[0])


def test_a_claim_in_autocommit_is_planned_once_and_leaves_the_setting_as_it_was() -> None:
    """Seven claims on one connection in autocommit: each ran the generic plan (built once and kept
    with the prepared statement), none a custom one (PostgreSQL's own choice plans the first five
    custom, then keeps choosing custom for these statements), and the session's plan_cache_mode is
    still the default after each."""
    connection.close()  # a connection of its own: no statement prepared on it yet
    for _ in range(7):
        Task.objects.enqueue(NOOP, queue="generic-once")
        assert len(Task.objects.claim("plan", queues=["generic-once"])) == 1
        assert plan_cache_mode() == "auto"
    assert claim_plans() == (7, 0)


def test_a_claim_inside_a_callers_transaction_is_planned_as_postgresql_chooses() -> None:
    """Inside the caller's transaction the setting would hold for the statements after the claim, to
    the transaction's end: there the claim is sent without it, and nothing changes the session."""
    connection.close()
    for _ in range(3):
        Task.objects.enqueue(NOOP, queue="generic-once")
        with transaction.atomic():
            assert len(Task.objects.claim("plan", queues=["generic-once"])) == 1
            assert plan_cache_mode() == "auto"
    assert claim_plans() == (0, 3)
