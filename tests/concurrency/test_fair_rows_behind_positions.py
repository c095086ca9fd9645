"""Rows that appear behind a fair claimer's positions, with real worker processes: retries coming due
after a backoff, snoozes waking, rows of a higher priority and rows enqueued with a start in the past
arriving in keys already served, beside an old REPEATABLE READ snapshot held by another session (the
case the positions are for). Three workers of a fair queue claim in small batches, so each keeps
positions in many keys. Every task ends SUCCESSFUL, and each ran exactly as often as its handler
says: one execution, plus the failed first attempt of a retried one or the snoozed first run of a
snoozed one (tests/testapp/outcome_handlers.py, ``fair_mix``; one effect row per execution)."""

from __future__ import annotations

import datetime as dt
from collections import Counter
from typing import Any

import pytest

from tasks.models import Task, Worker
from tests.helpers import wait_until
from tests.testapp.models import Effect

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.one_stack]

MIX = "tests.testapp.outcome_handlers.fair_mix"
BACKOFF = "tests.testapp.outcome_handlers.quick_backoff"
MODES = ("plain", "retry", "snooze")


def _enqueue(keys: range, per_key: int, **extra: Any) -> list[int]:
    ids: list[int] = []
    for key in keys:
        for mode in MODES:
            ids += Task.objects.bulk_enqueue(
                MIX,
                [{"mode": mode}] * per_key,
                queue="tenants",
                fair_key=f"tenant-{key:02d}",
                backoff=BACKOFF,
                **extra,
            )
    return ids


def test_rows_behind_positions_all_run_exactly_as_often_as_their_handlers_say(
    tenant_workers: Any, old_snapshot: None
) -> None:
    ids = _enqueue(range(30), 8)  # 720 tasks over 30 keys, a third retried and a third snoozed once
    for name in ("behind-1", "behind-2", "behind-3"):
        tenant_workers(name, batch=8)
    wait_until(lambda: Worker.objects.filter(name__startswith="behind-").count() == 3, 30, what="the workers up")
    wait_until(lambda: Effect.objects.filter(task_id__in=ids).count() >= len(ids) // 3, 60, what="a third of the runs")
    # Served keys get rows that sort before their positions: a higher priority level, and starts in
    # the past (run_after an hour ago, before every row the workers took).
    ids += _enqueue(range(0, 30, 3), 2, priority=5)
    ids += _enqueue(range(1, 30, 3), 2, run_after=dt.datetime.now(dt.timezone.utc) - dt.timedelta(hours=1))
    wait_until(
        lambda: Task.objects.filter(pk__in=ids, status="SUCCESSFUL").count() == len(ids),
        180,
        what="every task successful",
    )
    rows = {row["id"]: row for row in Task.objects.filter(pk__in=ids).values("id", "kwargs", "attempts", "snoozes")}
    runs = Counter((effect.task_id, effect.phase) for effect in Effect.objects.filter(task_id__in=ids))
    wrong = []
    for task_id, row in rows.items():
        mode = row["kwargs"]["mode"]
        expected = (
            {("done"): 1} | ({"failed": 1} if mode == "retry" else {}) | ({"snoozed": 1} if mode == "snooze" else {})
        )
        seen = {phase: runs[(task_id, phase)] for phase in ("done", "failed", "snoozed") if runs[(task_id, phase)]}
        attempts = 2 if mode == "retry" else 1
        if seen != expected or row["attempts"] != attempts or row["snoozes"] != (mode == "snooze"):
            wrong.append((task_id, mode, seen, row["attempts"], row["snoozes"]))
    assert not wrong, wrong[:10]
