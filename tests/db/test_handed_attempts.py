"""The worker's row names the attempts it handed to its executors (the round statement's ``handing``
CTE), and recovery counts a named attempt whose start marker never committed as one that may have
run: charged and recorded as a crash, never as a claim returned unstarted (invariant 14); what was
not named goes back uncharged (invariant 10). tests/concurrency/test_sigkill_accounting.py holds a
real worker process to the same under a SIGKILL."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from django.utils import timezone

from tasks.models import Task, Worker
from tasks.worker.handoff import HandOff, lazy_start
from tasks.worker.ledger import Ledger
from tests.helpers.task_paths import NOOP

pytestmark = pytest.mark.django_db


def handed_by(worker: str) -> list[int]:
    return list(Worker.objects.filter(id=worker).values_list("handed", flat=True).get() or [])


def expire_and_recover(*task_ids: int) -> dict[int, Any]:
    Task.objects.filter(pk__in=task_ids).update(expires_at=timezone.now() - dt.timedelta(seconds=1))
    return {r.id: r for r in Task.objects.recover_expired()}


def test_a_round_names_what_it_hands_over_and_only_that() -> None:
    Worker.objects.create(id="w1", hostname="h", pid=1, concurrency=2)
    ids = Task.objects.bulk_enqueue(NOOP, [{}] * 5)
    _done, _started, claimed = Task.objects.finish_start_claim("w1", [], limit=5, handed=[7], release=3)
    assert [t.id for t in claimed] == ids
    # The names kept, then the first three claimed rows in the order the worker routes them.
    assert handed_by("w1") == [7, *[t.token for t in claimed[:3]]]
    # Without names to write the row keeps what it had.
    Task.objects.bulk_enqueue(NOOP, [{}])
    Task.objects.finish_start_claim("w1", [], limit=1)
    assert handed_by("w1") == [7, *[t.token for t in claimed[:3]]]


def test_a_named_attempt_whose_start_never_committed_is_recovered_as_a_charged_crash() -> None:
    Worker.objects.create(id="w1", hostname="h", pid=1, concurrency=2)
    ran, waited = Task.objects.bulk_enqueue(NOOP, [{}] * 2)
    _done, _started, claimed = Task.objects.finish_start_claim("w1", [], limit=2, handed=[], release=1)
    assert handed_by("w1") == [claimed[0].token]
    recovered = expire_and_recover(ran, waited)
    assert recovered[ran].kind == "vanished" and recovered[waited].kind == "returned"
    handed, kept = Task.objects.get(pk=ran), Task.objects.get(pk=waited)
    # Handed over: it may have run. Its start is charged now, and its end is the crash of an attempt.
    assert (handed.attempts, handed.unstarted_returns, handed.shared_crashes) == (1, 0, 1)
    assert handed.worker_ids == ["w1"]
    assert handed.started_at is not None and handed.last_attempted_at is not None
    assert [(e["kind"], e["attempt"], e["token"]) for e in handed.errors] == [("vanished", 1, claimed[0].token)]
    # Never handed over: it goes back uncharged, as a claim that never started.
    assert (kept.attempts, kept.unstarted_returns, kept.shared_crashes, kept.worker_ids) == (0, 1, 0, [])
    assert [e["kind"] for e in kept.errors] == ["returned"]


def test_a_named_attempt_whose_marker_committed_is_charged_once() -> None:
    Worker.objects.create(id="w1", hostname="h", pid=1, concurrency=1)
    [task_id] = Task.objects.bulk_enqueue(NOOP, [{}])
    _done, _started, [claimed] = Task.objects.finish_start_claim("w1", [], limit=1, handed=[], release=1)
    assert Task.objects.start(claimed.id, "w1", claimed.token) is not None
    assert expire_and_recover(task_id)[task_id].kind == "vanished"
    row = Task.objects.get(pk=task_id)
    assert (row.attempts, row.worker_ids, row.errors[-1]["attempt"]) == (1, ["w1"], 1)


def test_a_name_of_an_earlier_grant_or_another_worker_counts_for_nothing() -> None:
    Worker.objects.create(id="w1", hostname="h", pid=1, concurrency=1)
    Worker.objects.create(id="w2", hostname="h", pid=2, concurrency=1)
    [task_id] = Task.objects.bulk_enqueue(NOOP, [{}])
    _done, _started, [first] = Task.objects.finish_start_claim("w1", [], limit=1)
    Worker.objects.filter(id="w2").update(handed=[first.token])  # a name on another worker's row
    assert expire_and_recover(task_id)[task_id].kind == "returned"
    _done, _started, [again] = Task.objects.finish_start_claim("w1", [], limit=1, handed=[first.token], release=0)
    assert again.token != first.token  # tokens are never reused: the old name does not cover the new grant
    recovered = expire_and_recover(task_id)[task_id]
    assert recovered.kind == "returned"


def test_a_start_of_its_own_is_never_named(settings: Any) -> None:
    """A suspect's start (START_SQL) and a rate-limited task's (RATE_START_SQL) commit before its
    handler runs: until then it truly has not begun, and naming it would charge it for nothing."""
    settings.LEASING_TASKS = {**getattr(settings, "LEASING_TASKS", {}), "RATE_LIMITS": {"limited": "5/s"}}
    Worker.objects.create(id="w1", hostname="h", pid=1, concurrency=4)
    suspect = Task.objects.enqueue(NOOP, priority=9).id
    Task.objects.filter(pk=suspect).update(unstarted_returns=1)
    Task.objects.enqueue(NOOP, priority=8, rate_key="k", rate_limit="5/s")
    Task.objects.enqueue(NOOP, priority=7, queue="limited")
    plain = Task.objects.enqueue(NOOP, priority=6).id
    queues = ["default", "limited"]
    plan = HandOff(Ledger(), queues=queues).plan({False: 4, True: 0}, claim=4, async_share=0.0, has_loop=False)
    assert plan.rated_queues == {"limited"}
    _done, _started, claimed = Task.objects.finish_start_claim(
        "w1", [], limit=4, queues=queues, handed=plan.names, release=plan.release, rated_queues=list(plan.rated_queues)
    )
    assert len(claimed) == 4
    # The worker and the statement agree on which rows are named (it hands over exactly those).
    assert [t.id for t in claimed if lazy_start(t, plan.rated_queues)] == [plain]
    assert handed_by("w1") == [t.token for t in claimed if t.id == plain]
