"""An attempt's start marker is sent within a round or two of the attempt's start, however long the
worker's poll interval (a clean-clone CI run waited 60 s on one that was not).

An executor puts a start marker in the mailbox without waking the dispatcher; the dispatcher looks
every MARKER_DELAY while it holds a claim that may start. The executor used to count the attempt
running in the ledger *before* putting its marker: a dispatcher reading the ledger in between saw no
claim left to start and no marker, and slept the whole poll interval with the marker unsent, so the
task read as not begun (and a SIGTERM test that waited for the start timed out). Each interleaving is
forced here with real threads, one task at a time, under a poll interval of an hour:

- "asleep": the executor puts its marker only once the dispatcher has gone to sleep;
- "between": the executor puts its marker and counts the attempt running after the dispatcher took
  the markers of its round and before it read the ledger to decide how long to sleep.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tasks.models import Task
from tasks.worker import dispatcher as dispatcher_module
from tasks.worker.ledger import Ledger
from tasks.worker.mailbox import Mailbox
from tasks.worker.process import Worker
from tests.helpers import wait_until, worker_in_thread
from tests.testapp.models import Gate

pytestmark = pytest.mark.django_db(transaction=True)

HOUR = 3600.0
HANDLERS = {"thread": "tests.testapp.handlers.block", "event loop": "tests.testapp.handlers.async_gate"}


class Interleaving:
    """Holds the executor's first start at the chosen point of the dispatcher's loop."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
        self.where = where
        self.once = threading.Event()  # the first start has been forced; the rest run freely
        self.slept = threading.Event()  # the dispatcher entered a wait
        self.waiting = threading.Event()  # the executor is at its start, held
        self.proceed = threading.Event()  # the dispatcher took its round's markers: go on
        self.begun = threading.Event()  # the executor counted the attempt running
        self.failures: list[str] = []
        self._patch(monkeypatch)

    def _hold(self, event: threading.Event, what: str) -> None:
        if not event.wait(30):
            self.failures.append(f"never saw {what}")

    def _patch(self, monkeypatch: pytest.MonkeyPatch) -> None:
        started: Callable[[Mailbox, Any], None] = Mailbox.started
        wait: Callable[[Mailbox, float], bool] = Mailbox.wait
        begin: Callable[[Ledger, Any], None] = Ledger.begin
        due_starts = dispatcher_module.Dispatcher._due_starts

        def held_started(mailbox: Mailbox, execution: Any) -> None:
            if not self.once.is_set():
                if self.where == "asleep":
                    self.slept.clear()
                    self._hold(self.slept, "the dispatcher go to sleep")
                else:
                    self.waiting.set()
                    self._hold(self.proceed, "the dispatcher take its markers")
            started(mailbox, execution)

        def noted_wait(mailbox: Mailbox, seconds: float) -> bool:
            self.slept.set()
            return wait(mailbox, seconds)

        def noted_begin(ledger: Ledger, execution: Any) -> None:
            begin(ledger, execution)
            if self.waiting.is_set() or self.where == "asleep":
                self.begun.set()

        def held_due_starts(dispatcher: Any, outcomes: list[Any]) -> Any:
            due = due_starts(dispatcher, outcomes)
            if self.where == "between" and self.waiting.is_set() and not self.once.is_set():
                self.proceed.set()  # the executor puts its marker and counts the attempt running now
                self._hold(self.begun, "the executor count the attempt running")
                self.once.set()
            return due

        monkeypatch.setattr(Mailbox, "started", held_started)
        monkeypatch.setattr(Mailbox, "wait", noted_wait)
        monkeypatch.setattr(Ledger, "begin", noted_begin)
        monkeypatch.setattr(dispatcher_module.Dispatcher, "_due_starts", held_due_starts)


@pytest.fixture(params=["asleep", "between"])
def interleaving(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Interleaving]:
    forced = Interleaving(monkeypatch, request.param)
    yield forced
    assert not forced.failures


@pytest.mark.parametrize("kind", sorted(HANDLERS))
def test_a_start_marker_is_sent_without_waiting_out_the_poll_interval(kind: str, interleaving: Interleaving) -> None:
    gate = f"marker-{kind}-{interleaving.where}"
    Gate.objects.create(key=gate)
    task_id = Task.objects.enqueue(HANDLERS[kind], kwargs={"gate": gate}).id
    worker = Worker(
        concurrency=1, ttl=30, poll_interval=HOUR, recovery=False, scheduler=False, install_signal_handlers=False
    )
    with worker_in_thread(worker):
        task = wait_until(
            lambda: Task.objects.filter(pk=task_id, attempt_started=True).first(),
            30,
            what="the attempt's start marker (the poll interval is an hour)",
        )
        if interleaving.where == "asleep":
            interleaving.once.set()
        assert task.status == "RUNNING" and task.attempts == 1
        Gate.objects.filter(key=gate).update(open=True)
        done = wait_until(lambda: Task.objects.filter(pk=task_id, status="SUCCESSFUL").first(), 30, what="the finish")
    assert done.attempts == 1 and done.worker_ids == [task.worker_ids[0]]
    assert interleaving.begun.is_set()
