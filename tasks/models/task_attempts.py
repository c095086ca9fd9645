"""An attempt's life on the worker's hot path (TaskQuerySet.claim … fail_many): claim, start (and the
rate-limited start), heartbeat, checkpoint, finish, fail, hand back and the worker's reconciliation,
each one statement of tasks/lifecycle/ (claim.py, rounds.py, finish.py)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from django.db import connections

from leasing.models import seconds
from tasks.conf import get_settings
from tasks.lifecycle import ratelimits
from tasks.lifecycle import statements as sql
from tasks.lifecycle.storable import storable_json
from tasks.lifecycle.values import (
    AttemptFate,
    ClaimedTask,
    ClaimPosition,
    FailOutcome,
    Failure,
    FairPosition,
    FairPositions,
    RateRefused,
    Started,
    claimed_from_row,
)
from tasks.models.task_send import OperationsBase, fetch


class AttemptOperations(OperationsBase):
    """An attempt on the worker's hot path, one statement each.
    A base of TaskQuerySet: its methods are ``Task.objects``'s."""

    def claim(
        self,
        worker: str,
        *,
        limit: int = 1,
        queues: Sequence[str] = ("default",),
        ttl: float | None = None,
        start: bool = False,
        take_isolated: bool = True,
        after: Sequence[ClaimPosition] = (),
        fair_after: str | None = None,
        fair_positions: FairPositions | Sequence[FairPosition] = (),
    ) -> list[ClaimedTask]:
        """Claim up to ``limit`` runnable tasks for ``worker`` under a lease of ``ttl`` seconds.

        With ``start`` the attempts begin (and are charged) at once, as for an HTTP client; a
        worker claims without it and sends :meth:`start` when an executor begins the task. With
        ``after`` (positions, at most one per priority; one queue only) the claim resumes after them
        instead of scanning each level from its front (docs/explanation/claims.md, "Resuming
        where the last claims stopped").

        From one fair queue (LEASING_TASKS["FAIR_QUEUES"]) the claim takes turns between the keys,
        starting after ``fair_after`` (the last key the claimer served: ``fair_after_claim``); with
        ``fair_positions`` (at most one per key and priority) each of those keys' turns resumes after
        its position, and the fill of the claim after ``after``."""
        names = list(queues)
        isolate_after = get_settings().ISOLATE_AFTER
        params = {
            "worker": worker,
            "ttl": seconds(get_settings().TTL if ttl is None else ttl),
            "limit": limit,
            "start": start,
            "isolate_after": isolate_after,
            **sql.claim_params(
                names,
                busy=not take_isolated,
                isolate_after=isolate_after,
                after=after,
                fair_after=fair_after,
                fair_positions=fair_positions,
            ),
        }
        statement = sql.CLAIM_SQL[len(names) > 1]
        if is_fair_claim(names, limit):  # the keys' turns resume after ``fair_positions``, the fill after ``after``
            statement = sql.FAIR_CLAIM_SQL
        claimed = [claimed_from_row(row) for row in fetch(self, statement, params)]
        claimed.sort(key=lambda task: (-task.priority, task.id))
        return claimed

    def claim_chosen(
        self,
        worker: str,
        ids: Sequence[int],
        *,
        workflows: Sequence[int] = (),
        ttl: float | None = None,
        limit: int = 1,
    ) -> list[ClaimedTask]:
        """Claim up to ``limit`` of the READY tasks among ``ids`` and the members of ``workflows``, due
        or not (tasks.testing's eager mode: CLAIM_CHOSEN_SQL says which it passes over)."""
        params = {
            "worker": worker,
            "ttl": seconds(get_settings().TTL if ttl is None else ttl),
            "limit": limit,
            "start": False,
            "isolate_after": get_settings().ISOLATE_AFTER,
            "ids": list(ids),
            "workflows": list(workflows),
        }
        return [claimed_from_row(row) for row in fetch(self, sql.CLAIM_CHOSEN_SQL, params)]

    def start(self, task_id: int, worker: str, token: int, *, isolated: bool = False) -> Started | None:
        """Mark the claimed attempt started now (``isolated``: nothing else runs in its process);
        None when the claim is no longer ours."""
        params = {
            "worker": worker,
            "start_ids": [task_id],
            "start_tokens": [token],
            "start_at": [None],
            "isolated": isolated,
        }
        rows = fetch(self, sql.START_SQL, params)
        return Started(*rows[0]) if rows else None

    def rate_start(
        self, task_id: int, worker: str, token: int, *, isolated: bool = False, queue: str | None = None
    ) -> Started | RateRefused | None:
        """Take a start of the attempt's rate key and mark the attempt started (:class:`Started`), or,
        when the key's window is full, hand it back uncharged to run later (:class:`RateRefused`); None
        when the claim is no longer ours (RATE_START_SQL). A task without a rate key of its own uses
        ``queue``'s queue-wide key (LEASING_TASKS["RATE_LIMITS"])."""
        fallback = ratelimits.queue_rate(queue) if queue is not None else None
        params = {
            "worker": worker,
            "id": task_id,
            "token": token,
            "isolated": isolated,
            "key": fallback[0] if fallback else None,
            "limit": fallback[1].count if fallback else None,
            "period": fallback[1].period if fallback else None,
        }
        rows = fetch(self, sql.RATE_START_SQL, params)
        if not rows:
            return None
        granted, row_id, row_token, attempt, started_at, at, wait = rows[0]
        if granted:
            return Started(row_id, row_token, attempt, started_at, at)
        return RateRefused(row_id, row_token, at, max(0.0, wait))

    def heartbeat(
        self,
        worker: str,
        held: Iterable[tuple[int, int]],
        *,
        ttl: float | None = None,
        stats: dict[str, Any] | None = None,
    ) -> set[tuple[int, int]]:
        """Renew every attempt in ``held`` ((id, token) pairs) in one statement; return those LOST.

        An attempt is lost when its row no longer has this worker, this token, RUNNING and a live
        lease. The token is compared in SQL: a stale token renews nothing. With ``stats`` (the worker
        process's own beat) the worker's row records it alive; without, only leases are touched.
        """
        attempts = list(held)
        renewed, busy = self.heartbeat_detail(worker, attempts, ttl=ttl, stats=stats, running=len(attempts))
        return set(attempts) - renewed - busy

    def heartbeat_detail(
        self,
        worker: str,
        held: Iterable[tuple[int, int]],
        *,
        ttl: float | None = None,
        stats: dict[str, Any] | None = None,
        running: int = 0,
        live: Iterable[tuple[int, int]] | None = None,
    ) -> tuple[set[tuple[int, int]], set[tuple[int, int]]]:
        """The heartbeat statement: (renewed, busy). Busy attempts are still ours but their rows are
        locked by another session right now: not renewed this beat, not lost either; the rest of
        ``held`` is lost. Only a beat with ``stats`` (the worker process's own) stamps the worker
        row, with ``running`` (attempts running, stuck threads included) for the workers page. With
        ``live`` (the attempts whose handler still runs in the process), the key slots kept for the
        worker's other attempts are given back (tasks/lifecycle/concurrency.py)."""
        attempts = list(held)
        alive = [] if live is None else list(live)
        params = {
            "worker": worker,
            "ids": [a[0] for a in attempts],
            "tokens": [a[1] for a in attempts],
            "ttl": seconds(get_settings().TTL if ttl is None else ttl),
            "running": running,
            "stats": json.dumps(stats or {}),
            "record_worker": stats is not None,  # a client reusing the worker's name must not touch its row
            "reconcile": live is not None,
            "live_ids": [a[0] for a in alive],
            "live_tokens": [a[1] for a in alive],
        }
        renewed: set[tuple[int, int]] = set()
        busy: set[tuple[int, int]] = set()
        for row in fetch(self, sql.HEARTBEAT_SQL, params):
            (renewed if row[0] else busy).add((row[1], row[2]))
        return renewed, busy

    def checkpoint(self, task_id: int, worker: str, token: int, progress: Any) -> bool:
        """Store ``progress`` (JSON) as the task's last checkpoint; False if the task is no longer ours.

        Raises :class:`~tasks.exceptions.UnstorableResult` (a ValueError) for progress jsonb cannot hold.
        """
        return self.checkpoint_on(connections[self.db], task_id, worker, token, progress)

    def checkpoint_on(
        self, connection: BaseDatabaseWrapper, task_id: int, worker: str, token: int, progress: Any
    ) -> bool:
        """:meth:`checkpoint` on a given connection (one outside the handler's transaction)."""
        params: dict[str, Any] = {"id": task_id, "worker": worker, "token": token, "progress": storable_json(progress)}
        with connection.cursor() as cursor:
            cursor.execute(sql.CHECKPOINT_SQL, params)
            return cursor.rowcount == 1

    def complete_many(
        self, worker: str, results: Sequence[tuple[int, int, str] | tuple[int, int, str, float | None]]
    ) -> set[tuple[int, int]]:
        """Finish (id, token, return value as JSON text) triples in one statement; return the
        attempts accepted. The rest were rejected by the compare-and-set: no longer held."""
        if not results:
            return set()
        params = {"worker": worker, **_result_params(results)}
        return {(row[0], row[1]) for row in fetch(self, sql.COMPLETE_SQL, params)}

    def finish_start_claim(
        self,
        worker: str,
        results: Sequence[tuple[int, int, str] | tuple[int, int, str, float | None]],
        starts: Sequence[tuple[int, int, float | None]] = (),
        *,
        limit: int,
        queues: Sequence[str] = ("default",),
        ttl: float | None = None,
        isolate_after: int | None = None,
        take_isolated: bool = True,
        after: Sequence[ClaimPosition] = (),
        fair_after: str | None = None,
        fair_positions: FairPositions | Sequence[FairPosition] = (),
        handed: Sequence[int] | None = None,
        release: int = 0,
        rated_queues: Sequence[str] = (),
    ) -> tuple[set[tuple[int, int]], dict[tuple[int, int], Started], list[ClaimedTask]]:
        """One statement: finish ``results`` (id, token, JSON), mark ``starts`` (id, token, start
        time) begun, claim up to ``limit`` more. Returns (finished, started, claimed); attempts
        missing from the first two were refused by the compare-and-set: no longer ours. From one fair
        queue the claim takes turns between keys after ``fair_after``, resuming each key after its
        ``fair_positions`` (see :meth:`claim`).

        ``handed`` (tokens; None: left as it is) replaces what the worker's row names as handed to
        its executors, followed by the first ``release`` claimed rows whose start is not their own
        (not suspects, no rate key, not of ``rated_queues``) in the order returned here
        (tasks/worker/handoff.py)."""
        names = list(queues)
        if isolate_after is None:
            isolate_after = get_settings().ISOLATE_AFTER
        params: dict[str, Any] = {
            "worker": worker,
            **_result_params(results),
            "ttl": seconds(get_settings().TTL if ttl is None else ttl),
            "limit": limit,
            "start": False,
            "isolate_after": isolate_after,
            "hand": handed is not None,
            "handed": "{" + ",".join(map(str, handed or ())) + "}",
            "release": release if handed is not None else 0,
            "rated_queues": list(rated_queues),
            **sql.claim_params(
                names,
                busy=not take_isolated,
                isolate_after=isolate_after,
                after=after,
                fair_after=fair_after,
                fair_positions=fair_positions,
            ),
        }
        fair = is_fair_claim(names, limit)  # its keys' turns resume after ``fair_positions``, its fill after ``after``
        statement = sql.FAIR_FINISH_AND_CLAIM_SQL if fair else sql.FINISH_AND_CLAIM_SQL[len(names) > 1]
        if starts:  # the usual round has none: a short task's start rides on its finish
            statement = sql.FAIR_FINISH_START_CLAIM_SQL if fair else sql.FINISH_START_CLAIM_SQL[len(names) > 1]
            params.update(
                start_ids=[s[0] for s in starts], start_tokens=[s[1] for s in starts], start_at=[s[2] for s in starts]
            )
        return _round_rows(fetch(self, statement, params))

    def complete(self, task_id: int, worker: str, token: int, return_value: Any = None) -> bool:
        """Finish one attempt. Raises UnstorableResult (a ValueError) for a value jsonb cannot hold."""
        return (task_id, token) in self.complete_many(worker, [(task_id, token, storable_json(return_value))])

    def fail_many(self, worker: str, failures: Sequence[Failure]) -> dict[tuple[int, int], FailOutcome]:
        """Record attempts that ended other than by returning, in one statement: failed (retried later,
        READY, or terminal, FAILED), snoozed (READY later, uncharged) or cancelled (``Failure.kind``)."""
        if not failures:
            return {}
        conf = get_settings()
        params = {
            "worker": worker,
            "ids": [f.id for f in failures],
            "tokens": [f.token for f in failures],
            "errors": [f.as_json() for f in failures],
            "retry": [f.retry for f in failures],
            "kinds": [f.kind for f in failures],
            "delays": [f.delay for f in failures],
            "max_attempts": [f.max_attempts for f in failures],
            "started": [f.started for f in failures],
            "backoff_base": conf.BACKOFF_BASE,
            "backoff_max": conf.BACKOFF_MAX,
        }
        tokens = {f.id: f.token for f in failures}
        return {
            (row[0], tokens[row[0]]): FailOutcome(row[0], row[1], row[2], row[3])
            for row in fetch(self, sql.FAIL_SQL, params)
        }

    def fail(self, failure: Failure, worker: str) -> FailOutcome | None:
        return self.fail_many(worker, [failure]).get(failure.key)

    def hand_back(
        self,
        worker: str,
        held: Iterable[tuple[int, int]],
        *,
        reason: str = "interrupted by a worker shutting down; not counted as a failure",
    ) -> set[tuple[int, int]]:
        """Return held attempts to the queue at once, uncharged (shutdown, claims we cannot run).
        An attempt that had started gets an error entry with ``reason``."""
        attempts = list(held)
        if not attempts:
            return set()
        params = {
            "worker": worker,
            "ids": [a[0] for a in attempts],
            "tokens": [a[1] for a in attempts],
            "reason": reason,
        }
        return {(row[0], row[1]) for row in fetch(self, sql.HAND_BACK_SQL, params)}

    def held_by_worker(self, worker: str) -> dict[tuple[int, int], bool]:
        """What the database says ``worker`` holds: attempt -> whether it started (reconciliation)."""
        return {(row[0], row[1]): row[2] for row in fetch(self, sql.HELD_SQL, {"worker": worker})}

    def attempt_fates(self, ids: Iterable[int]) -> dict[int, AttemptFate]:
        """Where the given tasks stand now, for a worker whose reply to a finish was lost."""
        rows = fetch(self, sql.ATTEMPT_FATE_SQL, {"ids": list(ids)})
        return {row[0]: AttemptFate(*row) for row in rows}


