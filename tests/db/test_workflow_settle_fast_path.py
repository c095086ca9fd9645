"""The workflow settle fast path (migration 0017) on real PostgreSQL.

Found by breaker 31 (the bug hunt on the workflow settle fast path and callback_only groups)."""

from __future__ import annotations

import pytest
from django.db import connection, transaction

from tasks.models import Task
from tasks.models import Workflow as WorkflowRow
from tasks.workflows import Workflow, WorkflowKind, group, step
from tests.helpers.task_paths import NOOP

pytestmark = pytest.mark.django_db(transaction=True)


def status_of(*ids: int | None) -> list[str]:
    found: dict[int | None, str] = dict(Task.objects.filter(pk__in=ids).values_list("id", "status"))
    return [found[i] for i in ids]


def finish_all(worker: str = "w1") -> list[int]:
    claimed = Task.objects.claim(worker, limit=100)
    Task.objects.complete_many(worker, [(t.id, t.token, "null") for t in claimed])
    return [t.id for t in claimed]


def drain() -> None:
    for _ in range(20):
        if not finish_all():
            return


def test_a_group_with_a_step_after_its_callback_releases_that_step() -> None:
    """group(...) returns a Workflow whose add() still takes steps: one after the callback is an
    edge callback_only must not skip."""
    flow = group([step(NOOP) for _ in range(2)], then=step(NOOP))
    assert flow.callback is not None
    after_callback = flow.add(step(NOOP), after=[flow.callback])
    done = flow.enqueue()
    drain()
    assert status_of(*done.task_ids) == ["SUCCESSFUL"] * 4, done.task_ids[after_callback]
    assert WorkflowRow.objects.get(pk=done.id).status == "SUCCESSFUL"


def test_a_group_with_a_step_after_a_member_releases_that_step() -> None:
    flow = group([step(NOOP) for _ in range(2)], then=step(NOOP))
    flow.add(step(NOOP), after=[0])
    done = flow.enqueue()
    drain()
    assert status_of(*done.task_ids) == ["SUCCESSFUL"] * 4
    assert WorkflowRow.objects.get(pk=done.id).status == "SUCCESSFUL"


def test_a_group_kind_graph_with_edges_and_no_callback_runs_every_step() -> None:
    flow = Workflow("g", kind=WorkflowKind.GROUP)
    a = flow.add(step(NOOP))
    flow.add(step(NOOP), after=[a])
    done = flow.enqueue()
    drain()
    assert status_of(*done.task_ids) == ["SUCCESSFUL"] * 2


def test_a_hand_built_group_whose_callback_waits_for_some_members_waits_for_exactly_those() -> None:
    """callback_only counts every member's success on the callback: only right when the callback
    waits for every member."""
    flow = Workflow("g", kind=WorkflowKind.GROUP)
    waited = flow.add(step(NOOP))
    free = flow.add(step(NOOP))
    flow.callback = flow.add(step(NOOP), after=[waited])
    done = flow.enqueue()
    assert not WorkflowRow.objects.get(pk=done.id).callback_only
    claimed = {t.id: t for t in Task.objects.claim("w1", limit=10)}
    assert set(claimed) == {done.task_ids[waited], done.task_ids[free]}
    Task.objects.complete_many("w1", [(done.task_ids[free], claimed[done.task_ids[free]].token, "null")])
    assert status_of(done.callback_id) == ["AWAITING"]  # the member it does not wait for is no count of its
    Task.objects.complete_many("w1", [(done.task_ids[waited], claimed[done.task_ids[waited]].token, "null")])
    assert status_of(done.callback_id) == ["READY"]


def test_a_member_finished_in_a_rolled_back_savepoint_leaves_no_count_behind() -> None:
    done = group([step(NOOP) for _ in range(2)], then=step(NOOP)).enqueue()
    claimed = {t.id: t for t in Task.objects.claim("w1", limit=10)}
    first, second = done.task_ids[:2]
    with transaction.atomic():
        try:
            with transaction.atomic():
                Task.objects.complete_many("w1", [(first, claimed[first].token, "null")])
                raise RuntimeError("roll the savepoint back")
        except RuntimeError:
            pass
        with connection.cursor() as cursor:
            cursor.execute("SELECT current_setting('leasing.workflow_settle', true)")
            assert cursor.fetchone()[0] in (None, "", "0")
        assert status_of(first, done.callback_id) == ["RUNNING", "AWAITING"]
        Task.objects.complete_many("w1", [(second, claimed[second].token, "null")])
    assert WorkflowRow.objects.get(pk=done.id).callback_waiting == 1
    Task.objects.complete_many("w1", [(first, claimed[first].token, "null")])
    assert status_of(done.callback_id) == ["READY"]


def test_two_modifying_ctes_on_tasks_settle_both_moves() -> None:
    done = group([step(NOOP) for _ in range(2)], then=step(NOOP)).enqueue()
    first, second = done.task_ids[:2]
    with connection.cursor() as cursor:
        cursor.execute(
            "WITH a AS (UPDATE tasks_task SET status = 'SUCCESSFUL', finished_at = now() WHERE id = %s RETURNING id),"
            " b AS (UPDATE tasks_task SET status = 'SUCCESSFUL', finished_at = now() WHERE id = %s RETURNING id)"
            " SELECT (SELECT count(*) FROM a) + (SELECT count(*) FROM b)",
            [first, second],
        )
        assert cursor.fetchone()[0] == 2
        cursor.execute("SELECT current_setting('leasing.workflow_settle', true)")
        assert cursor.fetchone()[0] in (None, "", "0")
    row = WorkflowRow.objects.get(pk=done.id)
    assert (row.callback_waiting, row.remaining, row.failed) == (0, 1, 0)
    assert status_of(done.callback_id) == ["READY"]
