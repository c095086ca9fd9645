"""Handlers of the workflow process tests (tests/concurrency/test_workflow_processes.py): every start
and end is an Effect row stamped with the database clock, so that order can be checked on one clock."""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

from django.db import connection

from tasks.runtime import current_task
from tasks.workflows import parent_results
from tests.testapp.handlers import _span_mark


def _chance(*parts: Any) -> float:
    digest = hashlib.blake2b(":".join(str(p) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def member(n: int, seed: int, fail_every: int = 0, flaky: float = 0.2, work: float = 0.01) -> int:
    """A group member: fails for good when ``fail_every`` divides ``n + 1``, fails a ``flaky``
    share of its attempts (retried), and works up to ``work`` seconds."""
    _span_mark("started")
    run = current_task()
    if fail_every and (n + 1) % fail_every == 0:
        raise RuntimeError(f"member {n} fails every attempt")
    if _chance(seed, n, run.attempt) < flaky:
        raise RuntimeError(f"member {n} fails attempt {run.attempt}")
    time.sleep(work * _chance(seed, n, "work"))
    _span_mark("ended")
    return n


def callback(key: str) -> dict[str, int]:
    """A group's callback: one effect with a unique key (a second run inserts nothing and is counted
    in ``runs``), holding how the callback found its members."""
    _span_mark("started")
    outcomes = parent_results()
    seen: dict[str, int] = {}
    for outcome in outcomes:
        seen[outcome.status] = seen.get(outcome.status, 0) + 1
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO testapp_once (key, value, runs) VALUES (%s, %s, 1)"
            " ON CONFLICT (key) DO UPDATE SET runs = testapp_once.runs + 1",
            [key, json.dumps(seen)],
        )
    _span_mark("ended")
    return seen


def link(*args: Any, fail_at: int = -1, work: float = 0.02) -> int:
    """A chain step: ``link(i)`` first, then ``link(previous, i)`` with the result of the step before
    (piped), which must be ``i - 1``. Step ``fail_at`` fails every attempt."""
    _span_mark("started")
    previous, i = (None, args[0]) if len(args) == 1 else args
    if previous is not None and previous != i - 1:
        raise AssertionError(f"step {i} was given {previous!r}")
    if i == fail_at:
        raise RuntimeError(f"step {i} fails every attempt")
    time.sleep(work)
    _span_mark("ended")
    return int(i)


def node(n: int, work: float = 0.01) -> int:
    """A node of a dependency graph."""
    _span_mark("started")
    time.sleep(work * _chance("node", n))
    _span_mark("ended")
    return n
