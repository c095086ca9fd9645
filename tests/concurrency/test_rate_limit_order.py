"""A rate-limited backlog waits in line (issue 38, item 6): three worker processes drain a backlog of
one rate key at 20 starts per second, and its tasks start in about the order they were enqueued, each
refused a bounded number of times on its way, the limit never exceeded.

Counts, not times, so that a slow machine cannot fail it: the starts are ranked on the database
clock and the test compares ranks. Before the fix, a task that came back at its reserved time before
its start was free went to the back of the line again after one quick retry, so the line was
reshuffled: on this backlog of 400, half the tasks started more than 67 places from their enqueue
rank (90 %: 181), 2.75 refusals per task, 138 refused 4 times or more; after, 9 and 14 places, 1.85
refusals, 15 to 18 refused 4 times. The timings (600 and 1,500 tasks) are bench/rate_limits.py's."""

from __future__ import annotations

import datetime as dt
import statistics

import pytest

from tasks.models import Task
from tests.helpers import wait_until
from tests.helpers.task_paths import NOOP
from tests.helpers.workers import Workers

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.serial]

LIMIT = 20
BACKLOG = 400


def fullest_window(times: list[dt.datetime], period: float = 1.0) -> int:
    width, most, j = dt.timedelta(seconds=period), 0, 0
    for i, start in enumerate(times):
        j = max(j, i)
        while j < len(times) and times[j] < start + width:
            j += 1
        most = max(most, j - i)
    return most


def test_a_backlog_starts_in_line_and_each_task_is_refused_a_few_times_at_most(workers: Workers) -> None:
    ids = Task.objects.bulk_enqueue(NOOP, [{}] * BACKLOG, rate_key="line", rate_limit=f"{LIMIT}/s")
    for i in range(3):
        # The default poll interval (longer than the key's period): the workers look for refused
        # claims when they come due, as in production.
        workers.start(f"w{i}", "--concurrency", "4", "--poll-interval", "2")
    wait_until(
        lambda: Task.objects.filter(pk__in=ids, status="SUCCESSFUL").count() == BACKLOG,
        120,
        0.2,
        what="the backlog to drain",
    )
    rows = list(
        Task.objects.filter(pk__in=ids)
        .order_by("id")
        .values_list("id", "attempts", "rate_refusals", "last_attempted_at")
    )
    assert all(attempts == 1 for _, attempts, _, _ in rows)  # a refusal is never an attempt
    starts = [at for _, _, _, at in rows if at is not None]
    assert len(starts) == BACKLOG
    assert fullest_window(sorted(starts)) <= LIMIT

    rank = {i: r for r, i in enumerate(sorted(range(BACKLOG), key=lambda i: (starts[i], i)))}
    # In line: how far each task's start (its rank among the starts) is from its place in the backlog.
    # A worker hands back what it claimed but cannot start within its prefetch window, and resumes its
    # next claims after its position (tasks/worker/dispatcher.py): such a row is refused, so queued,
    # only when a later scan finds it, up to a second later. So a few start out of place; the rest
    # keep theirs within a worker's prefetch or two.
    strays = sorted(abs(rank[i] - i) for i in range(BACKLOG))
    refusals = [refused for _, _, refused, _ in rows]
    print(  # for the report when it fails
        f"strays p50={strays[BACKLOG // 2]} p90={strays[int(BACKLOG * 0.9)]} max={strays[-1]};"
        f" refusals mean={statistics.fmean(refusals):.2f} max={max(refusals)}"
        f" 4+={sum(1 for r in refusals if r >= 4)}"
    )
    # Before the fix: p50 67, p90 181. After: p50 9-14 and p90 14-64 (64 on CI's loaded PostgreSQL 18
    # leg, 2026-11-25, where a few more hand-backs waited for a scan). The bounds sit between the two.
    assert strays[BACKLOG // 2] <= 30 and strays[int(BACKLOG * 0.9)] <= 110, strays[BACKLOG // 2 :]

    # Once when the backlog is first claimed and, while the line runs late, once more when a task
    # comes back before its start is free (then it is promised the next one): never sent to the back.
    assert statistics.fmean(refusals) <= 2.4, refusals
    # The tail: refused 4 times or more. Measured 2026-11-25: within 40 of 400 on PostgreSQL 18; 41
    # (quiet) and 51 (loaded) on Debian's PostgreSQL 15, whose line runs later under the same load.
    assert sum(1 for r in refusals if r >= 4) <= BACKLOG // 6, sorted(refusals)[-20:]
