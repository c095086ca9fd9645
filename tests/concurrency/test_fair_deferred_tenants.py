"""A fair queue's shares under real workers when many tenants have only deferred (or
snoozed, or scheduled-for-later) tasks.

Each claim visits at most ``limit`` keys, and a key with nothing due takes its turn anyway; the room
it leaves is filled by the plain pick (the oldest due tasks of the queue, whoever's they are). With
many tenants whose tasks all wait for later, most of every claim is that fill: the tenant with the
oldest backlog takes nearly all of it, and the other tenants with due tasks get one start per lap
of every key. The promise (docs/howto/pausing-and-keys.md, "Fair queues"): a tenant with due tasks
is not starved by another's backlog, whatever other tenants' deferred rows.


Found by breaker 33 (the bug hunt on fair queues, unique windows and debounce)."""

from __future__ import annotations

import datetime as dt

import pytest

from tasks.models import Task
from tests.helpers import wait_until
from tests.helpers.task_paths import NOOP
from tests.helpers.workers import Workers

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.one_stack]

QUEUE = "shares33"
SMALL = [f"s-{n}" for n in range(4)]
EACH = 10


def noisy_starts_before_the_small_tenants_are_done(workers: Workers, deferred_tenants: int) -> tuple[int, int]:
    Task.objects.bulk_enqueue(NOOP, [{}] * 2000, queue=QUEUE, fair_key="a-noisy")
    later = dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=1)
    for n in range(deferred_tenants):  # e.g. tenants whose tasks are snoozed or scheduled for later
        Task.objects.bulk_enqueue(NOOP, [{}], queue=QUEUE, fair_key=f"d-{n:03d}", run_after=later)
    small = [i for key in SMALL for i in Task.objects.bulk_enqueue(NOOP, [{}] * EACH, queue=QUEUE, fair_key=key)]
    args = ("--queues", QUEUE, "--concurrency", "4", "--batch-size", "16", "--no-scheduler")
    workers.start("shares", *args, LEASING_TEST_FAIR_QUEUES=QUEUE)
    wait_until(
        lambda: Task.objects.filter(pk__in=small, status="SUCCESSFUL").count() == len(small), 240, what="small done"
    )
    last = Task.objects.filter(pk__in=small).order_by("-started_at").values_list("started_at", flat=True)[0]
    noisy = Task.objects.filter(queue=QUEUE, fair_key="a-noisy", started_at__lte=last).count()
    return noisy, len(small)


def test_a_noisy_tenant_does_not_take_the_turns_of_tenants_with_nothing_due(workers: Workers) -> None:
    """Five tenants with due tasks (one with a backlog of 2,000, four with 10 each) and 100 with
    only deferred ones. While the four have due tasks, the five share the starts: the noisy one has
    started at most ten times a small one's share by the time they are all done (fair: about 10)."""
    noisy, small = noisy_starts_before_the_small_tenants_are_done(workers, deferred_tenants=100)
    assert noisy <= 10 * EACH, f"the noisy tenant started {noisy} tasks while 4 tenants started {small}"


def test_without_the_deferred_tenants_the_five_share_the_starts(workers: Workers) -> None:
    """The case shows what the test above measures: the same five tenants alone share the starts."""
    noisy, small = noisy_starts_before_the_small_tenants_are_done(workers, deferred_tenants=0)
    assert noisy <= 10 * EACH, f"the noisy tenant started {noisy} tasks while 4 tenants started {small}"
