"""Odd parameter values give the same outcome prepared (server-side binding, types
from psycopg's dumpers: int2/int4/int8/numeric by value, None untyped) as unprepared (Django's
client-side binding): the same row stored, or the same kind of error with nothing stored.

Found by breaker 22 (the bug hunt on issue 22: prepared statements and pipelined bounds). This attack held."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from django.db import connection, transaction

from leasing.bounds import bound, unbound
from tasks.lifecycle import prepared
from tasks.models import Task

pytestmark = pytest.mark.django_db(transaction=True)

Q100 = "ü" * 50 + "😀" * 50  # 100 characters, 250 bytes

CASES: dict[str, dict[str, Any]] = {
    "queue of 100 non-ASCII chars": {"queue": Q100},
    "max_attempts int4 max": {"max_attempts": 2**31 - 1},
    "max_attempts over int4": {"max_attempts": 2**31},
    "max_attempts numeric": {"max_attempts": 2**70},
    "timeout infinite": {"timeout": float("inf")},
    "timeout tiny": {"timeout": 5e-324},
    "timeout int": {"timeout": 3},
    "dedup key unicode": {"dedup_key": "ключ-😀"},
    "dedup key empty": {"dedup_key": ""},
    "task_path with NUL": {"task_path": "a\x00b"},
    "task_path too long": {"task_path": "x" * 256},
    "kwargs with odd text": {"kwargs": {"s": "\u2028\ud7ff\U0010ffff", "n": 2**80}},
    "run_after naive": {"run_after": dt.datetime(2030, 1, 1, 12)},
    "run_after date": {"run_after": dt.date(2030, 1, 1)},
    "concurrency limit max": {"concurrency_key": "k", "concurrency_limit": 2**31 - 1},
    "priority bool": {"priority": True},
}

COLUMNS = (
    "queue",
    "priority",
    "task_path",
    "args",
    "kwargs",
    "run_after",
    "max_attempts",
    "timeout",
    "dedup_key",
    "status",
    "concurrency_key",
    "concurrency_limit",
)


def outcome(settings, prepared_on: bool, bounded: bool, extra: dict[str, Any]) -> tuple[Any, ...]:
    settings.LEASING_TASKS = {"PREPARED_STATEMENTS": prepared_on}
    prepared._refused.clear()
    assert prepared.preparable(connection) is prepared_on
    call = {"task_path": "tests.testapp.handlers.noop", **extra}
    if bounded:
        bound(connection, statement_ms=5000, lock_ms=1000)
    try:
        before = Task.objects.count()
        try:
            with transaction.atomic():
                got = Task.objects.enqueue(**call)
                columns = COLUMNS if "run_after" in extra else tuple(c for c in COLUMNS if c != "run_after")
                row = Task.objects.filter(pk=got.id).values_list(*columns).get()
                transaction.set_rollback(True)  # compare, don't keep
            return ("ok", row)
        except Exception as exc:
            assert Task.objects.count() == before
            return ("error", type(exc).__name__)
    finally:
        unbound(connection)


@pytest.mark.parametrize("bounded", [False, True], ids=["plain", "bounded"])
@pytest.mark.parametrize("extra", list(CASES.values()), ids=list(CASES))
def test_prepared_and_unprepared_agree(settings, extra, bounded):
    unprepared = outcome(settings, False, bounded, extra)
    assert outcome(settings, True, bounded, extra) == unprepared
