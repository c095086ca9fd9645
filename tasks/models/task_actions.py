"""The recovery round's sweeps (TaskQuerySet.recover_expired, expire_orphans, release_stray_leases)
and the operator's actions on a selection of tasks (cancel, requeue, delete_finished, retry_now):
their statements are in tasks/lifecycle/recover.py, operations.py and transitions.py (RERUN_SET)."""

from __future__ import annotations

import datetime as dt
from contextlib import nullcontext
from typing import Any

from django.db import IntegrityError, connections, models, transaction
from django.db.models.expressions import RawSQL
from django.db.models.functions import Now

from tasks.conf import get_settings
from tasks.exceptions import TaskError, TaskNotFinished
from tasks.lifecycle import statements as sql
from tasks.lifecycle.states import FINISHED, UNFINISHED, WAITING, TaskStatus
from tasks.lifecycle.transitions import CANCEL_SET, RERUN_FAIR_QUEUES, RERUN_SET
from tasks.lifecycle.values import Recovered
from tasks.models.task_send import OperationsBase, Tasks, fetch


class ActionOperations(OperationsBase):
    """The recovery round's sweeps and the operator's actions on the selected tasks.
    A base of TaskQuerySet: its methods are ``Task.objects``'s."""

    def recover_expired(self, *, limit: int = 1000, after: dt.datetime | None = None) -> list[Recovered]:
        """Requeue (or fail, after MAX_CRASHES) running tasks whose lease expired, and running rows
        without a lease. Returns what it recovered, with seconds from expiry to requeue. With
        ``after`` (database time), only leases that expired since then, and no repair of running
        rows without one (tasks/lifecycle/recover.py, RECOVER_EXPIRED_SINCE_SQL)."""
        conf = get_settings()
        params = {
            "limit": limit,
            "after": after,
            "backoff_base": conf.BACKOFF_BASE,
            "backoff_max": conf.BACKOFF_MAX,
            "max_crashes": conf.MAX_CRASHES,
        }
        # The statement also adds what it recovered to the per-minute activity rollup (same
        # statement, so the chart and /metrics count every recovery once, without scanning errors).
        statement = sql.RECOVER_EXPIRED_SQL if after is None else sql.RECOVER_EXPIRED_SINCE_SQL
        rows = fetch(self, statement, params)
        return [Recovered(row[0], row[1], row[2], row[3] or "", row[4], row[5], row[6]) for row in rows]

    def expire_orphans(self) -> list[int]:
        """Expire the leases of running tasks whose worker has recorded that it stopped."""
        return [row[0] for row in fetch(self, sql.EXPIRE_ORPHANS_SQL, {})]

    def release_stray_leases(self) -> list[int]:
        return [row[0] for row in fetch(self, sql.RELEASE_STRAY_LEASES_SQL, {})]

    def cancel(self) -> int:
        """Cancel the unfinished tasks of this queryset. A running task's worker loses it: its
        heartbeat drops the task and its late result is rejected."""
        # One UPDATE writing CANCEL_SET (tasks/lifecycle/transitions.py).
        return self.filter(status__in=UNFINISHED).update(
            **{column: RawSQL(expression, ()) for column, expression in CANCEL_SET.items()}
        )

    def requeue(self) -> int:
        """Run finished (failed, cancelled, successful) tasks again now, with a fresh set of attempts:
        one UPDATE writing RERUN_SET (tasks/lifecycle/transitions.py; the bulk retry writes the same).

        A task whose key another task holds (an unfinished task of its dedup key; a waiting, never
        claimed task of its debounce key, when it was never claimed either) refuses the whole requeue
        with a TaskError naming the key and the task that holds it, and changes nothing. Inside the caller's
        ``transaction.atomic()`` the UPDATE runs under a savepoint, so the transaction goes on."""
        finished = self.filter(status__in=FINISHED)
        # The fragment's one parameter (the fair queues) goes as Django's positional placeholder.
        fair_queues = list(get_settings().FAIR_QUEUES)
        rerun = {
            column: RawSQL(
                expression.replace(RERUN_FAIR_QUEUES, "%s"), [fair_queues] * expression.count(RERUN_FAIR_QUEUES)
            )
            for column, expression in RERUN_SET.items()
        }
        # Outside a transaction the UPDATE is its own: a failed one leaves nothing to roll back, and a
        # savepoint would cost a BEGIN and a COMMIT round trip.
        inside = connections[finished.db].in_atomic_block
        try:
            with transaction.atomic(using=finished.db) if inside else nullcontext():
                return finished.update(**rerun)
        except IntegrityError as exc:
            raise _requeue_refused(finished, exc) from exc

    def delete_finished(self) -> int:
        """Delete the tasks of this queryset if every one of them is finished (SUCCESSFUL, FAILED,
        CANCELLED), in one statement (DELETE_FINISHED_SQL); returns how many were deleted. One that
        is not (waiting or running) refuses the whole delete with :class:`TaskNotFinished` naming it,
        and nothing is deleted: cancel it first. Read on this queryset's database."""
        ids = list(self.values_list("pk", flat=True))
        if not ids:
            return 0
        rows = fetch(self, sql.DELETE_FINISHED_SQL, {"ids": ids})
        unfinished = sorted((row[1], row[2]) for row in rows if not row[0])
        if unfinished:
            raise TaskNotFinished(unfinished)
        return len(rows)

    def retry_now(self) -> int:
        """Run waiting (READY, backed off or deferred) tasks now. Waiting tasks of a concurrency key
        (BLOCKED) become due and are admitted at once where their key has a free slot (the update's
        own statement trigger admits for every key whose waiting task came due earlier)."""
        return self.filter(status__in=WAITING).update(run_after=Now())


