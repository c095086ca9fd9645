"""A bulk retry of failed chains while a real worker process runs them (issue 38, the third
reproduction): the operation's batches split parents from their dependants, so a dependant is requeued
while its parent's rerun finishes on the worker. Before the settle was serialised on the workflow
(migration 0027), 0-2 of 300 chains stayed RUNNING for ever, their dependant AWAITING a SUCCESSFUL
parent. Every workflow must end SUCCESSFUL, with no repair made."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.lifecycle.values import Failure
from tasks.maintenance.bulk import BulkRunner
from tasks.models import BulkOperation, Repair, Task
from tasks.models import Workflow as WorkflowRow
from tasks.workflows import chain, step
from tests.helpers import start_manage, stop_process, wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.one_stack]

NOOP = "tests.testapp.handlers.noop"
CHAINS = 300


def failed_chains(n: int) -> list[int]:
    """``n`` chains(A, B) whose A failed for good (B cancelled under on_failure="cancel")."""
    flows = [
        chain(step(NOOP).options(queue="bulkflows"), step(NOOP).options(queue="bulkflows"), pipe=False).enqueue()
        for _ in range(n)
    ]
    claimed = Task.objects.claim("setup", limit=n, queues=["bulkflows"])
    assert len(claimed) == n
    Task.objects.fail_many("setup", [Failure(t.id, t.token, "builtins.ValueError", "no", retry=False) for t in claimed])
    assert set(WorkflowRow.objects.filter(pk__in=[f.id for f in flows]).values_list("status", flat=True)) == {"FAILED"}
    return [f.id for f in flows]


def test_a_bulk_retry_of_failed_chains_beside_a_worker_ends_every_chain(tmp_path: Path) -> None:
    flows = failed_chains(CHAINS)
    worker = start_manage(
        tmp_path / "worker.log",
        "run_worker",
        "--queues",
        "bulkflows",
        "--concurrency",
        "4",
        "--no-recovery",
        "--poll-interval",
        "0.05",
    )
    try:
        BulkOperation.objects.request("retry", {"queue": "bulkflows"}, requested_by="ops")
        # One task a batch: every chain's dependant is requeued just after its parent, as the worker runs it.
        BulkRunner(batch_size=1).run_until_idle()
        running = WorkflowRow.objects.filter(pk__in=flows, status="RUNNING")
        wait_until(lambda: not running.exists(), 120, what="every chain to end")
    finally:
        stop_process(worker)
    assert set(WorkflowRow.objects.filter(pk__in=flows).values_list("status", flat=True)) == {"SUCCESSFUL"}
    assert not Task.objects.filter(workflow_id__in=flows).exclude(status="SUCCESSFUL").exists()
    assert not Repair.objects.exists()
