"""The composition matrix: every operator action on every feature, under each fault, with real worker
processes (issue 38).

One run per fault enqueues a cell of tasks for each (action, feature) pair, each cell in a queue of
its own, and works the actions on them while two worker processes (with their recovery leader) drain
everything:

- actions: requeue and bulk retry (of tasks whose first execution failed for good), cancel and bulk
  cancel (at once, while the cell runs), admin-style delete (refused while any task of the cell is
  unfinished, then of the finished cell), pause (before the cell is enqueued; resumed at the end);
- features: a workflow member (two chains of two), a concurrency key (limit 1), a rate key, a unique
  window, a fair key (two tenants of a fair queue), a snoozed task (its first execution snoozes);
- faults: ``sigkill`` (each worker SIGKILLed once, mid-drain, and started again), ``open_transaction``
  (each action inside a transaction of its own connection, held open until the workers have run
  another task meanwhile: nothing they do waits for the operator's commit; a pause, which locks the
  claims out until it commits, is held until a worker's claim is seen waiting on it), ``pgbouncer``
  (the workers and their leader through PgBouncer in transaction pooling).

Every row must end final, and each side effect must be accounted for: every execution of a handler
(an ``Effect`` row) belongs to an attempt its task recorded (the final one, or one named in its error
entries), no attempt ran twice, a dependant ran only after its parent succeeded, two tasks of a
concurrency key never ran at once, no repair was ever needed (a repair is a bug report), and every
bulk operation is done. Waits poll the database; nothing sleeps to synchronise.
"""

from __future__ import annotations

import datetime as dt
import itertools
import os
import signal
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from django.db import connection, transaction
from django.utils import timezone

from tasks.exceptions import TaskNotFinished
from tasks.lifecycle.states import TaskStatus
from tasks.models import BulkOperation, QueueControl, Repair, Task
from tasks.models import Workflow as WorkflowRow
from tests.helpers import wait_until
from tests.helpers.connections import OnItsOwnConnection
from tests.helpers.pgbouncer import pgbouncer
from tests.helpers.workers import Workers
from tests.testapp.models import Effect

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

HANDLER = "tests.testapp.handlers.composed"
ACTIONS = ("requeue", "cancel", "bulk_retry", "bulk_cancel", "delete", "pause")
FEATURES = ("workflow", "concurrency", "rate", "window", "fair", "snoozed")
FAULTS = ("sigkill", "open_transaction", "pgbouncer")
PER_CELL = 4
PACER = "matrix-pacer"
UNFINISHED = (TaskStatus.AWAITING, TaskStatus.BLOCKED, TaskStatus.READY, TaskStatus.RUNNING)
FINAL = (TaskStatus.SUCCESSFUL, TaskStatus.FAILED, TaskStatus.CANCELLED)


def queue(action: str, feature: str) -> str:
    return f"matrix-{action}-{feature}"


def queues_of(action: str) -> list[str]:
    return [queue(action, feature) for feature in FEATURES]


ALL_QUEUES = [queue(a, f) for a in ACTIONS for f in FEATURES]
#: The delete cell held in a paused queue until the early deletes (see the test).
HELD_DELETE_FEATURE = "window"
FAIR_QUEUES = [queue(a, "fair") for a in ACTIONS]


def enqueue_cell(action: str, feature: str) -> list[int]:
    """The cell's tasks, in enqueue order. In a workflow cell the odd ones depend on the one before
    (two chains of two); only a chain's first task fails first."""
    name = queue(action, feature)
    fail_first = action in ("requeue", "bulk_retry")
    ids: list[int] = []
    for i in range(PER_CELL):
        options: dict[str, Any] = {}
        kwargs = {"fail_first": fail_first, "snooze_first": feature == "snoozed", "i": i}
        if feature == "workflow" and i % 2:
            options["depends_on"] = [ids[-1]]
            kwargs["fail_first"] = False
        elif feature == "concurrency":
            options.update(concurrency_key=name, concurrency_limit=1)
        elif feature == "rate":
            options.update(rate_key=name, rate_limit="2/s")
        elif feature == "window":
            options.update(dedup_key=f"{name}-{i}", unique_for=3600)
        elif feature == "fair":
            options["fair_key"] = f"tenant-{i % 2}"
        ids.append(Task.objects.enqueue(HANDLER, kwargs=kwargs, queue=name, **options).id)
    return ids


