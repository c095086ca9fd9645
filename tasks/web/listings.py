"""The listings behind every task page (dashboard, admin, JSON API lists): tasks newest first, a
page's cost set by the page and not by the table (invariant 12; the counts, the search and the
queues are in tasks/web/queries.py).

Listings are built from ordered index scans that stop after one page: one branch per (status,
lookup), each ``WHERE status = ANY(ARRAY[…]) AND <lookup> ORDER BY status, id DESC LIMIT n`` on an
index whose columns are exactly (lookup column, status, id), merged in Python (an order the primary
key cannot give: see :meth:`Listing._branches`). A condition that the driving index does not cover
(pending: never failed; a search combined with a queue or with the retrying state; a queue or a
search among awaiting workflow members) is checked inside a bounded window of ``SCAN_WINDOW`` rows
per branch: a page may then come back short, with a link to continue below the window
(``Page.scanned_to``). The finished statuses' rows moved to tasks_finished are read in the same
statement (:meth:`Listing._finished_branches`).

Each listing's plan is held by tests/db/test_page_queries.py and tests/db/test_listing_plans.py.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import reduce
from typing import Any

from django.core.paginator import Page as PaginatorPage
from django.core.paginator import Paginator
from django.db import connections
from django.db.models import BooleanField, ExpressionWrapper, F, Lookup, Q, QuerySet
from django.utils.functional import cached_property

from leasing.pagination import COUNT_CAP, Count
from tasks.lifecycle.states import with_db_clock
from tasks.models import Task, TaskStatus
from tasks.models.finished import archived, in_finished
from tasks.web.queries import FINISHED_STATUSES, STATES, any_of, search_lookups

#: Rows a listing branch reads at most to check a filter no index covers.
SCAN_WINDOW = 2_000
ALL_STATUSES: tuple[str, ...] = tuple(TaskStatus.values)


@dataclass(frozen=True)
class Page:
    tasks: list[Task]
    #: Continue with ``before=next_before`` (ids below it); None: nothing older matches.
    next_before: int | None
    #: The page is short because a scan window ended, not because nothing older matches: the
    #: listing has looked at every task from this id up. (None for a full or final page.)
    scanned_to: int | None = None


class StatusAmong(Lookup):
    """``status = ANY(ARRAY[...])``: to the partial indexes the same as ``status = …`` (PostgreSQL
    proves their predicate from a constant array), but not an equality the planner can use to drop
    ``status`` from an ``ORDER BY status, id DESC``. See :meth:`Listing._branches`."""

    def get_prep_lookup(self) -> Any:
        return [str(value) for value in self.rhs]

    def as_sql(self, compiler: Any, connection: Any) -> Any:
        lhs, lhs_params = self.process_lhs(compiler, connection)
        return f"{lhs} = ANY(%s::text[])", (*lhs_params, self.rhs)


class ValueAmong(Lookup):
    """``column = ANY(ARRAY[value])`` on a lookup column: see :meth:`Listing._branches`."""

    def get_prep_lookup(self) -> Any:
        return list(self.rhs)  # the values as given: the cast in the SQL types them

    def as_sql(self, compiler: Any, connection: Any) -> Any:
        lhs, lhs_params = self.process_lhs(compiler, connection)
        cast = self.lhs.output_field.cast_db_type(connection)
        return f"{lhs} = ANY(%s::{cast}[])", (*lhs_params, self.rhs)


#: The lookups an index of tasks_finished serves (migration 0036; ``pk``: its primary key).
FINISHED_INDEXED = frozenset({"pk", "queue", "task_path", "dedup_key", "holder"})


def _is_id_lookup(lookup: Q) -> bool:
    return (
        not lookup.negated
        and len(lookup.children) == 1
        and isinstance(lookup.children[0], tuple)
        and lookup.children[0][0] in ("pk", "id")
    )


def _one_column(lookup: Q) -> tuple[str, Any] | None:
    """(field name, value) of a lookup that is one equality on one indexed column of the table."""
    if lookup.negated or len(lookup.children) != 1 or not isinstance(lookup.children[0], tuple):
        return None
    name, value = lookup.children[0]
    if name == "pk" or "__" in name:
        return None
    return name, value


class Listing:
    """Tasks of ``base`` newest first, read as one ordered index scan per (status, lookup).

    ``lookups`` are alternatives (a search: id OR dedup key OR holder OR task path); a row that
    several of them find is listed once (branches are merged with UNION, or in a set). ``residual``
    is a condition no index covers: each branch reads at most ``SCAN_WINDOW`` rows to check it.
    """

    def __init__(
        self,
        base: QuerySet[Task],
        statuses: Iterable[str] = ALL_STATUSES,
        *,
        lookups: Sequence[Q] | None = None,
        residual: Q | None = None,
        finished: bool = True,
    ) -> None:
        self.base = base
        self.statuses = tuple(dict.fromkeys(statuses))
        self.lookups = [Q()] if lookups is None else list(lookups)
        self.residual = residual
        #: Pages, counts and the admin's ids read the finished statuses' rows moved to tasks_finished too.
        self.finished = finished
        #: Every id the last :meth:`count` found, newest first, when it found no more than its cap
        #: (it read them all; :meth:`ids` serves from them): None otherwise.
        self.counted: list[int] | None = None

    def _branches(self, before: int | None, lookups: Sequence[Q] | None = None) -> list[QuerySet[Task]]:
        """One query per (status, lookup) (of ``lookups``, the listing's by default), newest first,
        in an order only its own index gives.

        ``WHERE status = 'SUCCESSFUL' ORDER BY id DESC LIMIT n`` may be planned as a backward scan of
        the primary key filtering on the status (the planner assumes a status's rows are spread evenly
        over the ids), and after a burst of newer tasks of other statuses that scan steps over the
        whole burst before its first row. Ordered by (status, id) with the status given as a
        one-element array, the order is one the primary key cannot give, and the (…, status, id
        DESC) indexes give it directly: a page reads a page of index entries.

        Before PostgreSQL 17 a btree scan returns its rows in index order only when an ``= ANY``
        condition is on the index's first column. A lookup branch (``queue``, ``task_path``,
        ``holder``, ``dedup_key``: the first column of its ``(column, status, id DESC)`` index) so
        puts the array on that column instead, ``column = ANY(ARRAY[value]) AND status = …``,
        ordered by (column, status, id): the status is then a constant the order drops, the column
        is not, and only the lookup's index gives (column, id DESC), on every major. (With the array
        on the status behind the column, PostgreSQL 13-16 read every entry of the column and status
        and sorted them: 14,051 rows for a page after a burst.)"""
        branches = []
        for status in self.statuses:
            for lookup in self.lookups if lookups is None else lookups:
                column = _one_column(lookup)
                if column is None:
                    branch = self.base.filter(StatusAmong(F("status"), [status])).filter(lookup)
                    order: tuple[str, ...] = ("status", "-pk")
                else:
                    name, value = column
                    branch = self.base.filter(status=status).filter(ValueAmong(F(name), [value]))
                    order = (name, "status", "-pk")
                if before is not None:
                    branch = branch.filter(pk__lt=before)
                branches.append(branch.order_by(*order))
        return branches

    def _finished_branches(
        self, before: int | None, lookups: Sequence[Q] | None = None
    ) -> list[tuple[QuerySet[Any], bool]]:
        """The finished statuses' branches on tasks_finished (the mover's rows; issue 43), each with
        whether its ``hit`` flag filters (False: every row it reads is a hit).

        Each reads the status's partition, ``[WHERE lookup] ORDER BY id DESC``: its own day
        partitions, the backward scans of their indexes merged, so a page reads the days kept and a
        page of entries. The status there is a constant (``StatusPartition``), so the base's own
        conditions on it are decided once (a branch of a status the base excludes reads nothing) and
        a count or a page of ids is an index-only scan of ``(column, id)``. A lookup on ``id``,
        ``queue``, ``task_path``, ``dedup_key`` or ``holder`` has an index of its own there,
        ``(column, id)`` (migration 0036); any other lookup, and the residual, are checked within
        the window, as on tasks_task. A workflow's member is never moved
        (tasks/maintenance/archive.py): a workflow lookup reads nothing."""
        if not self.finished:
            return []
        branches: list[tuple[QuerySet[Any], bool]] = []
        for status in self.statuses:
            if status not in FINISHED_STATUSES:
                continue
            for lookup in self.lookups if lookups is None else lookups:
                column = _one_column(lookup)
                name = "pk" if _is_id_lookup(lookup) else (column[0] if column else None)
                if name == "workflow_id":
                    continue
                branch = self.base  # read from the status's partition (its status a constant there)
                unindexed = [] if name in FINISHED_INDEXED else [lookup]
                if not unindexed:
                    branch = branch.filter(lookup)
                if before is not None:
                    branch = branch.filter(pk__lt=before)
                conditions = [*unindexed, *([self.residual] if self.residual is not None else [])]
                hit = reduce(operator.and_, conditions) if conditions else Q(pk__isnull=False)
                flagged = in_finished(branch, status).annotate(hit=_flag(hit)).order_by("-pk").values_list("id", "hit")
                branches.append((flagged, bool(conditions)))
        return branches

    def page(self, *, limit: int, before: int | None = None, window: int | None = None) -> Page:
        """One page of ``limit`` tasks with ids below ``before``."""
        window = max(1, SCAN_WINDOW if window is None else window)
        if limit < 1:
            raise ValueError("a page holds at least one task")
        branches = self._branches(before)
        moved = self._finished_branches(before)
        if not branches and not moved:
            return Page([], None)
        floors: list[int] = []  # per branch: the id down to which it has been read, when it was cut short
        # The branches of both tables in one statement, one snapshot: a row the mover takes from
        # tasks_task to tasks_finished, or a rerun brings back (Task.objects.restore), is read in the
        # one table it is in at that instant. (Two statements read a row restored between them in
        # neither: the move is not one way.)
        plain = [branch.values_list("id")[: limit + 1] for branch in branches] if self.residual is None else []
        windowed: list[tuple[QuerySet[Any], bool]] = []
        if self.residual is not None:
            windowed = [
                (branch.annotate(hit=_flag(self.residual)).values_list("id", "hit"), True) for branch in branches
            ]
        windowed += moved
        hits = self._ids([(part, None) for part in plain] + [(rows[:window], limit + 1) for rows, _ in windowed])
        self._window_floors(windowed, hits[len(plain) :], limit, window, floors)
        floors += [min(ids) for ids in hits if len(ids) > limit]
        horizon = max(floors, default=None)
        ids = sorted({i for branch in hits for i in branch if horizon is None or i >= horizon}, reverse=True)
        next_before: int | None
        scanned_to: int | None
        if len(ids) > limit:
            ids, next_before, scanned_to = ids[:limit], ids[limit - 1], None
        else:
            next_before = scanned_to = horizon
        return Page(self.rows(ids), next_before, scanned_to)

    def _window_floors(
        self,
        windowed: Sequence[tuple[QuerySet[Any], bool]],
        hits: Sequence[list[int]],
        limit: int,
        window: int,
        floors: list[int],
    ) -> None:
        """A flagged branch (and whether its ``hit`` filters) cut short by its window adds where it
        stopped to ``floors``."""
        # A filtering branch that found less than a page within its window: did the window end
        # before the branch did? One more row tells; the ids above that row have all been checked.
        # (A branch whose every row is a hit read all it has when it found less than a page.)
        sparse = [i for i, ids in enumerate(hits) if len(ids) <= limit and windowed[i][1]]
        for read, lowest in self._extent([windowed[i][0][: window + 1] for i in sparse]):
            if read > window:
                floors.append(lowest + 1)

    def rows(self, ids: Sequence[int]) -> list[Task]:
        """The tasks of ``ids`` still in a listed status: one claimed (or finished) between the read of
        the ids and this one is left out, so that a state's page never shows a row of another state
        beside buttons that do not fit it (the demo's walk in a browser saw a Running row on the
        Ready page with Run now above it). An id not in tasks_task is looked for in tasks_finished
        after it (moved meanwhile, or read from there): ``archived``, no action fits it; one in
        neither is read from tasks_task once more (a rerun brought it back between the two reads)."""
        # Each row's state is judged at the instant of this read, on the database's clock (``db_now``,
        # Task.is_stuck): a lease that expires between the read and the page's rendering leaves its
        # row Running on the Running page, not Stuck there (the demo's walk in a browser saw one).
        base = with_db_clock(self.base)
        found = {task.pk: task for task in base.filter(pk__in=ids)} if ids else {}
        missing = [i for i in ids if i not in found]
        if missing and self.finished and FINISHED_STATUSES.intersection(self.statuses):
            found.update((task.pk, task) for task in archived(in_finished(self.base.filter(pk__in=missing))))
            # In neither: a rerun brought it back to tasks_task between the two reads (restore and
            # requeue commit together); it is there now. Only in that race does this read run.
            if lost := [i for i in missing if i not in found]:
                found.update((task.pk, task) for task in base.filter(pk__in=lost))
        return [found[i] for i in ids if i in found and found[i].status in self.statuses]

    def count(self, cap: int | None = None) -> Count:
        """How many tasks the listing has, up to ``cap`` (COUNT_CAP; no residual: admin listings).

        One statement. Each lookup's branches (disjoint: one status each, a row in one table at a
        time) are read as one stream that stops at ``cap + 1`` rows; with several lookups (a search),
        a row two of them find counts once: when one lookup alone passes the cap the count is capped
        and no other row is read, else the lookups' rows (at most ``cap`` each) are merged. (A UNION
        of every branch read each one to its own limit before the count began: a search by task
        path at 10 M retained counted 10,001 entries of every status in both tables.) Within the cap
        the ids read are kept (``counted``): the admin's page after the count reads no index again
        (a search descends into every day partition of each final status for each lookup)."""
        cap = COUNT_CAP if cap is None else cap
        self._unwindowed()
        streams: list[tuple[str, list[Any]]] = []
        for lookup in self.lookups:
            branches = [branch.values_list("id")[: cap + 1] for branch in self._branches(None, [lookup])]
            moved = self._moved_parts(cap + 1, [lookup])
            if branches or moved:
                sql, params = self._union(branches, moved, distinct=False)
                streams.append((f"SELECT u.id FROM ({sql}) AS u LIMIT %s", [*params, cap + 1]))
        if not streams:
            self.counted = []
            return Count(0, False)
        params = [value for _, stream_params in streams for value in stream_params]
        # Within the cap every row was read: their ids come back too, newest first, for ids().
        newest_first = "coalesce(array_agg(m.id ORDER BY m.id DESC), '{}'::bigint[])"
        if len(streams) == 1:
            sql = f"SELECT CASE WHEN count(*) > %s THEN NULL ELSE {newest_first} END FROM ({streams[0][0]}) AS m"
            params.insert(0, cap)
        else:
            names = [f"s{index}" for index in range(len(streams))]
            ctes = ", ".join(
                f"{name} AS MATERIALIZED ({stream})" for name, (stream, _) in zip(names, streams, strict=True)
            )
            over = " OR ".join(f"(SELECT count(*) FROM {name}) > %s" for name in names)
            merged = " UNION ".join(f"SELECT id FROM {name}" for name in names)
            sql = (
                f"WITH {ctes} SELECT CASE WHEN {over} THEN NULL"
                f" ELSE (SELECT CASE WHEN count(*) > %s THEN NULL ELSE {newest_first} END FROM ({merged}) AS m) END"
            )
            params += [cap] * len(names) + [cap]
        with connections[self.base.db].cursor() as cursor:
            cursor.execute(sql, params)
            ids = cursor.fetchone()[0]
        self.counted = ids
        return Count(cap, True) if ids is None else Count(len(ids), False)

    def ids(self, offset: int, limit: int) -> list[int]:
        """Ids of rows ``offset`` to ``offset + limit`` (admin pages: offsets stay below COUNT_CAP):
        from the count's when it read every row (:meth:`count`, the statement before on an admin
        page), else read."""
        self._unwindowed()
        if self.counted is not None:
            return self.counted[max(offset, 0) : max(offset, 0) + max(limit, 0)]
        branches = [branch.values_list("id")[: offset + limit] for branch in self._branches(None)]
        moved = self._moved_parts(offset + limit) if limit > 0 else []
        if (not branches and not moved) or limit <= 0:  # (a slice [:0] is an empty query, which does not compile)
            return []
        union, params = self._union(branches, moved)
        with connections[self.base.db].cursor() as cursor:
            cursor.execute(
                f"SELECT id FROM ({union}) AS u ORDER BY id DESC LIMIT %s OFFSET %s", [*params, limit, offset]
            )
            return [row[0] for row in cursor.fetchall()]

    def _unwindowed(self) -> None:
        if self.residual is not None:
            raise TypeError("count() and ids() read whole branches: a listing with a residual has only pages")

    def _moved_parts(self, rows: int, lookups: Sequence[Q] | None = None) -> list[tuple[str, tuple[Any, ...]]]:
        """The finished branches on tasks_finished for count() and ids() (of ``lookups``, the
        listing's by default): each its first ``rows`` ids (a branch whose lookup no index there
        serves: the hits among its first SCAN_WINDOW rows, a bounded read, so such a count is a
        lower bound)."""
        parts = []
        for flagged, filters in self._finished_branches(None, lookups):
            sql, params = _compiled(flagged[: SCAN_WINDOW if filters else rows])
            parts.append((f'SELECT w.id FROM ({sql}) AS w WHERE w."hit"', params))
        return parts

    def _union(
        self,
        parts: Sequence[QuerySet[Any]],
        moved: Sequence[tuple[str, tuple[Any, ...]]] = (),
        *,
        distinct: bool | None = None,
    ) -> tuple[str, list[Any]]:
        """One statement (one snapshot: a row the mover takes meanwhile is read once) over tasks_task's
        branches and tasks_finished's (``moved``, from :meth:`_moved_parts`)."""
        sqls: list[str] = []
        params: list[Any] = []
        for part in parts:
            sql, part_params = _compiled(part)
            sqls.append(f"({sql})")
            params.extend(part_params)
        for sql, part_params in moved:
            sqls.append(f"({sql})")
            params.extend(part_params)
        # Branches of different statuses are disjoint: UNION ALL, read lazily up to the LIMIT. With
        # several lookups, UNION: a row found by two of them counts once (a hash of at most a few
        # branches of ids; excluding the other lookups in each branch would spoil its index-only scan).
        # (``distinct`` False: the parts are of one lookup.)
        distinct = len(self.lookups) > 1 if distinct is None else distinct
        return (" UNION " if distinct else " UNION ALL ").join(sqls), params

    def _ids(self, parts: Sequence[tuple[QuerySet[Any], int | None]]) -> list[list[int]]:
        """The ids each part returns, in one statement: a part given a limit is a flagged window, its
        hits (``hit``) up to that many, newest first; one without, every id it returns."""
        sqls: list[str] = []
        params: list[Any] = []
        for index, (part, limit) in enumerate(parts):
            sql, part_params = _compiled(part)
            where, tail = ('w."hit"', f" ORDER BY w.id DESC LIMIT {int(limit)}") if limit is not None else ("true", "")
            sqls.append(f"(SELECT {index}, w.id FROM ({sql}) AS w WHERE {where}{tail})")
            params.extend(part_params)
        result: list[list[int]] = [[] for _ in parts]
        if not parts:
            return result
        with connections[self.base.db].cursor() as cursor:
            cursor.execute(" UNION ALL ".join(sqls), params)
            for index, pk in cursor.fetchall():
                result[index].append(pk)
        return result

    def _extent(self, parts: Sequence[QuerySet[Any]]) -> list[tuple[int, int]]:
        """(rows read, lowest id) of each window."""
        if not parts:
            return []
        sqls: list[str] = []
        params: list[Any] = []
        for index, part in enumerate(parts):
            sql, part_params = _compiled(part)
            sqls.append(f"(SELECT {index}, count(*), min(w.id) FROM ({sql}) AS w)")
            params.extend(part_params)
        with connections[self.base.db].cursor() as cursor:
            cursor.execute(" UNION ALL ".join(sqls), params)
            extents = {row[0]: (row[1], row[2]) for row in cursor.fetchall()}
        return [extents[index] for index in range(len(parts))]


