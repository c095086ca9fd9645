"""Workflows on one connection: chains, groups with a callback, dependency graphs, ad hoc
``depends_on``, cancellation, requeue, keys, recovery, retention (tasks/lifecycle/workflows.py).
The processes and the crashes are in tests/concurrency/test_workflow_processes.py."""

from __future__ import annotations

import datetime as dt
import json
import threading
from typing import Any

import pytest
from django.db import connection, connections, transaction
from django.test.utils import CaptureQueriesContext

from tasks.compat import TaskResultStatus, default_task_backend
from tasks.lifecycle.workflows import WorkflowError
from tasks.maintenance import retention
from tasks.models import Failure, Task, TaskDependency, TaskStatus, Workflow
from tasks.workflows import Workflow as Flow
from tasks.workflows import chain, group, parent_results, step
from tests.helpers import wait_until
from tests.helpers.task_paths import NOOP

pytestmark = pytest.mark.django_db(transaction=True)

ECHO = "tests.testapp.handlers.echo"


def status_of(*ids: int | None) -> list[str]:
    found: dict[int | None, str] = dict(Task.objects.filter(pk__in=ids).values_list("id", "status"))
    return [found[i] for i in ids]


def run_one(worker: str = "w1", *, value: Any = None, fail: bool = False, retry: bool = False) -> int:
    """Claim the next task and finish it as told; returns its id."""
    (task,) = Task.objects.claim(worker, limit=1)
    if fail:
        assert Task.objects.fail(Failure(task.id, task.token, "E", "boom", retry=retry), worker) is not None
    else:
        assert Task.objects.complete_many(worker, [(task.id, task.token, json.dumps(value))])
    return task.id


def flow(workflow_id: int) -> Workflow:
    return Workflow.objects.get(pk=workflow_id)


# -- chains -------------------------------------------------------------------------------------


def test_a_chain_runs_its_steps_in_order_each_given_the_last_result() -> None:
    done = chain(step(ECHO, 1), step(ECHO), step(ECHO)).enqueue()
    a, b, c = done.task_ids
    assert status_of(a, b, c) == ["READY", "AWAITING", "AWAITING"]
    assert Task.objects.claim("w1", limit=10)[0].id == a  # nothing else is claimable
    Task.objects.filter(pk=a).update(status="READY")  # put it back for run_one
    assert run_one(value=10) == a
    assert status_of(b, c) == ["READY", "AWAITING"]
    assert Task.objects.get(pk=b).args == [10]
    assert run_one(value=20) == b
    assert Task.objects.get(pk=c).args == [20]
    assert run_one(value=30) == c
    row = flow(done.id)
    assert (row.status, row.remaining, row.failed, row.total, row.callback_id) == ("SUCCESSFUL", 0, 0, 3, c)
    assert row.finished_at >= Task.objects.get(pk=c).finished_at


def test_a_step_that_fails_for_good_cancels_the_rest_with_the_reason() -> None:
    done = chain(step(NOOP), step(NOOP), step(NOOP), step(NOOP)).enqueue()
    a, b, c, d = done.task_ids
    run_one()
    run_one(fail=True, retry=True)  # a retry: the chain waits
    assert status_of(b, c, d) == ["READY", "AWAITING", "AWAITING"]
    Task.objects.filter(pk=b).update(run_after=dt.datetime(2000, 1, 1, tzinfo=dt.timezone.utc))
    run_one(fail=True, retry=False)
    assert status_of(a, b, c, d) == ["SUCCESSFUL", "FAILED", "CANCELLED", "CANCELLED"]
    for row in Task.objects.filter(pk__in=[c, d]):
        entry = row.errors[-1]
        assert entry["exception_class_path"] == "tasks.exceptions.DependencyFailed"
        assert entry["kind"] == "dependency" and row.finished_at is not None and row.attempts == 0
    assert f"task {b}" in Task.objects.get(pk=c).errors[-1]["message"]
    ended = flow(done.id)
    assert (ended.status, ended.remaining, ended.failed) == ("FAILED", 0, 3)


# -- groups -------------------------------------------------------------------------------------


