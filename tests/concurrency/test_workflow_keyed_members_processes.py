"""Keyed workflow members run by real workers (``manage.py run_worker``).

A group whose members share a concurrency key (the common "at most N against this API" case): the
workers run every member, but no member's finish is ever counted on the workflow (the concurrency
admission's nested UPDATE consumes the workflow trigger's flag, see
tests/db/test_workflow_keyed_members.py), so the callback never runs and the workflow never ends.

Found by breaker 23 (the bug hunt on issue 23: workflows)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.models import Task, Worker, Workflow
from tasks.workflows import group, step
from tests.helpers import start_manage, stop_process, wait_until
from tests.testapp.models import Once

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

H = "tests.testapp.workflow_handlers."
FAST = ["--ttl", "5", "--recovery-interval", "0.2", "--poll-interval", "0.2", "-v", "2"]


def test_a_group_of_keyed_members_run_by_workers_ends_and_runs_its_callback(tmp_path: Path) -> None:
    members = [
        step(H + "member", n=n, seed=1, flaky=0.0, work=0.01).options(concurrency_key="api", concurrency_limit=2)
        for n in range(20)
    ]
    done = group(members, then=step(H + "callback", key="keyed-group")).enqueue()
    names = ["kw-a", "kw-b"]
    procs = [start_manage(tmp_path / f"{name}.log", "run_worker", "--worker-id", name, *FAST) for name in names]
    try:
        for name in names:
            wait_until(Worker.objects.filter(name=name).exists, 30, what=f"{name} up")
        members_done = Task.objects.filter(pk__in=done.task_ids[:-1], status="SUCCESSFUL")
        wait_until(lambda: members_done.count() == 20, 60, what="every member to succeed")
        # Every member is final: the callback is released and runs, and the workflow ends.
        wait_until(
            lambda: Workflow.objects.get(pk=done.id).status != "RUNNING",
            30,
            what=f"the workflow to end (now {Workflow.objects.get(pk=done.id).__dict__})",
        )
    finally:
        for proc in procs:
            stop_process(proc)
    row = Workflow.objects.get(pk=done.id)
    assert (row.status, row.remaining) == ("SUCCESSFUL", 0)
    assert Once.objects.get(key="keyed-group").runs == 1