def state_listing(
    state: str, *, queue: str | None = None, search: str = "", matched_paths: list[str] | None = None
) -> Listing:
    """A dashboard state's tasks, optionally in one queue and matching a search (the task paths it
    named by their last part appended to ``matched_paths``)."""
    spec = STATES[state]
    base = spec.base()
    if queue and "\x00" in queue:  # no queue has that name (PostgreSQL text cannot hold NUL)
        return Listing(base, (spec.status,), lookups=[])
    lookups: list[Q] | None = None
    unindexed: list[Q] = []  # conditions left over once a lookup's index drives the scan
    if search:
        lookups = search_lookups(search, matched_paths)
        if queue:
            unindexed.append(Q(queue=queue))
    elif queue:
        lookups = [Q(queue=queue)]
    if lookups and not spec.indexed_lookups:
        unindexed.insert(0, any_of(lookups))
        lookups = None
    if lookups is not None and spec.where:
        unindexed.append(spec.where)
    else:
        base = base.filter(spec.where)
    if spec.unindexed:
        unindexed.append(spec.unindexed)
    if spec.bounded:
        return Listing(base.filter(*unindexed), (spec.status,), lookups=lookups)
    residual = reduce(operator.and_, unindexed) if unindexed else None
    return Listing(base, (spec.status,), lookups=lookups, residual=residual)