def test_a_group_callback_is_released_by_the_statement_that_finishes_the_last_member() -> None:
    done = group([step(NOOP, n=i) for i in range(4)], then=step(ECHO), pipe=True).enqueue()
    members, callback = done.task_ids[:4], done.task_ids[4]
    assert done.callback_id == callback
    claimed = Task.objects.claim("w1", limit=10)
    assert sorted(t.id for t in claimed) == members  # the callback is not claimable
    Task.objects.complete_many("w1", [(t.id, t.token, json.dumps(t.id)) for t in claimed[:3]])
    assert status_of(callback) == ["AWAITING"]
    assert Task.objects.get(pk=callback).parents_left == 1  # counted on the workflow row
    assert flow(done.id).remaining == 2
    with connection.cursor() as cursor:
        cursor.execute("SELECT clock_timestamp()")
        (before,) = cursor.fetchone()
    Task.objects.complete_many("w1", [(claimed[3].id, claimed[3].token, json.dumps(claimed[3].id))])
    released = Task.objects.get(pk=callback)
    assert (released.status, released.waiting_on, released.args) == ("READY", 0, [members])
    assert released.run_after >= before  # behind what was queued before it was released


def test_members_finished_in_one_statement_release_the_callback_once() -> None:
    done = group([step(NOOP) for _ in range(5)], then=step(NOOP)).enqueue()
    claimed = Task.objects.claim("w1", limit=10)
    assert Task.objects.complete_many("w1", [(t.id, t.token, "null") for t in claimed]) == {
        (t.id, t.token) for t in claimed
    }
    assert status_of(done.callback_id) == ["READY"]
    assert Task.objects.get(pk=done.callback_id).waiting_on == 0
    assert flow(done.id).remaining == 1


def test_a_dependant_joining_a_group_makes_its_members_settle_through_their_edges() -> None:
    """A group's members' successes skip the edges while the callback is their one dependant
    (``callback_only``); a ``depends_on`` on a member clears it, and that member's finish then
    releases both the new dependant and the callback's count."""
    done = group([step(NOOP) for _ in range(3)], then=step(NOOP)).enqueue()
    first, second, third = done.task_ids[:3]
    assert flow(done.id).callback_only
    claimed = {t.id: t for t in Task.objects.claim("w1", limit=10)}
    Task.objects.complete_many("w1", [(first, claimed[first].token, "null")])  # the edge-less path
    assert (flow(done.id).callback_waiting, flow(done.id).remaining) == (2, 3)
    late = Task.objects.enqueue(NOOP, depends_on=[second])
    assert not flow(done.id).callback_only
    assert (Task.objects.get(pk=late.id).workflow_id, status_of(late.id)) == (done.id, ["AWAITING"])
    Task.objects.complete_many("w1", [(second, claimed[second].token, "null")])
    assert status_of(late.id, done.callback_id) == ["READY", "AWAITING"]
    assert flow(done.id).callback_waiting == 1
    Task.objects.complete_many("w1", [(third, claimed[third].token, "null")])
    assert status_of(done.callback_id) == ["READY"]
    assert Task.objects.get(pk=done.callback_id).waiting_on == 0


def test_statements_that_move_no_member_call_no_settlement() -> None:
    """The settle trigger's WHEN clause skips every statement that moved no member (a plain task's
    whole life, a member's claim); a member's finish calls it once."""
    plain = Task.objects.enqueue(NOOP)
    done = group([step(NOOP)], then=step(NOOP)).enqueue()
    member = done.task_ids[0]

    def settle_calls() -> int:  # this transaction's calls (pg_stat_xact_*: nothing to wait for)
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT COALESCE(sum(calls), 0) FROM pg_stat_xact_user_functions"
                " WHERE funcname = 'tasks_workflow_settle'"
            )
            return int(cursor.fetchone()[0])

    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("SET LOCAL track_functions = 'pl'")
        claimed = {t.id: t for t in Task.objects.claim("w1", limit=10)}
        assert set(claimed) == {plain.id, member}
        Task.objects.complete_many("w1", [(plain.id, claimed[plain.id].token, "null")])
        assert settle_calls() == 0
        Task.objects.complete_many("w1", [(member, claimed[member].token, "null")])
        assert settle_calls() == 1
    assert status_of(done.callback_id) == ["READY"]


def test_a_failed_member_cancels_the_callback_at_once_and_the_others_still_run() -> None:
    done = group([step(NOOP) for _ in range(3)], then=step(NOOP)).enqueue()
    run_one(fail=True)
    assert status_of(done.callback_id) == ["CANCELLED"]
    run_one()
    run_one()
    row = flow(done.id)
    assert (row.status, row.remaining, row.failed) == ("FAILED", 0, 2)


