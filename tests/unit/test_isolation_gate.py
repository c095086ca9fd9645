"""The worker's isolation gate: an isolated attempt runs alone; a stuck one gives its slot up."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

from tasks.worker.isolation import IsolationGate


def attempt() -> Any:
    return SimpleNamespace(gate_slot=None)


def test_an_isolated_attempt_waits_for_the_running_ones_and_blocks_new_ones() -> None:
    gate = IsolationGate()
    stop = threading.Event()
    running = attempt()
    assert gate.enter_shared(running, stop)
    isolated = attempt()
    entered = threading.Event()

    def isolate() -> None:
        if gate.enter_exclusive(isolated, time.monotonic() + 30, time.monotonic):
            entered.set()

    waiter = threading.Thread(target=isolate)
    waiter.start()
    newcomer = attempt()
    late_entry = threading.Event()

    def join_later() -> None:
        if gate.enter_shared(newcomer, stop):
            late_entry.set()

    joiner = threading.Thread(target=join_later)
    assert not entered.wait(0.2)  # the running attempt still holds the process
    joiner.start()
    assert not late_entry.wait(0.2)  # writer preference: nothing new starts while it waits
    gate.release(running)
    assert entered.wait(5)
    assert not late_entry.wait(0.2)  # it runs alone
    gate.release(isolated)
    assert late_entry.wait(5)
    gate.release(newcomer)
    waiter.join(5)
    joiner.join(5)


def test_an_isolated_attempt_gives_up_at_its_deadline() -> None:
    gate = IsolationGate()
    stuck = attempt()
    assert gate.enter_shared(stuck, threading.Event())
    isolated = attempt()
    assert not gate.enter_exclusive(isolated, time.monotonic() + 0.2, time.monotonic)
    assert isolated.gate_slot is None
    assert gate.enter_shared(attempt(), threading.Event())  # nothing left waiting


def test_release_is_idempotent_so_an_abandoned_attempt_frees_its_slot_once() -> None:
    gate = IsolationGate()
    zombie = attempt()
    assert gate.enter_exclusive(zombie, time.monotonic() + 1, time.monotonic)
    gate.release(zombie)  # abandoned past its timeout
    other = attempt()
    assert gate.enter_exclusive(other, time.monotonic() + 1, time.monotonic)
    gate.release(zombie)  # the stuck thread returns at last: must not free the other's slot
    assert other.gate_slot == "exclusive"
    assert not gate.enter_exclusive(attempt(), time.monotonic() + 0.1, time.monotonic)


def test_a_coroutine_enters_without_waiting_or_not_at_all() -> None:
    """The event loop must never block on the gate: try_enter_shared answers at once."""
    gate = IsolationGate()
    coroutine, isolated = attempt(), attempt()
    assert gate.try_enter_shared(coroutine)
    gate.release(coroutine)
    assert gate.enter_exclusive(isolated, time.monotonic() + 1, time.monotonic)
    assert not gate.try_enter_shared(coroutine)  # an isolated attempt runs: refused, not queued
    assert coroutine.gate_slot is None
    gate.release(isolated)
    assert gate.try_enter_shared(coroutine)
    assert coroutine.gate_slot == "shared"
    gate.release(coroutine)
    assert gate.enter_exclusive(isolated, time.monotonic() + 1, time.monotonic)  # nothing left inside