class ListingPaginator(Paginator):
    """An admin paginator over a :class:`Listing`: the count stops at COUNT_CAP (``capped`` tells),
    so there are at most COUNT_CAP / per_page pages and no page reads more than COUNT_CAP rows."""

    def __init__(self, listing: Listing, per_page: int, orphans: int = 0, allow_empty_first_page: bool = True) -> None:
        super().__init__(listing.base, per_page, orphans, allow_empty_first_page)
        self.listing = listing

    @cached_property
    def _bounded(self) -> Count:
        return self.listing.count()

    @cached_property
    def count(self) -> int:
        return self._bounded.value

    @property
    def capped(self) -> bool:
        return self._bounded.capped

    def page(self, number: Any) -> PaginatorPage:
        # Paginator.page, with the slice read from the listing's ordered index scans.
        number = self.validate_number(number)
        bottom = (number - 1) * self.per_page
        top = bottom + self.per_page
        if top + self.orphans >= self.count:
            top = self.count
        rows = self.listing.rows(self.listing.ids(bottom, top - bottom)) if top > bottom else []
        return PaginatorPage(rows, number, self)


# -- plumbing ---------------------------------------------------------------------------------------


def _flag(condition: Q) -> ExpressionWrapper[Any]:
    return ExpressionWrapper(condition, output_field=BooleanField())


def _compiled(queryset: QuerySet[Any]) -> tuple[str, tuple[Any, ...]]:
    sql, params = queryset.query.get_compiler(using=queryset.db).as_sql()
    return sql, tuple(params)
