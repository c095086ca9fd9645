"""Rate limits per key: RATE_START_SQL against PostgreSQL, one statement at
a time, on the database clock.

- The key's reservation tail (``next_due``) is moved on by every refusal and never moved back: when
  the refused backlog that took the reservations goes away (cancelled, or run under a raised limit),
  the next refusal is still sent behind the whole phantom line, though the window frees one period
  later. The key's budget sits unused meanwhile (a refused start must come back when a start is free).
- A limit whose period grows mid-flight: the grants of the old, shorter window were dropped from the
  key's row, so the first starts under the longer window do not count them.
- A stale claim (its lease lapsed, as after a SIGSTOP past the lease) takes nothing and starts nothing.


Found by breaker 32 (the bug hunt on issue 24's rate limits per key)."""

from __future__ import annotations

import datetime as dt

import pytest

from tasks.models import RateLimit, RateRefused, Started, Task, TaskStatus
from tests.helpers import db_now
from tests.helpers.task_paths import NOOP

pytestmark = pytest.mark.django_db(transaction=True)

W = "breaker32-worker"


def wait_db_until(at: dt.datetime, deadline: float = 30.0) -> None:
    """Poll the database clock (no sleep as synchronisation) until it passes ``at``."""
    limit = db_now() + dt.timedelta(seconds=deadline)
    while (now := db_now()) < at:
        assert now < limit, f"database clock never reached {at}"


def claim_all(n: int) -> list[tuple[int, int]]:
    claimed = Task.objects.claim(W, limit=n, ttl=30)
    return sorted((c.id, c.token) for c in claimed)


def start(attempt: tuple[int, int]) -> Started | RateRefused | None:
    return Task.objects.rate_start(attempt[0], W, attempt[1])


@pytest.mark.parametrize("backlog_goes", ["cancelled", "deleted"])
def test_a_refusal_after_the_backlog_went_away_is_sent_to_when_the_window_frees(backlog_goes: str) -> None:
    period = 2.0
    Task.objects.bulk_enqueue(NOOP, [{}] * 30, rate_key="tail", rate_limit=(1, period))
    results = [start(a) for a in claim_all(30)]
    granted = [r for r in results if isinstance(r, Started)]
    refused = [r for r in results if isinstance(r, RateRefused)]
    assert len(granted) == 1 and len(refused) == 29
    # The refused backlog goes away (an operator cancels the queued mails, or they are deleted).
    backlog = Task.objects.filter(pk__in=[r.id for r in refused])
    if backlog_goes == "cancelled":
        assert backlog.cancel() == 29
    else:
        backlog.delete()
    assert not Task.objects.filter(rate_key="tail", status=TaskStatus.READY).exists()
    # The window frees one period after the only grant.
    wait_db_until(granted[0].last_attempted_at + dt.timedelta(seconds=period))
    # Two new tasks of the key: the window is empty, so one is granted now and the other must come
    # back when that grant leaves the window (one period), not behind 29 reservations nobody holds.
    Task.objects.bulk_enqueue(NOOP, [{}] * 2, rate_key="tail", rate_limit=(1, period))
    results = [start(a) for a in claim_all(2)]
    first, second = results
    assert isinstance(first, Started), results
    assert isinstance(second, RateRefused), results
    wait = (second.run_after - first.last_attempted_at).total_seconds()
    key = RateLimit.objects.get(key="tail")
    assert wait <= 2 * period, (
        f"sent {wait:.2f}s after the only grant in the window (limit 1 per {period}s): the reservation"
        f" tail {key.next_due} still counts the {len(refused)} reservations of the backlog that is gone"
    )