def test_under_run_the_callback_runs_anyway_and_reads_every_outcome() -> None:
    done = group([step(NOOP) for _ in range(3)], then=step(ECHO), on_failure="run", pipe=True).enqueue()
    a, b, c = done.task_ids[:3]
    run_one(value="x")
    run_one(fail=True)
    assert status_of(done.callback_id) == ["AWAITING"]
    run_one(value={"z": 1})
    callback = Task.objects.get(pk=done.callback_id)
    assert callback.status == "READY" and callback.args == [["x", None, {"z": 1}]]
    outcomes = parent_results(done.callback_id)
    assert [(p.id, p.status, p.return_value) for p in outcomes] == [
        (a, "SUCCESSFUL", "x"),
        (b, "FAILED", None),
        (c, "SUCCESSFUL", {"z": 1}),
    ]
    assert outcomes[1].errors[-1]["message"] == "boom" and not outcomes[1].succeeded
    run_one()
    assert flow(done.id).status == "FAILED"  # a member failed, though the callback ran


def test_a_group_of_ten_thousand_is_enqueued_in_four_statements() -> None:
    with CaptureQueriesContext(connection) as queries:
        done = group([step(NOOP, n=i) for i in range(10_000)], then=step(NOOP)).enqueue()
    statements = [q["sql"] for q in queries.captured_queries if q["sql"] not in ("BEGIN", "COMMIT")]
    assert len(statements) == 4, [s[:80] for s in statements]  # ids, workflow, members, edges
    assert Task.objects.filter(workflow_id=done.id).count() == 10_001
    assert TaskDependency.objects.filter(child_id=done.callback_id).count() == 10_000


# -- graphs -------------------------------------------------------------------------------------


def test_a_diamond_waits_for_both_branches() -> None:
    graph = Flow("diamond")
    a = graph.add(step(NOOP))
    b = graph.add(step(NOOP), after=[a])
    c = graph.add(step(NOOP), after=[a])
    d = graph.add(step(ECHO), after=[b, c], pipe=True)
    done = graph.enqueue()
    ids = done.task_ids
    run_one(value="a")
    assert status_of(*ids) == ["SUCCESSFUL", "READY", "READY", "AWAITING"]
    run_one(value="b")
    assert status_of(ids[d]) == ["AWAITING"]
    run_one(value="c")
    assert Task.objects.get(pk=ids[d]).args == [["b", "c"]]
    assert flow(done.id).name == "diamond"


def test_cycles_unknown_steps_and_bad_options_are_refused_and_write_nothing() -> None:
    graph = Flow()
    a = graph.add(step(NOOP))
    b = graph.add(step(NOOP), after=[a])
    graph._nodes[a].after.append(b)  # a cycle the public API cannot build step by step
    with pytest.raises(WorkflowError, match="cycle"):
        graph.enqueue()
    other = Flow()
    other.add(step(NOOP), after=[3])
    with pytest.raises(WorkflowError, match="not in the workflow"):
        other.enqueue()
    with pytest.raises(WorkflowError, match="on_failure"):
        Flow().add(step(NOOP), on_failure="ignore")
    with pytest.raises(WorkflowError, match="at least one"):
        Flow().enqueue()
    with pytest.raises(ValueError, match="priority"):
        chain(step(NOOP), step(NOOP).options(priority=1000)).enqueue()
    assert not Task.objects.exists() and not Workflow.objects.exists() and not TaskDependency.objects.exists()


def test_a_failure_cancels_down_the_graph_and_releases_what_runs_anyway() -> None:
    graph = Flow()
    a = graph.add(step(NOOP))
    b = graph.add(step(NOOP), after=[a])  # cancel
    c = graph.add(step(NOOP), after=[b])  # cancel, through b
    d = graph.add(step(NOOP), after=[c], on_failure="run")  # runs once c is settled
    e = graph.add(step(NOOP), after=[a], on_failure="run")
    ids = graph.enqueue().task_ids
    run_one(fail=True)
    assert status_of(*ids) == ["FAILED", "CANCELLED", "CANCELLED", "READY", "READY"]
    assert [p.status for p in parent_results(ids[d])] == ["CANCELLED"]
    assert ids[e] and ids[b]


def test_a_workflow_in_a_rolled_back_transaction_leaves_nothing() -> None:
    def enqueue_then_fail() -> None:
        with transaction.atomic():
            chain(step(NOOP), step(NOOP)).enqueue()
            group([step(NOOP)], then=step(NOOP)).enqueue()
            raise RuntimeError("the caller's transaction fails")

    with pytest.raises(RuntimeError):
        enqueue_then_fail()
    assert not Task.objects.exists() and not Workflow.objects.exists() and not TaskDependency.objects.exists()


# -- depends_on -----------------------------------------------------------------------------------