class Operator:
    """Runs an operator's action: at once, or (``open_transaction``) inside a transaction of a
    connection of its own, held open until a worker has finished a pacer task meanwhile."""

    def __init__(self, fault: str) -> None:
        self.held = fault == "open_transaction"
        self.pacers = 0

    def act(self, action: Callable[[], Any], *, locks_claims_out: bool = False) -> Any:
        if not self.held:
            return action()
        acted, release = threading.Event(), threading.Event()

        def work() -> Any:
            with transaction.atomic():
                result = action()
                acted.set()
                assert release.wait(120), "the test never released the transaction"
            return result

        thread = OnItsOwnConnection(work)
        thread.start()
        wait_until(lambda: acted.is_set() or not thread.is_alive(), 60, what="the held action")
        if thread.is_alive():
            if locks_claims_out:
                # A pause holds the claims out until it commits (docs/howto/pausing-and-keys.md):
                # the workers wait on it, and nothing else happens to them.
                wait_until(lambda: claims_wait_on_the_pause(), 30, what="a claim waiting on the held pause")
            else:
                self.pacers += 1
                pacer = Task.objects.enqueue(HANDLER, kwargs={"pacer": self.pacers}, queue=PACER).id
                wait_until(
                    lambda: Task.objects.filter(pk=pacer, status=TaskStatus.SUCCESSFUL).exists(),
                    60,
                    what="a worker to finish a task while the operator's transaction is open",
                )
        release.set()
        return thread.outcome()


def claims_wait_on_the_pause() -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = 'tasks_queuecontrol'::regclass")
        return cursor.fetchone()[0] > 0


def try_delete(ids: list[int]) -> tuple[bool, int]:
    """The admin's delete of a cell: (refused, rows deleted)."""
    try:
        return False, Task.objects.filter(pk__in=ids).delete_finished()
    except TaskNotFinished:
        return True, 0


def recovery_entries(ids: Sequence[int]) -> list[dict[str, Any]]:
    """The error entries of ``ids`` that say an attempt was recovered from a worker that stopped."""
    return [
        entry
        for errors in Task.objects.filter(pk__in=ids).values_list("errors", flat=True)
        for entry in errors
        if entry.get("kind") in ("crash", "vanished", "orphan", "returned")
    ]


def kill_and_restart(
    workers: Workers, name: str, successor: str, args: list[str], env: dict[str, Any], holding: Sequence[int] = ()
) -> None:
    """SIGKILL ``name`` (given ``holding``, once it holds one of those tasks RUNNING: the kill then
    leaves a lease to recover), start ``successor`` under the same options. (A kill at a blind moment
    found the worker between batches once in the 5.2 leg.)"""
    if holding:
        held = Task.objects.filter(pk__in=holding, status=TaskStatus.RUNNING, holder=workers.ids[name])
        wait_until(held.exists, 60, interval=0.01, what=f"{name} to hold a task of the matrix")
    proc = workers.procs[name]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    workers.start(successor, *args, **env)


@pytest.fixture
def worker_env(request: pytest.FixtureRequest) -> Iterator[dict[str, str]]:
    env = {"LEASING_TEST_FAIR_QUEUES": ",".join(FAIR_QUEUES), "LEASING_TEST_BULK_BATCH_SIZE": "3"}
    with ExitStack() as stack:
        if request.param == "pgbouncer":
            bouncer = stack.enter_context(pgbouncer(connection.settings_dict, pool_size=4))
            env.update(DATABASE_URL=bouncer.url(connection.settings_dict["NAME"]), DATABASE_POOLED="true")
        yield env


