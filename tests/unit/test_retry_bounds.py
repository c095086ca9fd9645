"""A retry loop's bound moves with a stop (tasks/worker/session.py): a loop that began before the
stop request had one TTL to run, and kept it, so a worker cut off from its database outlived its
drain and its leases (a clean-clone run: the SIGTERM test of test_shutdown_under_faults.py). The
dispatcher's own retries (a round's reconcile, a lost reply's hand-back, its start markers) come
before its drain begins, so the bound counts from the stop request itself, not from the drain
(breaker 59: with the drain's deadline alone, the bound moved on with the clock)."""

from __future__ import annotations

import pytest
from django.db import OperationalError

from leasing import clock
from tasks.worker.session import Session, retrying


@pytest.fixture
def now(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The local clock, moved by the test alone."""
    current = [1000.0]
    monkeypatch.setattr(clock, "monotonic", lambda: current[0])
    return current


def session(now: list[float], monkeypatch: pytest.MonkeyPatch) -> Session:
    s = Session("w:1", "w", "default", ttl=60.0, shutdown_grace=2.0, poll_interval=1.0)
    # A retry's pause passes on the test's clock, at once.
    monkeypatch.setattr(s.hurry, "wait", lambda seconds: now.__setitem__(0, now[0] + seconds) or False)
    return s


def test_a_stop_requested_while_the_dispatcher_retries_ends_the_retries_after_the_grace(
    now: list[float], monkeypatch: pytest.MonkeyPatch
) -> None:
    s = session(now, monkeypatch)
    passes: list[float] = []

    def cut_off() -> str:
        passes.append(now[0])
        if len(passes) == 1:
            s.request_drain()  # Worker.request_stop, while this loop runs: no drain has begun
        if len(passes) > 100:
            return "still retrying"  # 20 s on: the bound did not move
        raise OperationalError("server closed the connection unexpectedly")

    assert retrying("recording a start", s, cut_off) is None
    # The grace and its second (3 s on the test's clock, give or take one pause of 0.2 s): not one TTL (60 s).
    assert passes[-1] - passes[0] < s.shutdown_grace + 1.0 + 0.2


def test_the_drain_counts_its_grace_from_the_stop_request(now: list[float], monkeypatch: pytest.MonkeyPatch) -> None:
    s = session(now, monkeypatch)
    s.request_drain()
    now[0] += 1.5  # the dispatcher was busy (a statement, a retry) when the stop came
    s.request_drain()  # a second request does not move it
    assert s.grace_deadline() == 1002.0


def test_without_a_stop_the_bound_is_one_ttl(now: list[float], monkeypatch: pytest.MonkeyPatch) -> None:
    s = session(now, monkeypatch)
    give_up_at = s.retry_deadline()
    assert give_up_at == 1060.0
    now[0] += 59.0
    assert not s.out_of_retries(give_up_at)
    now[0] += 2.0
    assert s.out_of_retries(give_up_at)  # its own bound passed
    s.hurry.set()
    assert s.out_of_retries(s.retry_deadline())  # a second stop ends it at once