if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper


def is_fair_claim(queues: Sequence[str], limit: int) -> bool:
    """A claim of rows from one fair queue (LEASING_TASKS["FAIR_QUEUES"]) takes turns between keys.
    A claim from several queues keeps the plain order (each queue's best rows, by priority)."""
    return limit > 0 and len(queues) == 1 and queues[0] in get_settings().FAIR_QUEUES


def _result_params(results: Sequence[tuple[int, int, str] | tuple[int, int, str, float | None]]) -> dict[str, Any]:
    """A round's results (id, token, JSON, start time) as the statement's arrays."""
    return {
        "ids": [r[0] for r in results],
        "tokens": [r[1] for r in results],
        "values": [r[2] for r in results],
        "started": [r[3] if len(r) > 3 else None for r in results],
    }


def _round_rows(
    rows: Iterable[Sequence[Any]],
) -> tuple[set[tuple[int, int]], dict[tuple[int, int], Started], list[ClaimedTask]]:
    """A round's rows, by their first column: "f" a finish accepted, "c" a claimed task, else a start
    recorded. The claimed in the order they are handed out (priority, then id)."""
    finished: set[tuple[int, int]] = set()
    started: dict[tuple[int, int], Started] = {}
    claimed: list[ClaimedTask] = []
    for row in rows:
        if row[0] == "c":
            claimed.append(claimed_from_row(row[1:]))
        elif row[0] == "f":
            finished.add((row[1], row[2]))
        else:
            started[(row[1], row[2])] = Started(row[1], row[2], row[6], row[9], row[13])
    claimed.sort(key=lambda task: (-task.priority, task.id))
    return finished, started, claimed
