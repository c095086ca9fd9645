"""The queue overview (/dashboard/queues/, GET /api/queues) against large backlogs: its waiting and
blocked counts stop at COUNT_CAP by reading an index in order, never by a scan of the table, whatever
share of the table a backlog is (tasks/web/queues.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.db import connection

from tasks.web.queries import queue_stats
from tasks.web.queues import queue_overview
from tests.helpers.plans import add_rows, explained, overreads, recorded

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_overview_counts_a_backlog_that_is_most_of_the_table_from_an_index(monkeypatch: pytest.MonkeyPatch) -> None:
    """History first, then a burst not yet vacuumed: a READY backlog and a BLOCKED backlog appended
    after the finished rows, in two queues. The planner, expecting far more matches per queue than the
    cap, took a sequential scan with a LIMIT for each capped count (ordered by id: a backward scan of
    the primary key), and that scan stepped over every finished row and the other backlog before it
    found the first row it counts: the page's cost grew with the table. Every node must read at most
    about ``cap`` rows per loop. (The cap is scaled down with the table: what decides the plan is
    backlog / cap.)"""
    cap = 100
    monkeypatch.setattr("tasks.web.queues.COUNT_CAP", cap)
    add_rows("bulk", "SUCCESSFUL", 6_000)
    add_rows("bulk", "READY", 6_000)
    add_rows("keyed", "READY", 6_000, keyed=True)
    add_rows("other", "READY", 6_000, keyed=True)  # another queue's BLOCKED backlog, after this one's
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE tasks_task")  # no VACUUM: a fresh burst has no visibility map yet
    with recorded() as statements:
        entries = {e["name"]: e for e in queue_overview()}
    assert set(entries) == {"bulk", "keyed", "other"}
    assert (entries["bulk"]["waiting"], entries["bulk"]["waiting_capped"], entries["bulk"]["blocked"]) == (cap, True, 0)
    for name in ("keyed", "other"):
        assert (entries[name]["waiting"], entries[name]["blocked"], entries[name]["blocked_capped"]) == (10, cap, True)
    assert len(statements) >= 4
    problems = overreads(statements, 2 * cap)
    assert not problems, "\n".join(problems)


def test_the_blocked_count_of_a_queue_is_exact_below_the_cap_beside_neighbouring_queues(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The BLOCKED count reads from its queue on in name order (the next queues' rows follow in the
    same scan): only its own rows count, exact below the cap, capped at it."""
    monkeypatch.setattr("tasks.web.queues.COUNT_CAP", 50)
    add_rows("a", "READY", 30, keyed=True)  # 10 admitted, 20 blocked
    add_rows("a-b", "READY", 200, keyed=True)  # sorts right after "a": 190 blocked
    add_rows("b", "READY", 15, keyed=True)  # 10 admitted, 5 blocked
    entries = {e["name"]: e for e in queue_overview()}
    assert {name: (e["waiting"], e["blocked"], e["blocked_capped"]) for name, e in entries.items()} == {
        "a": (10, 20, False),
        "a-b": (10, 50, True),
        "b": (10, 5, False),
    }


def _buffers(statements: list[tuple[str, Any]]) -> int:
    """Shared buffers (hit + read) of the statements, each run again under EXPLAIN (ANALYZE, BUFFERS)."""
    total = 0
    for sql, params in statements:
        with connection.cursor() as cursor:
            cursor.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sql, params)
            raw = cursor.fetchone()[0]
        plan = (json.loads(raw) if isinstance(raw, str) else raw)[0]["Plan"]
        total += plan.get("Shared Hit Blocks", 0) + plan.get("Shared Read Blocks", 0)
    return total


def test_the_runnable_depth_reads_the_due_tasks_never_the_ones_asleep() -> None:
    """Tasks asleep (tasks.steps.sleep, wait_for_event: READY, due hours ahead) in the same queue and
    priority as the due ones: the depth is counted from the due entries of each priority, so 100 times
    more sleepers cost the count no more than an index level. (Counted over the whole queue, the
    due-time condition was no bound of the index scan below PostgreSQL 18, whose skip scan hid it:
    every sleeper's entry was stepped over, about 400 more buffers here.)"""
    add_rows("bulk", "READY", 5)
    add_rows("bulk", "READY", 600, ahead=86_400)
    with connection.cursor() as cursor:
        cursor.execute("VACUUM ANALYZE tasks_task")
    with recorded() as statements:
        small = {s["queue"]: s["depth"].value for s in queue_stats()}
    few = _buffers(statements)
    add_rows("bulk", "READY", 60_000, ahead=86_400)
    with connection.cursor() as cursor:
        cursor.execute("VACUUM ANALYZE tasks_task")
    with recorded() as statements:
        large = {s["queue"]: s["depth"].value for s in queue_stats()}
    many = _buffers(statements)
    assert small == large == {"bulk": 5}
    assert many <= few + 20, f"{few} buffers beside 600 sleepers, {many} beside 60,600"


def _running_rows_read(plan: dict[str, Any]) -> float:
    """Rows the plan's nodes read from the running rows (``tasks_task_running_exp_idx``, the one index
    that holds them all), over all their loops."""
    read = 0.0
    if plan.get("Index Name") == "tasks_task_running_exp_idx":
        read += (plan["Actual Rows"] + plan.get("Rows Removed by Filter", 0)) * plan["Actual Loops"]
    return read + sum(_running_rows_read(child) for child in plan.get("Plans", []))


def test_the_running_tasks_of_every_queue_are_counted_in_one_read_of_the_running_set() -> None:
    """Beside 20,000 finished tasks, twenty queues with waiting tasks, 40 running tasks in one of them
    and 25 in a queue that has nothing else: each queue's running count is exact, the queue with only
    running tasks is listed, and the running rows are read once for the page (not once per queue
    listed: 22 x 65 rows, which the parent's per-queue count read)."""
    add_rows("history", "SUCCESSFUL", 20_000)  # a table the planner reads through its indexes
    for n in range(20):
        add_rows(f"q{n:02}", "READY", 5)
    add_rows("q03", "RUNNING", 40)
    add_rows("only-running", "RUNNING", 25)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE tasks_task")
    with recorded() as statements:
        entries = {e["name"]: e for e in queue_overview()}
    assert {name: (e["waiting"], e["running"]) for name, e in entries.items()} == {
        **{f"q{n:02}": (5, 0) for n in range(20)},
        "q03": (5, 40),
        "only-running": (0, 25),
    }  # (a queue with finished tasks only is not listed)
    read = sum(_running_rows_read(explained(sql, params)) for sql, params in statements)
    assert read <= 65, read
    assert not overreads(statements, 100)
