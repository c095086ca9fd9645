"""``/dashboard/tasks/``: every task, newest first, filtered by status (its label), queue, task path, the
keys a task has, workflow, enqueue time and the search of the state pages; its cost depends on the page,
not on the table (invariant 12).

The listing is :class:`tasks.web.listings.Listing` once per group of statuses that read the same way,
merged by id. One filter drives each group: the most selective equality whose page index covers
the group's statuses (workflow, dedup key, task path, queue: each index is (column, status, id DESC));
with none, the status index drives it. Every other filter (the keys no page index holds, the time
range, a driving column the status's index does not cover) is checked within the bounded scan window
of the state pages: a page may then come back short, with a link to go on below what was looked at.
RUNNING rows are bounded by the workers: every filter is checked on them directly.
"""

from __future__ import annotations

import datetime as dt
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import reduce
from typing import Any

from django.db.models import Q
from django.utils import timezone

from leasing.validation import MAX_BIGINT, InvalidInput, clean_text, parse_iso_datetime, parse_whole
from tasks.lifecycle import vocabulary
from tasks.lifecycle.states import TaskStatus
from tasks.models import Task
from tasks.web.listings import ALL_STATUSES, Listing, Page
from tasks.web.queries import search_lookups

_OWN_WAY = (TaskStatus.RUNNING, TaskStatus.AWAITING, TaskStatus.BLOCKED)
_FINISHED_AND_READY = (TaskStatus.READY, TaskStatus.SUCCESSFUL, TaskStatus.FAILED, TaskStatus.CANCELLED)

#: Equality filters, in the order they are preferred to drive a page: field -> the statuses whose
#: page index starts with that column (tasks/models/task.py, ``*_newest_idx``, ``*_page_idx``).
DRIVING: dict[str, tuple[str, ...]] = {
    "workflow_id": ALL_STATUSES,
    "dedup_key": ALL_STATUSES,
    "task_path": _FINISHED_AND_READY,
    # Not BLOCKED: tasks_task_blocked_page_idx serves a page, but a scan window of it (LIMIT 2,000,
    # when another filter is checked too) was planned as a bitmap of every blocked task of the queue
    # and a sort; the status index read in its order stops at the window.
    "queue": _FINISHED_AND_READY,
}
#: Text filters (query parameter = model field) and their longest value.
TEXT_FILTERS: dict[str, int] = {
    "queue": 100,
    "task_path": 255,
    "dedup_key": 255,
    "concurrency_key": 255,
    "rate_key": 255,
    "fair_key": 255,
    "debounce_key": 255,
}


@dataclass(frozen=True)
class Filters:
    statuses: tuple[str, ...] = ALL_STATUSES
    equal: dict[str, Any] = field(default_factory=dict)
    enqueued_after: dt.datetime | None = None
    enqueued_before: dt.datetime | None = None
    search: str = ""

    @property
    def status_labels(self) -> list[str]:
        return [vocabulary.label(s) for s in self.statuses] if self.statuses != ALL_STATUSES else []


def _moment(text: str, name: str) -> dt.datetime:
    try:
        # One reading on every Python (Django's parse_datetime reads more on 3.11+, via fromisoformat).
        moment = parse_iso_datetime(text.strip())
    except ValueError:  # not the extended format, or impossible (month 13): a 400, not a 500
        raise InvalidInput(f"{name} must be a date and time such as 2026-01-31T09:30:00+00:00", name) from None
    if timezone.is_naive(moment):
        moment = timezone.make_aware(moment, dt.timezone.utc)  # the zone the pages state
    return moment