def test_depends_on_existing_tasks_waits_for_them_and_joins_their_workflow() -> None:
    p1 = Task.objects.enqueue(NOOP)
    p2 = Task.objects.enqueue(NOOP)
    child = Task.objects.enqueue(ECHO, depends_on=[p1, p2.id], pipe=True)
    row = Task.objects.get(pk=child.id)
    assert (row.status, row.waiting_on) == ("AWAITING", 2)
    workflow = row.workflow_id
    assert set(Task.objects.filter(workflow_id=workflow).values_list("id", flat=True)) == {p1.id, p2.id, child.id}
    assert (flow(workflow).total, flow(workflow).remaining) == (3, 3)
    run_one(value=1)
    run_one(value=2)
    row.refresh_from_db()
    assert (row.status, row.args) == ("READY", [[1, 2]])
    later = Task.objects.enqueue(NOOP, depends_on=[child])  # joins the same workflow
    assert Task.objects.get(pk=later.id).workflow_id == workflow
    assert flow(workflow).total == 4


def test_depends_on_finished_tasks_settles_at_enqueue() -> None:
    done = Task.objects.enqueue(NOOP)
    run_one(value="v")
    runs = Task.objects.enqueue(ECHO, depends_on=[done], pipe=True)
    assert Task.objects.filter(pk=runs.id).values_list("status", "args").get() == ("READY", ["v"])
    assert run_one() == runs.id
    failed = Task.objects.enqueue(NOOP)
    assert run_one(fail=True) == failed.id
    cancelled = Task.objects.enqueue(NOOP, depends_on=[failed])
    row = Task.objects.get(pk=cancelled.id)
    assert row.status == "CANCELLED" and "ended FAILED" in row.errors[-1]["message"]
    anyway = Task.objects.enqueue(NOOP, depends_on=[failed], on_parent_failure="run")
    assert status_of(anyway.id) == ["READY"]
    workflow = flow(row.workflow_id)
    assert (workflow.total, workflow.remaining, workflow.failed) == (3, 1, 2)


def test_depends_on_refuses_what_it_cannot_keep() -> None:
    first = chain(step(NOOP), step(NOOP)).enqueue()
    second = chain(step(NOOP)).enqueue()
    before = Task.objects.count()
    with pytest.raises(WorkflowError, match="different workflows"):
        Task.objects.enqueue(NOOP, depends_on=[first.task_ids[0], second.task_ids[0]])
    with pytest.raises(WorkflowError, match="not in database"):
        Task.objects.enqueue(NOOP, depends_on=[first.task_ids[0], 10**12])
    with pytest.raises(WorkflowError, match="dedup_key"):
        Task.objects.enqueue(NOOP, depends_on=[first.task_ids[0]], dedup_key="k")
    with pytest.raises(WorkflowError, match="task ids"):
        Task.objects.enqueue(NOOP, depends_on=["12"])  # type: ignore[list-item]
    assert Task.objects.count() == before


# -- operators, keys, recovery ------------------------------------------------------------------------


def test_cancelling_a_workflow_cancels_its_members_and_fences_the_running_one() -> None:
    done = chain(step(NOOP), step(NOOP), step(NOOP)).enqueue()
    (running,) = Task.objects.claim("w1", limit=1)
    assert done.cancel() == 3
    assert status_of(*done.task_ids) == ["CANCELLED"] * 3
    assert not Task.objects.complete_many("w1", [(running.id, running.token, "null")])
    row = flow(done.id)
    assert (row.status, row.remaining) == ("CANCELLED", 0) and row.finished_at is not None
    assert done.cancel() == 0


def test_a_requeued_member_reopens_its_workflow_until_it_ends_again() -> None:
    done = group([step(NOOP), step(NOOP)], then=step(NOOP), on_failure="run").enqueue()
    a = run_one(fail=True)
    run_one()
    run_one()  # the callback
    assert flow(done.id).status == "FAILED"
    assert Task.objects.filter(pk=a).requeue() == 1
    row = flow(done.id)
    assert (row.status, row.remaining, row.failed, row.finished_at) == ("RUNNING", 1, 0, None)
    run_one()
    assert flow(done.id).status == "SUCCESSFUL"


