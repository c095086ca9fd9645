"""/metrics for workflows: running workflows and awaiting tasks, with the right numbers, each read at
a cost bounded by what it counts (or its cap), never by the history."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection
from django.test import Client

from leasing.metrics import scrape_values
from tasks.models import Task, Workflow
from tasks.web.queries import state_counts
from tasks.web.workflows import WORKFLOW_COUNTS_SQL, running_workflows
from tasks.workflows import chain, group, step
from tests.helpers.plans import add_rows, explained, overreads, recorded
from tests.helpers.task_paths import NOOP

pytestmark = pytest.mark.django_db(transaction=True)

RUNNING = 'tasks_workflows{database="default",status="RUNNING"}'
AWAITING = 'tasks_awaiting{database="default"}'
AWAITING_STATE = 'tasks_tasks{database="default",state="awaiting"}'


def scrape(client: Client) -> dict[str, float]:
    response = client.get("/metrics")
    assert response.status_code == 200
    return scrape_values(response.content.decode())


def test_running_workflows_and_awaiting_tasks_are_gauges(client: Client, settings: Any) -> None:
    settings.LEASING_METRICS_PUBLIC = True
    before = scrape(client)
    assert (before[RUNNING], before[AWAITING], before[AWAITING_STATE]) == (0, 0, 0)

    chained = chain(step(NOOP), step(NOOP), step(NOOP)).enqueue()  # two awaiting
    grouped = group([step(NOOP) for _ in range(4)], then=step(NOOP)).enqueue()  # one awaiting
    values = scrape(client)
    assert (values[RUNNING], values[AWAITING], values[AWAITING_STATE]) == (2, 3, 3)

    Workflow.objects.filter(pk=chained.id).cancel()
    values = scrape(client)
    assert (values[RUNNING], values[AWAITING], values[AWAITING_STATE]) == (1, 1, 1)

    for task in Task.objects.claim("w1", limit=10):
        Task.objects.complete_many("w1", [(task.id, task.token, "null")])
    assert Task.objects.get(pk=grouped.callback_id).status == "READY"  # released by the last member
    values = scrape(client)
    assert (values[RUNNING], values[AWAITING]) == (1, 0)
    (callback,) = Task.objects.claim("w1", limit=1)
    Task.objects.complete_many("w1", [(callback.id, callback.token, "null")])
    assert scrape(client)[RUNNING] == 0


def add_workflows(status: str, n: int) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO tasks_workflow (name, kind, status, total, remaining, failed, created_at, finished_at)"
            " SELECT '', 'graph', %(status)s, 1, %(left)s, 0, now(), CASE WHEN %(status)s <> 'RUNNING' THEN now() END"
            " FROM generate_series(1, %(n)s)",
            {"status": status, "n": n, "left": int(status == "RUNNING")},
        )


def workflow_reads(plan: dict[str, Any]) -> list[tuple[str, float]]:
    found = []
    if plan.get("Relation Name") == "tasks_workflow" or plan.get("Index Name", "").startswith("tasks_workflow"):
        read = plan["Actual Rows"] + plan.get("Rows Removed by Filter", 0)
        found.append((f"{plan['Node Type']} {plan.get('Index Name', '')}", read))
    for child in plan.get("Plans", []):
        found += workflow_reads(child)
    return found


def test_the_running_count_reads_the_running_workflows_not_the_history() -> None:
    """A few running workflows between a long history of finished ones on both sides of the status
    order (FAILED before RUNNING, SUCCESSFUL after it) and a newer burst: the count reads the
    running ones' entries of the status index, and nothing of the history."""
    add_workflows("SUCCESSFUL", 20_000)
    add_workflows("RUNNING", 7)
    add_workflows("FAILED", 5_000)
    add_workflows("SUCCESSFUL", 20_000)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE tasks_workflow")
    assert running_workflows().value == 7
    assert (running_workflows(cap=5).value, running_workflows(cap=5).capped) == (5, True)
    plan = explained(WORKFLOW_COUNTS_SQL, {"statuses": ["RUNNING"], "limit": 10_001})
    reads = workflow_reads(plan)
    # A few running ones: a bitmap scan of their entries; many: the index in its order, up to the cap.
    assert any("tasks_workflow_status_idx" in node for node, _ in reads), reads
    assert not any(node.startswith("Seq Scan") for node, _ in reads), reads
    assert all(read <= 7 for _, read in reads), reads
    plan = explained(WORKFLOW_COUNTS_SQL, {"statuses": ["RUNNING"], "limit": 4})
    assert all(read <= 4 for _, read in workflow_reads(plan)), workflow_reads(plan)

    # Many running (a burst the statistics have not seen yet): the count stops at its cap.
    add_workflows("RUNNING", 20_000)
    assert (running_workflows(cap=100).value, running_workflows(cap=100).capped) == (100, True)
    plan = explained(WORKFLOW_COUNTS_SQL, {"statuses": ["RUNNING"], "limit": 101})
    assert all(read <= 101 for _, read in workflow_reads(plan)), workflow_reads(plan)


def test_the_awaiting_count_reads_at_most_its_cap_after_a_burst() -> None:
    """History, then a burst of awaiting members and a burst of waiting tasks: counting the awaiting
    ones reads about ``cap`` entries of the status index, whatever lies around them."""
    cap = 100
    add_rows("bulk", "SUCCESSFUL", 6_000)
    add_rows("bulk", "AWAITING", 3_000)
    add_rows("bulk", "READY", 6_000)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE tasks_task")
    with recorded() as statements:
        counts = state_counts(cap)
    assert (counts["awaiting"].value, counts["awaiting"].capped) == (cap, True)
    problems = overreads(statements, 2 * cap)
    assert not problems, "\n".join(problems)


def test_a_count_of_a_small_status_reads_its_own_entries_not_the_cap() -> None:
    """No workflow at all: the awaiting count (like every status count) stops at the end of its
    status in the index instead of reading the cap's worth of the statuses after it."""
    add_rows("bulk", "CANCELLED", 3_000)
    add_rows("bulk", "SUCCESSFUL", 3_000)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE tasks_task")
    with recorded() as statements:
        counts = state_counts()
    assert (counts["awaiting"].value, counts["blocked"].value, counts["cancelled"].value) == (0, 0, 3_000)
    counting = [
        (sql, params) for sql, params in statements if isinstance(params, dict) and params.get("status") == "AWAITING"
    ]
    assert len(counting) == 1
    assert not overreads(counting, 0), overreads(counting, 0)