def _requeue_refused(tasks: Tasks, exc: IntegrityError) -> TaskError:
    """What a requeue of these finished tasks met (its statement rolled back to its savepoint): the
    key and the task holding it, read from the bare table (a filtered queryset would hide it)."""
    table = tasks.model._base_manager.db_manager(tasks.db)
    constraint = getattr(getattr(exc.__cause__, "diag", None), "constraint_name", None)
    if constraint == "tasks_task_debounce_waiting":
        waiting = table.filter(status__in=(TaskStatus.BLOCKED, TaskStatus.READY), transitions=0)
        held = _key_holder(tasks, waiting, ("task_path", "debounce_key"), transitions=0)
        if held is None:
            return TaskError(
                "two of these tasks share a debounce key and were never claimed: only one of them can wait at a"
                " time; requeue them one by one"
            )
        held_id, mine, (path, key) = held
        return TaskError(
            f"task {mine} cannot run again: task {held_id} of debounce key {key!r} ({path}) is waiting,"
            " not yet claimed, and a debounce key has one such task at a time (the key's enqueues fold into"
            f" it); cancel task {held_id} or let it be claimed first"
        )
    if constraint == "tasks_task_dedup_unfinished":
        held = _key_holder(tasks, table.filter(status__in=UNFINISHED), ("dedup_key",))
        if held is None:
            return TaskError(
                "an unfinished task with the same dedup key already exists: two of these tasks share a dedup"
                " key; requeue them one by one"
            )
        held_id, mine, (key,) = held
        return TaskError(
            f"an unfinished task with the same dedup key already exists: dedup key {key!r} is held by"
            f" task {held_id} (task {mine} cannot run again until it finishes)"
        )
    return TaskError(f"the requeue was refused: {exc}")


def _key_holder(
    tasks: Tasks, holders: Tasks, key: tuple[str, ...], **mine: Any
) -> tuple[int, int | None, tuple[Any, ...]] | None:
    """The first of ``holders`` whose ``key`` columns (the last one not NULL) one of these tasks
    (narrowed by ``mine``) shares: its id, the id of the task of ours that shares it, and the key."""
    same = {column: models.OuterRef(column) for column in key}
    found = (
        holders.filter(**{f"{key[-1]}__isnull": False})
        .filter(models.Exists(tasks.filter(**mine, **same)))
        .order_by("id")
        .values_list("id", *key)
        .first()
    )
    if found is None:
        return None
    held_id, *values = found
    ours = tasks.filter(**mine, **dict(zip(key, values, strict=True))).values_list("id", flat=True).first()
    return held_id, ours, tuple(values)