def test_a_released_keyed_member_waits_for_its_slot() -> None:
    holder = Task.objects.enqueue(NOOP, concurrency_key="k", concurrency_limit=1)
    done = chain(step(NOOP), step(NOOP).options(concurrency_key="k", concurrency_limit=1)).enqueue()
    first = Task.objects.claim("w1", limit=10)
    assert {t.id for t in first} == {holder.id, done.task_ids[0]}
    Task.objects.complete_many("w1", [(t.id, t.token, "null") for t in first if t.id == done.task_ids[0]])
    assert status_of(done.task_ids[1]) == ["BLOCKED"]
    Task.objects.complete_many("w1", [(t.id, t.token, "null") for t in first if t.id == holder.id])
    assert status_of(done.task_ids[1]) == ["READY"]


def test_recovery_failing_a_member_for_good_settles_its_dependants(settings: Any) -> None:
    settings.LEASING_TASKS = {**settings.LEASING_TASKS, "MAX_CRASHES": 1}
    done = chain(step(NOOP), step(NOOP)).enqueue()
    (task,) = Task.objects.claim("w1", limit=1, start=True, ttl=0.001)
    Task.objects.filter(pk=task.id).update(attempt_isolated=True)  # alone in its process: its crash is its own
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_sleep(0.01)")  # the lease lapses on the database clock
    recovered = Task.objects.recover_expired()
    assert [r.id for r in recovered] == [task.id]
    assert status_of(*done.task_ids) == ["FAILED", "CANCELLED"]
    assert flow(done.id).status == "FAILED"


def test_django_tasks_steps_go_through_their_backend() -> None:
    from tests.testapp.handlers import add

    done = chain(step(add, 1, 2), step(add, b=5)).enqueue()
    rows = list(Task.objects.filter(pk__in=done.task_ids).order_by("id"))
    assert [r.backend_alias for r in rows] == ["default", "default"]
    assert rows[0].task_path == add.module_path
    backend = default_task_backend
    assert backend.get_result(str(rows[1].id)).status == TaskResultStatus.READY  # AWAITING is READY to it
    assert rows[1].status == TaskStatus.AWAITING


# -- retention ----------------------------------------------------------------------------------------


def test_retention_prunes_a_finished_workflow_as_one_unit() -> None:
    plain = Task.objects.enqueue(NOOP)
    assert run_one() == plain.id
    old = chain(step(NOOP), step(NOOP)).enqueue()
    run_one()
    run_one()
    running = chain(step(NOOP), step(NOOP)).enqueue()
    assert run_one() == running.task_ids[0]  # finished and old, but its workflow is not
    long_ago = dt.datetime(2000, 1, 1, tzinfo=dt.timezone.utc)
    Task.objects.update(finished_at=long_ago)
    Workflow.objects.filter(pk=old.id).update(finished_at=long_ago)
    deleted = retention.prune({"SUCCESSFUL": dt.timedelta(days=1)})
    assert deleted == {"SUCCESSFUL": 3}  # the plain task and the old workflow's two members
    assert not Workflow.objects.filter(pk=old.id).exists()
    assert not Task.objects.filter(pk__in=[*old.task_ids, plain.id]).exists()
    assert Task.objects.filter(pk__in=running.task_ids).count() == 2
    assert not TaskDependency.objects.filter(child_id__in=old.task_ids).exists()
    assert TaskDependency.objects.filter(child_id=running.task_ids[1]).exists()


def test_a_parent_finishing_while_a_dependant_is_enqueued_in_an_open_transaction_is_not_missed() -> None:
    parent = Task.objects.enqueue(NOOP)
    (claimed,) = Task.objects.claim("w1", limit=1)
    enqueued = threading.Event()
    commit = threading.Event()
    found: dict[str, Any] = {}

    def enqueue_and_hold() -> None:
        try:
            with transaction.atomic():
                found["child"] = Task.objects.enqueue(NOOP, depends_on=[parent])
                enqueued.set()
                commit.wait(30)
        finally:
            connections.close_all()

    def finish_parent() -> None:
        try:
            found["finished"] = Task.objects.complete_many("w1", [(claimed.id, claimed.token, "null")])
        finally:
            connections.close_all()

    holder = threading.Thread(target=enqueue_and_hold)
    holder.start()
    assert enqueued.wait(30)
    finisher = threading.Thread(target=finish_parent)
    finisher.start()

    def finisher_waits_for_the_lock() -> bool:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND"
                " wait_event_type = 'Lock' AND query LIKE '%%tasks_task%%'"
            )
            return cursor.fetchone()[0] == 1

    wait_until(finisher_waits_for_the_lock, 30, what="the parent's finish to wait for the enqueue's lock")
    commit.set()
    holder.join(30)
    finisher.join(30)
    assert found["finished"] == {(claimed.id, claimed.token)}
    assert status_of(parent.id, found["child"].id) == ["SUCCESSFUL", "READY"]
