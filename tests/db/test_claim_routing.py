"""A worker keeps a claim by the capacity it was sized by (tasks/worker/dispatcher.py, ``round``'s
``sized_by``). The capacity moves during a round: a claim that comes back short ends the backlog's
second batch of prefetch (``positions.full``). Measured anew when the claim was routed, part of each
short claim sized under a backlog went back at once, unstarted, to be claimed again by the next round
(833 tasks in 45 s at 4,000/s offered: docs/explanation/benchmarks.md).

A short claim under a backlog needs a steady trickle of tasks, which no drain reproduces; here the
capacity is made to move by the test instead: any capacity read while a round is under way is none
at all. Kept by the claim's own capacity, every task runs and none is handed back; measured anew,
every claim would go back whole and no task would ever run."""

from __future__ import annotations

import math
import threading
from typing import Any

import pytest

from tasks.models import Task, TaskStatus
from tasks.worker.dispatcher import Dispatcher
from tasks.worker.process import Worker
from tasks.worker.sizing import Capacity
from tests.helpers import wait_until, worker_in_thread

pytestmark = pytest.mark.django_db(transaction=True)

ASYNC_SLEEP = "tests.testapp.handlers.async_sleep"


@pytest.fixture
def capacity_gone_within_a_round(monkeypatch: pytest.MonkeyPatch) -> None:
    in_round = threading.local()
    original_round, original_capacity = Dispatcher.round, Dispatcher.capacity

    def round_(self: Dispatcher, *args: Any, **kwargs: Any) -> Any:
        in_round.active = True
        try:
            return original_round(self, *args, **kwargs)
        finally:
            in_round.active = False

    def capacity(self: Dispatcher) -> Capacity:
        if getattr(in_round, "active", False):
            return Capacity(slots=0, prefetch=0, async_slots=0, async_prefetch=0)
        return original_capacity(self)

    monkeypatch.setattr(Dispatcher, "round", round_)
    monkeypatch.setattr(Dispatcher, "capacity", capacity)


def test_a_claim_is_kept_by_the_capacity_it_was_sized_by(capacity_gone_within_a_round: None) -> None:
    ids = [Task.objects.enqueue(ASYNC_SLEEP, kwargs={"seconds": 0}, queue="routed").id for _ in range(40)]
    worker = Worker(
        concurrency=1,
        async_concurrency=8,
        queues=["routed"],
        ttl=30,
        poll_interval=0.05,
        install_signal_handlers=False,
        worker_id="routed",
    )
    # The mix of kinds is known from the start (every task is a coroutine) and never probed for: a
    # claim sized for a mix still being learned, or a probe for the thread's kind while the event
    # loop is full, brings coroutines no slot will start, and those go back by design (``fit``):
    # as many or as few as the machine's speed lets the rounds and the probes interleave (a
    # clean-clone run on a loaded machine handed back 13 of 53). Here only the capacity moves.
    worker.pace.async_share = 1.0
    worker.pace.next_probe = math.inf
    with worker_in_thread(worker):
        done = Task.objects.filter(pk__in=ids, status=TaskStatus.SUCCESSFUL)
        wait_until(lambda: done.count() == len(ids), 60, what="every task run")
    assert worker.session.handed_back == 0
    assert worker.session.stats["claimed"] == len(ids)