def parse_filters(params: Mapping[str, Any], getlist: Callable[[str], list[str]]) -> Filters:
    """The filters of a query string; raises InvalidInput naming the first bad one."""
    statuses: list[str] = []
    for text in getlist("status"):
        for part in text.split(","):
            if not part.strip():
                continue
            status = vocabulary.status_from_label(part)
            if status is None:
                names = ", ".join(s.label for s in vocabulary.STATUSES.values())
                raise InvalidInput(f"status {part.strip()!r} is not one of {names}", "status")
            statuses.append(status)
    equal: dict[str, Any] = {}
    for name, longest in TEXT_FILTERS.items():
        value = (params.get(name) or "").strip()
        if value:
            equal[name] = clean_text(value, name, max_length=longest)
    workflow = (params.get("workflow") or "").strip()
    if workflow:
        equal["workflow_id"] = parse_whole(workflow, "workflow", low=1, high=MAX_BIGINT)
    after, before = (params.get("enqueued_after") or "").strip(), (params.get("enqueued_before") or "").strip()
    search = (params.get("q") or "").strip()
    if search:
        search = clean_text(search, "search", max_length=1000)
    return Filters(
        statuses=tuple(dict.fromkeys(statuses)) or ALL_STATUSES,
        equal=equal,
        enqueued_after=_moment(after, "enqueued_after") if after else None,
        enqueued_before=_moment(before, "enqueued_before") if before else None,
        search=search,
    )


def _all_of(conditions: list[Q]) -> Q | None:
    return reduce(operator.and_, conditions) if conditions else None


def listings(filters: Filters, using: str, matched_paths: list[str] | None = None) -> list[Listing]:
    """One :class:`Listing` per group of statuses read the same way (the task paths a search named by
    their last part appended to ``matched_paths``)."""
    lookups: list[Q] | None = (
        search_lookups(filters.search, matched_paths) if filters.search else None
    )  # may raise InvalidInput
    times: list[Q] = []
    if filters.enqueued_after is not None:
        times.append(Q(enqueued_at__gte=filters.enqueued_after))
    if filters.enqueued_before is not None:
        times.append(Q(enqueued_at__lt=filters.enqueued_before))
    base = Task.objects.using(using)
    groups: dict[tuple[Any, ...], list[str]] = {}
    for status in filters.statuses:
        if status == TaskStatus.RUNNING or lookups is not None:
            driver = None
        else:
            driver = next((f for f in DRIVING if f in filters.equal and status in DRIVING[f]), None)
        # RUNNING, AWAITING and BLOCKED read their own way (below): each is a group of its own.
        alone = status if status in _OWN_WAY else ""
        groups.setdefault((driver, alone), []).append(status)
    result = []
    for (driver, _), statuses in groups.items():
        rest = [Q(**{name: value}) for name, value in filters.equal.items() if name != driver] + times
        if TaskStatus.RUNNING in statuses:  # bounded: every condition on it directly (alone in its group)
            result.append(Listing(base.filter(*rest), statuses, lookups=lookups))
            continue
        own: list[Q] | None = lookups
        if lookups is not None and statuses[0] in _OWN_WAY:
            # No task-path page index holds awaiting or blocked tasks: the search is checked within the
            # status's window.
            rest.insert(0, reduce(operator.or_, lookups) if lookups else Q(pk__in=[]))
            own = None
        if driver is not None:
            own = [Q(**{driver: filters.equal[driver]})]
        result.append(Listing(base, statuses, lookups=own, residual=_all_of(rest)))
    return result


def page(
    filters: Filters, *, using: str, limit: int, before: int | None, matched_paths: list[str] | None = None
) -> Page:
    """One page of the merged listings: the newest ``limit`` tasks below ``before`` that every group
    has looked at (a group cut short by its window stops the page where it stopped)."""
    pages = [listing.page(limit=limit, before=before) for listing in listings(filters, using, matched_paths)]
    if len(pages) == 1:
        return pages[0]
    horizon = max((p.next_before for p in pages if p.next_before is not None), default=None)
    tasks = sorted(
        (t for p in pages for t in p.tasks if horizon is None or t.pk >= horizon), key=lambda t: t.pk, reverse=True
    )
    if len(tasks) > limit:
        return Page(tasks[:limit], tasks[limit - 1].pk, None)
    windowed = any(p.scanned_to is not None and p.scanned_to == horizon for p in pages)
    return Page(tasks, horizon, horizon if windowed else None)