@pytest.mark.parametrize(("fault", "worker_env"), [(f, f) for f in FAULTS], indirect=["worker_env"], ids=FAULTS)
def test_every_operator_action_on_every_feature_ends_final_and_accounted(
    fault: str, worker_env: dict[str, Any], workers: Workers, tmp_path: Path
) -> None:
    args = ["--queues", ",".join([*ALL_QUEUES, PACER]), "--concurrency", "4", "--batch-size", "8"]
    workers.start("matrix-a", *args, **worker_env)
    workers.start("matrix-b", *args, **worker_env)
    operator = Operator(fault)

    # Pause first: the pause cells are enqueued into paused queues. So is one delete cell, until the
    # early deletes: they race the other cells' executions, and a loaded machine (or an operator
    # whose every act waits on an open transaction) could let every cell finish first, leaving
    # the refusal of an unfinished cell's delete untried. The held cell is unfinished for certain.
    held = queue("delete", HELD_DELETE_FEATURE)
    operator.act(
        lambda: [QueueControl.objects.pause(q, by="matrix") for q in [*queues_of("pause"), held]],
        locks_claims_out=True,
    )
    cells = {(action, feature): enqueue_cell(action, feature) for action in ACTIONS for feature in FEATURES}

    def ids_of(action: str) -> list[int]:
        return [task_id for feature in FEATURES for task_id in cells[action, feature]]

    # At once, while the cells run: cancels, bulk cancels, deletes of unfinished cells.
    operator.act(lambda: Task.objects.filter(pk__in=ids_of("cancel")).cancel())
    operator.act(lambda: [BulkOperation.objects.request("cancel", {"queue": q}) for q in queues_of("bulk_cancel")])
    early = operator.act(lambda: [try_delete(cells["delete", f]) for f in FEATURES])
    for (refused, deleted), feature in zip(early, FEATURES, strict=True):
        assert refused or feature != HELD_DELETE_FEATURE, "the held delete cell's delete was not refused"
        if refused:
            assert deleted == 0
            assert Task.objects.filter(pk__in=cells["delete", feature]).count() == PER_CELL, "a refused delete deleted"
    operator.act(lambda: QueueControl.objects.resume(held, by="matrix"))
    if fault == "sigkill":
        # At once, while the cells' first executions are dense: waiting first for 20 of them to be
        # done left only the sparse tail (a rate key's 2 a second, the snoozed ones' wake-ups), which
        # the other worker could take all of: the hold was then never seen, in a minute.
        matrix = [task_id for ids in cells.values() for task_id in ids]
        kill_and_restart(workers, "matrix-a", "matrix-a2", args, worker_env, holding=matrix)

    # Once their first executions are over: requeues (a chain's parent first), bulk retries, deletes.
    later = ids_of("requeue") + ids_of("bulk_retry") + ids_of("delete")
    wait_until(
        lambda: not Task.objects.filter(pk__in=later, status__in=UNFINISHED).exists(),
        120,
        what="the first executions of the requeue, bulk retry and delete cells",
    )
    paused = ids_of("pause")
    assert not Task.objects.filter(pk__in=paused).exclude(status__in=UNFINISHED[:3]).exists(), (
        "a task of a paused queue was claimed"
    )

    def requeue() -> None:
        for feature in FEATURES:
            ids = cells["requeue", feature]
            Task.objects.filter(pk__in=ids[0::2]).requeue()  # a chain's parents first, as the docs advise
            Task.objects.filter(pk__in=ids[1::2]).requeue()

    # The first kill's trace, read before the requeues, bulk retries and deletes below: requeue writes a
    # fresh set of attempts and a delete takes the row, so a kill of a task of those cells leaves none
    # at the end (the 5.2 leg saw every task the kill found held in them).
    everything = [task_id for ids in cells.values() for task_id in ids]
    recovered = recovery_entries(everything) if fault == "sigkill" else []
    # A run before the requeues that succeeded (one that followed a killed one) is run again and leaves
    # no trace on its row: requeue writes a fresh set of attempts, and a success has no error entry.
    rerun_from = timezone.now()
    operator.act(requeue)
    statuses = [TaskStatus.FAILED.value, TaskStatus.CANCELLED.value, TaskStatus.SUCCESSFUL.value]
    operator.act(
        lambda: [
            BulkOperation.objects.request("retry", {"queue": q, "status": statuses}) for q in queues_of("bulk_retry")
        ]
    )
    late = operator.act(lambda: [try_delete(cells["delete", f]) for f in FEATURES])
    assert not any(refused for refused, _ in late), "a delete of a finished cell was refused"
    operator.act(lambda: [QueueControl.objects.resume(q, by="matrix") for q in queues_of("pause")])
    if fault == "sigkill":
        done = Effect.objects.filter(phase="done").count()
        wait_until(lambda: Effect.objects.filter(phase="done").count() >= done + 10, 60, what="more work done")
        kill_and_restart(workers, "matrix-b", "matrix-b2", args, worker_env)

    wait_until(
        lambda: (
            not Task.objects.filter(pk__in=everything, status__in=UNFINISHED).exists()
            and not BulkOperation.objects.open().exists()
        ),
        180,
        interval=0.2,
        what="every task of the matrix to end and every bulk operation to be done",
    )

    assert_outcomes(cells)
    assert_accounted(cells, rerun_from)
    if fault == "sigkill":
        recovered += recovery_entries(everything)
        assert recovered, "the kills found no task of the matrix running: the fault was not exercised"
    assert not WorkflowRow.objects.filter(status="RUNNING").exists(), "a workflow is still RUNNING"
    assert set(BulkOperation.objects.values_list("status", flat=True)) == {"DONE"}
    assert not Repair.objects.exists(), f"repairs were needed: {list(Repair.objects.values())}"