def test_a_refusal_under_a_raised_limit_is_not_sent_behind_the_old_limits_line() -> None:
    # A key at 1 per 3 s, 20 refused (reservations 3 s apart: a minute's line). The limit is raised to
    # 50 per 3 s for new tasks; the old backlog is cancelled. A burst of 60 new tasks: 49 fit the
    # window (one is taken already), the rest must come back within about a period, not in a minute.
    Task.objects.bulk_enqueue(NOOP, [{}] * 21, rate_key="raised", rate_limit=(1, 3.0))
    results = [start(a) for a in claim_all(21)]
    refused = [r for r in results if isinstance(r, RateRefused)]
    assert len(refused) == 20
    assert Task.objects.filter(pk__in=[r.id for r in refused]).cancel() == 20
    Task.objects.bulk_enqueue(NOOP, [{}] * 60, rate_key="raised", rate_limit=(50, 3.0))
    before = db_now()
    results = [start(a) for a in claim_all(60)]
    later = [r for r in results if isinstance(r, RateRefused)]
    assert sum(isinstance(r, Started) for r in results) == 49
    latest = max((r.run_after - before).total_seconds() for r in later)
    assert latest <= 2 * 3.0, f"refused starts sent up to {latest:.2f}s ahead under a limit of 50 per 3s"


def test_a_longer_period_counts_what_the_key_remembers_and_holds_from_the_change_on() -> None:
    # Breaker 32 found that lengthening a key's window (10 per 1 s, then 5 per 4 s) cannot count the
    # grants the 1 s window had already forgotten: the key row keeps the grants of its current
    # window only (the row stays small: O(count)). Documented (docs/howto/rate-limits.md, "Changing a
    # limit"): the longer window counts the grants the row still holds, and holds exactly from the
    # change on. This holds the documented half.
    Task.objects.bulk_enqueue(NOOP, [{}] * 5, rate_key="grow", rate_limit=(10, 1.0))
    old = [start(a) for a in claim_all(5)]
    assert all(isinstance(r, Started) for r in old)
    last_old = max(r.last_attempted_at for r in old if isinstance(r, Started))
    wait_db_until(last_old + dt.timedelta(seconds=1.05))
    Task.objects.bulk_enqueue(NOOP, [{}], rate_key="grow", rate_limit=(10, 1.0))
    [one] = [start(a) for a in claim_all(1)]
    assert isinstance(one, Started)
    assert len(RateLimit.objects.get(key="grow").starts) == 1  # the row forgot the first five
    # 5 per 4 s from now on: the remembered grant counts, so 4 more are granted and the 5th refused.
    Task.objects.bulk_enqueue(NOOP, [{}] * 5, rate_key="grow", rate_limit=(5, 4.0))
    results = [start(a) for a in claim_all(5)]
    assert [isinstance(r, Started) for r in results].count(True) == 4, results
    assert sum(isinstance(r, RateRefused) for r in results) == 1


def test_a_claim_whose_lease_lapsed_takes_nothing_and_starts_nothing() -> None:
    # A worker frozen (SIGSTOP) between its claim and its rate start, past its lease; another worker
    # claims the task again and starts it; the frozen one thaws and sends its rate start.
    Task.objects.bulk_enqueue(NOOP, [{}], rate_key="stale", rate_limit=(1, 60))
    [stale] = [(c.id, c.token) for c in Task.objects.claim(W, limit=1, ttl=0.3)]
    row = Task.objects.get(pk=stale[0])
    wait_db_until(row.expires_at)
    assert Task.objects.recover_expired()
    [fresh] = [(c.id, c.token) for c in Task.objects.claim("other", limit=1, ttl=30)]
    assert fresh[0] == stale[0] and fresh[1] > stale[1]
    # The stale token takes nothing (the key has no row yet), starts nothing.
    assert start(stale) is None
    assert not RateLimit.objects.filter(key="stale").exists()
    row = Task.objects.get(pk=stale[0])
    assert (row.status, row.holder, row.attempts, row.attempt_started) == (TaskStatus.RUNNING, "other", 0, False)
    # The fresh claim is granted; the stale one, sent again, is still nothing (not "sent again after a
    # lost reply": the row is not its own).
    granted = Task.objects.rate_start(fresh[0], "other", fresh[1])
    assert isinstance(granted, Started)
    assert start(stale) is None
    # Even the same worker id with the stale token (a worker restarted under the same name).
    assert Task.objects.rate_start(stale[0], "other", stale[1]) is None
    key = RateLimit.objects.get(key="stale")
    assert (key.grants, key.refusals, len(key.starts)) == (1, 0, 1)
    assert Task.objects.get(pk=stale[0]).attempts == 1
