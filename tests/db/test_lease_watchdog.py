"""The deadline watchdog announces a loss at the local deadline, once, whatever the holder's threads do.

These holders are acquired with ``try_acquire()`` and no heartbeat, so nothing renews them and the
local deadline is sure to pass: what is tested is who notices, when, and how often.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from leasing import clock, lease
from leasing.holder import DEADLINE_PASSED, LeaseHolder, _watchdog
from leasing.signals import lease_lost

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("short_leasing")]

#: How late after the local deadline an announcement may come on a loaded test machine.
MARGIN = 0.25


class Announcements:
    """on_lost calls and lease_lost signals, with the clock reading and thread of each."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.on_lost: list[tuple[LeaseHolder, float, str]] = []
        self.signals: list[tuple[str, float, str]] = []
        self.changed = threading.Condition(self.lock)

    def record_on_lost(self, held: LeaseHolder) -> None:
        with self.lock:
            self.on_lost.append((held, clock.monotonic(), threading.current_thread().name))
            self.changed.notify_all()

    def record_signal(self, sender: Any, grant: Any, reason: str, **kwargs: Any) -> None:
        with self.lock:
            self.signals.append((grant.resource, clock.monotonic(), reason))
            self.changed.notify_all()

    def wait_for(self, on_lost: int, signals: int, timeout: float = 10.0) -> None:
        with self.changed:
            done = self.changed.wait_for(
                lambda: len(self.on_lost) >= on_lost and len(self.signals) >= signals, timeout=timeout
            )
        assert done, f"announcements: {self.on_lost} {self.signals}"


@pytest.fixture
def announced() -> Iterator[Announcements]:
    seen = Announcements()
    lease_lost.connect(seen.record_signal)
    try:
        yield seen
    finally:
        lease_lost.disconnect(seen.record_signal)


@contextmanager
def unrenewed(resource: str, ttl: float, **kwargs: Any) -> Iterator[LeaseHolder]:
    held = LeaseHolder(resource, ttl=ttl, timeout=0, **kwargs)
    assert held.try_acquire()
    try:
        yield held
    finally:
        held.release()


def test_loss_is_announced_at_the_deadline_without_the_body_asking(announced: Announcements) -> None:
    with unrenewed("r", 0.3, on_lost=announced.record_on_lost) as held:
        announced.wait_for(on_lost=1, signals=1)
        deadline = held._deadline
        [(who, on_lost_at, thread)] = announced.on_lost
        [(resource, signal_at, reason)] = announced.signals
        assert who is held and resource == "r" and reason == DEADLINE_PASSED
        assert thread.startswith("lease-lost:")  # delivered by the watchdog, not by the body
        assert deadline <= on_lost_at <= deadline + MARGIN
        assert deadline <= signal_at <= deadline + MARGIN
        assert held._lost.is_set() and held.lost_reason == DEADLINE_PASSED


def test_on_lost_runs_once_when_the_body_and_the_watchdog_notice_together(announced: Announcements) -> None:
    holders = [LeaseHolder(f"r{i}", ttl=0.3, timeout=0, on_lost=announced.record_on_lost) for i in range(20)]
    for held in holders:
        assert held.try_acquire()
    stop = threading.Event()

    def body(held: LeaseHolder) -> None:
        while not stop.is_set() and not held.lost:  # polls through the deadline, racing the watchdog
            pass

    threads = [threading.Thread(target=body, args=(held,)) for held in holders]
    for thread in threads:
        thread.start()
    try:
        announced.wait_for(on_lost=len(holders), signals=len(holders))
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)
        for held in holders:
            held.release()
    assert sorted(id(held) for held, _, _ in announced.on_lost) == sorted(id(held) for held in holders)
    assert sorted(resource for resource, _, _ in announced.signals) == sorted(h.resource for h in holders)


def test_a_blocking_on_lost_does_not_delay_another_holders_loss(announced: Announcements) -> None:
    unblock = threading.Event()
    entered = threading.Event()

    def stuck_on_lost(held: LeaseHolder) -> None:
        entered.set()
        unblock.wait(30)  # e.g. a callback writing to a database that stopped answering

    try:
        with (
            unrenewed("first", 0.2, on_lost=stuck_on_lost),
            unrenewed("second", 0.5, on_lost=announced.record_on_lost) as second,
        ):
            announced.wait_for(on_lost=1, signals=2)
            assert entered.is_set() and not unblock.is_set()
            [(_, on_lost_at, _)] = announced.on_lost
            assert second._deadline <= on_lost_at <= second._deadline + MARGIN
    finally:
        unblock.set()


def test_a_released_holder_is_forgotten_and_never_announced(announced: Announcements) -> None:
    watched_before = _watchdog.watched()
    # A TTL the body is sure to be inside of: at 0.2 s a loaded machine (CI's 5.2 leg) let the deadline
    # pass before the first check, and the watchdog announced the holder and forgot it.
    with lease("released", ttl=2.0, timeout=0, on_lost=announced.record_on_lost) as released:
        assert _watchdog.watched() == watched_before + 1
    assert _watchdog.watched() == watched_before
    # The watchdog works through deadlines in order: once a later one was announced, the released
    # holder's (earlier) deadline has come and gone without an announcement.
    with unrenewed("later", 2.0, on_lost=announced.record_on_lost) as later:
        announced.wait_for(on_lost=1, signals=1)
        assert later._deadline > released._deadline
    assert [held for held, _, _ in announced.on_lost] == [later]
    assert not released.lost