def assert_outcomes(cells: dict[tuple[str, str], list[int]]) -> None:
    rows = {t.id: t for t in Task.objects.filter(pk__in=[i for ids in cells.values() for i in ids])}
    for (action, feature), ids in cells.items():
        statuses = [rows[i].status if i in rows else None for i in ids]
        where = f"{action} x {feature}: {statuses}"
        if action == "delete":
            assert statuses == [None] * PER_CELL, where
        elif action in ("requeue", "bulk_retry", "pause"):
            assert statuses == [TaskStatus.SUCCESSFUL] * PER_CELL, where
        else:  # cancel, bulk cancel: cancelled, or finished before the cancel reached it
            assert set(statuses) <= {TaskStatus.CANCELLED, TaskStatus.SUCCESSFUL}, where
        if feature == "workflow":
            for parent, child in zip(ids[0::2], ids[1::2], strict=True):
                if child in rows and rows[child].status == TaskStatus.SUCCESSFUL:
                    assert rows[parent].status == TaskStatus.SUCCESSFUL, f"{where}: a dependant ran, its parent did not"


def assert_accounted(cells: dict[tuple[str, str], list[int]], rerun_from: dt.datetime) -> None:
    """Each execution of a handler belongs to an attempt its task recorded (but a run before its
    requeue or bulk retry, which starts the task's record afresh); none ran twice; order and exclusion
    held."""
    kept = {t.id: t for t in Task.objects.filter(pk__in=[i for ids in cells.values() for i in ids])}
    rerun = {i for (action, _), ids in cells.items() if action in ("requeue", "bulk_retry") for i in ids}
    effects = list(Effect.objects.filter(task_id__in=kept).order_by("id"))
    done = Counter((e.task_id, e.token) for e in effects if e.phase == "done")
    twice = [key for key, n in done.items() if n > 1]
    assert not twice, f"attempts that ran their work twice: {twice}"
    before_rerun = {(e.task_id, e.token) for e in effects if e.task_id in rerun and e.created_at < rerun_from}
    for (task_id, token), _ in done.items():
        if (task_id, token) in before_rerun:
            continue
        task = kept[task_id]
        recorded = {task.token} | {entry.get("token") for entry in task.errors}
        assert token in recorded, (
            f"task {task_id} ({task.queue}, {task.status}) ran under token {token}, an attempt it never recorded "
            f"(final {task.token}, errors {task.errors})"
        )
    for task in kept.values():
        if task.status == TaskStatus.SUCCESSFUL:
            assert done[task.id, task.token or 0] == 1, f"task {task.id} ({task.queue}) succeeded without its work"

    started = {(e.task_id, e.token): e.created_at for e in effects if e.phase == "started"}
    finished = {(e.task_id, e.token): e.created_at for e in effects if e.phase == "done"}
    for (action, feature), ids in cells.items():
        if feature == "workflow":
            for parent, child in zip(ids[0::2], ids[1::2], strict=True):
                if child not in kept or parent not in kept:
                    continue
                # A rerun cell's executions fall in two eras: its first executions (all over before the
                # reruns) and its reruns. In each era the child starts only after its parent's work of
                # that era is done (its first start against its parent's final run is no order at all).
                eras = (False, True) if action in ("requeue", "bulk_retry") else (None,)
                for era in eras:
                    ran = [
                        at
                        for (task_id, _), at in started.items()
                        if task_id == child and era in (None, at >= rerun_from)
                    ]
                    parent_done = [
                        at
                        for (task_id, _), at in finished.items()
                        if task_id == parent and era in (None, at >= rerun_from)
                    ]
                    if ran:
                        assert parent_done and min(ran) > min(parent_done), (
                            f"{action} x workflow: task {child} started at {min(ran)}, before its parent {parent} "
                            f"succeeded ({parent_done})"
                        )
        if feature == "concurrency" and action != "cancel":
            # (A cancel takes a running task's slot at once, its handler finishing on its own: limit 1
            # holds for the tasks the key admits, which is what the other cells check.)
            spans = sorted((at, finished[key]) for key, at in started.items() if key[0] in ids and key in finished)
            for (_, end), (begin, _) in itertools.pairwise(spans):
                assert end <= begin, f"{action} x concurrency: two tasks of a limit-1 key ran at once: {spans}"
