""" "Run again" has one definition (RERUN_SET, tasks/lifecycle/transitions.py): a requeue and a bulk
retry leave a finished task the same, column for column, each in one UPDATE on the database clock."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from tasks import tracing
from tasks.lifecycle import bulk
from tasks.lifecycle.transitions import RERUN_SET, rerun_set_sql
from tasks.maintenance.bulk import BulkRunner
from tasks.models import BulkOperation, Task, TaskStatus
from tests.helpers import db_now
from tests.helpers.task_paths import NOOP

pytestmark = pytest.mark.django_db(transaction=True)

# Every column RERUN_SET writes, each with a value a run again must not keep.
WORN: dict[str, Any] = {
    "status": TaskStatus.FAILED,
    "attempts": 3,
    "failures": 2,
    "crashes": 1,
    "shared_crashes": 1,
    "unstarted_returns": 1,
    "attempt_started": True,
    "finished_at": dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc),
    "snoozed_at": dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc),
    "run_after": dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc),
    "trace_context": {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
    "fair_key": None,  # in a fair queue: enqueued before the queue was fair
}
FAIR = ["by-requeue", "by-bulk", "fair-keyed"]


@pytest.fixture(autouse=True)
def rerun_queues_are_fair(settings: Any) -> None:
    settings.LEASING_TASKS = {**getattr(settings, "LEASING_TASKS", {}), "FAIR_QUEUES": FAIR}


def worn_task(queue: str) -> int:
    task_id = int(Task.objects.enqueue(NOOP, queue=queue).id)
    Task.objects.filter(pk=task_id).update(**WORN)
    return task_id


def written(task_id: int) -> dict[str, Any]:
    return Task.objects.filter(pk=task_id).values(*RERUN_SET).get()


def test_the_fragment_names_every_column_the_tests_wear_out() -> None:
    assert set(RERUN_SET) == set(WORN)
    assert f'"{tracing.RERUN_KEY}": "1"' in RERUN_SET["trace_context"]  # the key tasks/tracing.py reads


def test_both_bulk_retry_statements_write_the_fragment() -> None:
    assert rerun_set_sql() in bulk.BULK_RETRY_SQL and rerun_set_sql() in bulk.BULK_RETRY_ONE_SQL


def test_a_requeue_and_a_bulk_retry_leave_a_finished_task_the_same(django_assert_num_queries: Any) -> None:
    requeued, retried = worn_task("by-requeue"), worn_task("by-bulk")
    before = db_now()
    with django_assert_num_queries(1) as queries:  # autocommit: no savepoint, one UPDATE
        assert Task.objects.filter(pk=requeued).requeue() == 1
    assert queries.captured_queries[0]["sql"].startswith("UPDATE")
    BulkOperation.objects.request("retry", {"queue": "by-bulk"}, requested_by="test")
    assert BulkRunner(batch_size=10, span=25).run_until_idle() == 1
    after = db_now()
    mine, theirs = written(requeued), written(retried)
    # Written now on the database clock, by both.
    assert before <= mine.pop("run_after") <= after and before <= theirs.pop("run_after") <= after
    assert mine == theirs
    assert mine == {
        "status": TaskStatus.READY,
        "attempts": 0,
        "failures": 0,
        "crashes": 0,
        "shared_crashes": 0,
        "unstarted_returns": 0,
        "attempt_started": False,
        "finished_at": None,
        "snoozed_at": None,
        "trace_context": {**WORN["trace_context"], tracing.RERUN_KEY: "1"},
        "fair_key": "",  # the shared key, as an enqueue into the fair queue gives
    }


def test_a_fair_key_is_kept_and_a_plain_queues_null_stays_null() -> None:
    """Only a keyless task of a fair queue takes the shared key; a tenant's key survives a run again,
    and a plain queue's task stays out of the fair index (NULL), by requeue and by bulk retry alike."""
    keyed = Task.objects.enqueue(NOOP, queue="fair-keyed", fair_key="tenant-7").id
    plain = Task.objects.enqueue(NOOP, queue="plain").id
    Task.objects.filter(pk__in=[keyed, plain]).update(status=TaskStatus.FAILED)
    assert Task.objects.filter(pk__in=[keyed, plain]).requeue() == 2
    assert dict(Task.objects.filter(pk__in=[keyed, plain]).values_list("pk", "fair_key")) == {
        keyed: "tenant-7",
        plain: None,
    }
    Task.objects.filter(pk__in=[keyed, plain]).update(status=TaskStatus.FAILED)
    for queue in ("fair-keyed", "plain"):
        BulkOperation.objects.request("retry", {"queue": queue}, requested_by="test")
    assert BulkRunner(batch_size=10, span=25).run_until_idle() == 2
    assert dict(Task.objects.filter(pk__in=[keyed, plain]).values_list("pk", "fair_key")) == {
        keyed: "tenant-7",
        plain: None,
    }
    assert Task.objects.filter(pk__in=[keyed, plain], status=TaskStatus.READY).count() == 2


def test_a_null_trace_context_stays_null() -> None:
    task_id = worn_task("q")
    Task.objects.filter(pk=task_id).update(trace_context=None)
    Task.objects.filter(pk=task_id).requeue()
    assert written(task_id)["trace_context"] is None
