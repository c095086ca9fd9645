"""Child tasks with real worker processes (tasks/steps.py ``spawn``, ``wait_for_task``; issue 58):
parents spawn a child each and suspend on it while two workers run them, one SIGKILLed mid-way and
replaced. Every parent resumes once with its own child's result; no spawn enqueued a second child
whatever attempt ran it again; each step around the wait committed once."""

from __future__ import annotations

import os
import signal
from collections import Counter

import pytest

from tasks.models import Task
from tests.helpers import wait_until
from tests.helpers.workers import Workers
from tests.testapp.models import Effect

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

H = "tests.testapp.handlers."
PARENTS = 16


def test_parents_resume_with_their_children_s_results_across_a_killed_worker(workers: Workers) -> None:
    parents = {
        Task.objects.enqueue(H + "parent_of", kwargs={"child": H + "add", "child_kwargs": {"a": n, "b": 1}}).id: n
        for n in range(PARENTS)
    }
    workers.start("cw-0", "--concurrency", "2", "--no-scheduler")
    workers.start("cw-1", "--concurrency", "2", "--no-scheduler")
    # Some parents have spawned and suspended: kill one worker wherever it is (a spawn, a wait, a child).
    wait_until(
        lambda: (
            Task.objects.filter(pk__in=parents, snoozes__gte=1).count() >= 4
            or not Task.objects.filter(pk__in=parents).exclude(status="SUCCESSFUL").exists()
        ),
        120,
        what="parents to suspend on their children",
    )
    os.kill(workers.procs["cw-0"].pid, signal.SIGKILL)
    workers.procs["cw-0"].wait(30)
    workers.start("cw-2", "--concurrency", "2", "--no-scheduler")
    wait_until(
        lambda: not Task.objects.filter(pk__in=parents).exclude(status="SUCCESSFUL").exists(),
        180,
        what="every parent to finish",
    )

    children = {child.awaited_by: child for child in Task.objects.filter(awaited_by__in=parents)}
    assert Counter(Task.objects.filter(awaited_by__in=parents).values_list("awaited_by", flat=True)) == {
        parent: 1 for parent in parents
    }, "one child per parent, whatever attempt ran its spawn"
    for parent in Task.objects.filter(pk__in=parents):
        child = children[parent.id]
        assert (child.status, child.return_value) == ("SUCCESSFUL", parents[parent.id] + 1)
        assert parent.return_value == {"child": child.id, "result": parents[parent.id] + 1}
    effects = Counter(Effect.objects.filter(task_id__in=parents).values_list("task_id", "phase"))
    assert dict(effects) == {(p, phase): 1 for p in parents for phase in ("before-child", "after-child")}
