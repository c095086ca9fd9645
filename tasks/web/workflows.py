"""Workflows as the operator sees them (dashboard, JSON API, admin, ``/metrics``): the list, one
workflow's members, a task's parents and children.

Every read here costs a page, one workflow's members or a cap, never the history (invariant 12):

- The **list** is newest first: from the primary key when it shows every status, else from
  tasks_workflow_status_idx (status, id DESC) in an order only that index gives (the status as a
  one-element array, ordered by status and id: see tasks/web/listings.py ``Listing._branches``, the
  same trap on the tasks table), so a page of failed workflows never steps over a newer burst of
  successful ones.
- **Counts** of workflows per status stop at ``COUNT_CAP``, each read from the status index from
  its status on (the shape of tasks/web/queries.py's ``_STATUS_COUNT_SQL``). Running workflows (the
  metric) read only the running ones.
- A workflow's **members** are counted per status with MEMBER_COUNTS_SQL (one grouped scan of
  tasks_task_workflow_idx: its own members, whatever else the table holds) and listed newest first
  as a :class:`~tasks.web.listings.Listing` whose lookup is the workflow: one branch per status it
  has members in, each through tasks_task_workflow_idx (workflow_id, status), the workflow id
  given as an array so that the primary key cannot serve the order (a backward scan of it would
  step over every task newer than the workflow).
- A task's **parents and children** are read from the edge indexes, (child_id, parent_id) and the
  unique (parent_id, child_id), at most a page each, and counted up to ``COUNT_CAP`` only when there
  are more (a group's callback has as many parents as the group has members).
"""

from __future__ import annotations

from dataclasses import dataclass

from django.db import connections
from django.db.models import F, Q

from leasing.routing import selected_database
from tasks.lifecycle.workflows import MEMBER_COUNTS_SQL, WorkflowStatus
from tasks.models import Task, TaskDependency, Workflow
from tasks.web.listings import ALL_STATUSES, Listing, StatusAmong
from tasks.web.queries import COUNT_CAP, Count, bounded_count

WORKFLOW_STATUSES: tuple[str, ...] = tuple(WorkflowStatus.values)
#: Parents and children a task's page lists (each list ordered by id).
EDGES_SHOWN = 50

# Per status, the workflows counted up to a cap from tasks_workflow_status_idx (status, id DESC), read
# in its own order over the status alone (as tasks/web/queries.py counts tasks): a range closed on both
# sides, not an equality, so no other index gives the order and the plan cannot be a backward scan of
# the primary key filtering on the status (after a burst of newer workflows of other statuses it would
# step over the whole burst). A status reads its own entries, at most ``limit``: counting the running
# workflows costs the running ones, whatever history lies beside them.
WORKFLOW_COUNTS_SQL = """
SELECT s.status,
       (SELECT count(*) FROM (SELECT 1 FROM tasks_workflow AS w WHERE w.status >= s.status AND w.status <= s.status
                              ORDER BY w.status, w.id DESC LIMIT %(limit)s) AS n)
FROM unnest(%(statuses)s::text[]) AS s(status)
"""


@dataclass(frozen=True)
class WorkflowPage:
    workflows: list[Workflow]
    #: Continue with ``before=next_before`` (ids below it); None: nothing older.
    next_before: int | None


def workflow_page(status: str | None = None, *, limit: int, before: int | None = None) -> WorkflowPage:
    """Workflows newest first (of one status), ``limit`` of them with ids below ``before``."""
    rows = Workflow.objects.all()
    if before is not None:
        rows = rows.filter(pk__lt=before)
    if status is None:
        rows = rows.order_by("-pk")
    else:
        rows = rows.filter(StatusAmong(F("status"), [status])).order_by("status", "-pk")
    found = list(rows[: limit + 1])
    return WorkflowPage(found[:limit], found[limit - 1].pk if len(found) > limit else None)


def workflow_counts(statuses: tuple[str, ...] = WORKFLOW_STATUSES, cap: int = COUNT_CAP) -> dict[str, Count]:
    """Workflows per status (of the selected database), each counted up to ``cap``; one statement."""
    with connections[selected_database()].cursor() as cursor:
        cursor.execute(WORKFLOW_COUNTS_SQL, {"statuses": list(statuses), "limit": cap + 1})
        found = {status: int(n) for status, n in cursor.fetchall()}
    return {status: Count(min(found[status], cap), found[status] > cap) for status in statuses}


def running_workflows(cap: int = COUNT_CAP) -> Count:
    """Workflows RUNNING now: a read of the running ones only."""
    return workflow_counts((WorkflowStatus.RUNNING.value,), cap)[WorkflowStatus.RUNNING]


def member_counts(workflow_id: int) -> dict[str, int]:
    """A workflow's members per task status (every status, 0 when it has none), in one grouped
    scan of tasks_task_workflow_idx."""
    with connections[selected_database()].cursor() as cursor:
        cursor.execute(MEMBER_COUNTS_SQL, {"id": workflow_id})
        found = {status: int(n) for status, n in cursor.fetchall()}
    return {status: found.get(status, 0) for status in ALL_STATUSES}


def member_listing(workflow_id: int, counts: dict[str, int], status: str | None = None) -> Listing:
    """A workflow's members newest first (of one status): one branch per status it has members in
    (``counts``, from :func:`member_counts`), each through tasks_task_workflow_idx."""
    statuses = [s for s, n in counts.items() if n and (status is None or s == status)]
    return Listing(Task.objects.all(), statuses, lookups=[Q(workflow_id=workflow_id)])


@dataclass(frozen=True)
class Edge:
    """A parent or a child of a task: the other end, as it stands now."""

    task_id: int
    #: None: the task is gone (pruned).
    status: str | None
    task_path: str
    on_failure: str
    pipe: bool


@dataclass(frozen=True)
class Edges:
    """The first EDGES_SHOWN parents and children of a task, by id, and how many there are."""

    parents: list[Edge]
    parent_count: Count
    children: list[Edge]
    child_count: Count

    @property
    def any(self) -> bool:
        return bool(self.parents or self.children)


def edges(task_id: int, *, shown: int = EDGES_SHOWN) -> Edges:
    """A task's parents and children (TaskDependency rows) with the other end's status."""
    ups = TaskDependency.objects.filter(child_id=task_id)
    downs = TaskDependency.objects.filter(parent_id=task_id)
    parent_rows = list(ups.order_by("parent_id").values_list("parent_id", "on_failure", "pipe")[: shown + 1])
    child_rows = list(downs.order_by("child_id").values_list("child_id", "on_failure", "pipe")[: shown + 1])
    parent_rows, parent_more = parent_rows[:shown], len(parent_rows) > shown
    child_rows, child_more = child_rows[:shown], len(child_rows) > shown
    ids = [row[0] for row in (*parent_rows, *child_rows)]
    found = {
        pk: (status, path)
        for pk, status, path in Task.objects.filter(pk__in=ids).values_list("pk", "status", "task_path")
    }

    def edge(row: tuple[int, str, bool]) -> Edge:
        status, path = found.get(row[0], (None, ""))
        return Edge(row[0], status, path, row[1], row[2])

    return Edges(
        [edge(row) for row in parent_rows],
        bounded_count(ups) if parent_more else Count(len(parent_rows), False),
        [edge(row) for row in child_rows],
        bounded_count(downs) if child_more else Count(len(child_rows), False),
    )
