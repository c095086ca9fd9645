"""``@task(...)`` options (tasks/backends/options.py): Django 6.1 and the backport hand the decorator's
keywords to ``LeaseBackend.task_class``; each option reaches the row the enqueue writes and the worker
that runs it, in the documented order (call > decorator > backend OPTIONS > settings), and a wrong one
is refused when the task is defined."""

from __future__ import annotations

import pickle
import re
import sys
import types
from typing import Any

import pytest

from tasks.backends import task as typed_task
from tasks.backends.options import LeaseTask
from tasks.compat import FRAMEWORK, InvalidTask, task, task_backends
from tasks.models import Task, TaskStatus
from tasks.testing import run_until_empty
from tests.helpers import ROOT
from tests.testapp import option_tasks

pytestmark = pytest.mark.django_db(transaction=True)


def row(result: Any) -> Task:
    return Task.objects.get(pk=int(result.id))


def test_the_decorator_makes_a_lease_task_whose_options_reach_the_row() -> None:
    assert isinstance(option_tasks.send_invoice, LeaseTask)
    result = option_tasks.send_invoice.enqueue(customer_id=42, invoice_id=7)
    stored = row(result)
    assert stored.max_attempts == 3
    assert stored.retry_policy == {
        "max_attempts": 3,
        "retry_on": ["tests.testapp.option_tasks.Flaky"],
        "backoff": "tests.testapp.option_tasks.later",
    }
    assert stored.timeout == 5
    assert (stored.rate_key, stored.rate_limit, stored.rate_period) == ("smtp:42", 10, 1.0)
    assert (stored.concurrency_key, stored.concurrency_limit) == ("invoice:42", 2)


def test_a_window_given_to_the_decorator_folds_duplicates() -> None:
    first = option_tasks.build_report.enqueue("sales")
    again = option_tasks.build_report.enqueue("sales")
    other = option_tasks.build_report.enqueue("costs")
    assert first.id == again.id != other.id
    assert Task.objects.filter(dedup_key="report:sales").count() == 1
    option_tasks.reindex.enqueue("a")
    option_tasks.reindex.enqueue("a")
    (waiting,) = Task.objects.filter(task_path=option_tasks.reindex.module_path)
    assert waiting.debounce_key == "search:a"


def test_the_worker_retries_only_what_retry_on_names_and_waits_the_tasks_backoff() -> None:
    flaky = option_tasks.send_invoice.enqueue(customer_id=1, invoice_id=1, raises="flaky")
    fatal = option_tasks.send_invoice.enqueue(customer_id=1, invoice_id=2, raises="fatal")
    run_until_empty()
    retried, failed = row(flaky), row(fatal)
    # Waiting for its retry: BLOCKED, as a keyed task waits (its concurrency key), READY to django.tasks.
    assert (retried.status, retried.failures) == (TaskStatus.BLOCKED, 1)
    assert (failed.status, failed.failures) == (TaskStatus.FAILED, 1)
    assert retried.last_attempted_at is not None
    waited = (retried.run_after - retried.last_attempted_at).total_seconds()
    assert 590 < waited < 610, waited  # the task's own backoff (600 s), not the default


def test_max_attempts_ends_the_task_after_that_many_failures() -> None:
    result = option_tasks.send_invoice.enqueue(customer_id=1, invoice_id=3, raises="flaky")
    run_until_empty(with_scheduled=True)
    stored = row(result)
    assert (stored.status, stored.failures, stored.attempts) == (TaskStatus.FAILED, 3, 3)


def test_the_call_wins_over_the_decorator_which_wins_over_the_backend(settings: Any) -> None:
    settings.TASKS = {
        "default": {
            "BACKEND": "tasks.backends.LeaseBackend",
            "OPTIONS": {
                "max_attempts": 9,
                "timeout": 50,
                "retry": {option_tasks.plain.module_path: {"max_attempts": 4}},
                "concurrency": {option_tasks.send_invoice.module_path: {"key": "backend", "limit": 1}},
            },
        }
    }
    assert row(option_tasks.plain.enqueue(1)).max_attempts == 7  # the decorator over OPTIONS["retry"]
    assert row(option_tasks.plain.using(max_attempts=2).enqueue(1)).max_attempts == 2  # the call over both
    assert row(option_tasks.plain.enqueue(1)).timeout == 50  # what the decorator leaves: the backend's
    keyed = row(option_tasks.send_invoice.enqueue(customer_id=5, invoice_id=1))
    assert (keyed.concurrency_key, keyed.timeout) == ("invoice:5", 5)
    assert option_tasks.send_invoice.using(priority=3).max_attempts == 3  # Django's own using() still works


def test_a_lease_task_pickles_as_the_frameworks_task_does() -> None:
    """Django 6.x pickles a Task by its module-level name, options included; the backport refuses to
    pickle any Task (its conformance tests expect PicklingError): a LeaseTask does the same on each."""
    if FRAMEWORK == "django.tasks":
        copy = pickle.loads(pickle.dumps(option_tasks.send_invoice))
        assert copy == option_tasks.send_invoice and copy.retry_on == (option_tasks.Flaky,)
    else:
        with pytest.raises(pickle.PicklingError):
            pickle.dumps(option_tasks.send_invoice)


@pytest.mark.parametrize(
    ("options", "reason"),
    [
        ({"max_attempts": 0}, "max_attempts: retry policy 'max_attempts' must be a whole number of at least 1"),
        ({"retry_on": ["nowhere.Missing"]}, "'nowhere.Missing' is not an exception class"),
        ({"retry_on": "ValueError"}, "retry_on must be a list"),
        ({"backoff": lambda attempt, exc: 1.0}, "backoff: "),
        ({"timeout": 0}, "timeout must be a number of seconds above 0"),
        ({"concurrency_key": "k"}, "concurrency_key and concurrency_limit go together"),
        ({"concurrency_key": "k", "concurrency_limit": 0}, "concurrency_limit must be a whole number"),
        ({"rate_key": "k", "rate_limit": "fast"}, "rate_limit: rate limit 'fast' is not of the form"),
        ({"unique_for": 10}, "need dedup_key"),
        ({"dedup_key": "k", "unique_for": 5, "debounce": 3}, "exclude each other"),
        ({"dedup_key": "k"}, "give unique_for or debounce"),
        ({"fair_key": "{0.__class__}"}, "reads an attribute"),
    ],
)
def test_a_wrong_option_is_refused_where_the_task_is_defined(options: dict[str, Any], reason: str) -> None:
    with pytest.raises(InvalidTask) as refused:
        task(**options)(option_tasks.plain.func)
    assert "@task options of tests.testapp.option_tasks.plain" in str(refused.value)
    assert reason in str(refused.value), str(refused.value)


def test_using_and_the_typed_decorator_refuse_what_no_task_has() -> None:
    with pytest.raises(TypeError, match="retries"):
        option_tasks.plain.using(retries=3)
    with pytest.raises(TypeError, match="retries"):
        typed_task(retries=3)  # type: ignore[call-overload]


def test_the_backends_task_class_is_the_lease_task() -> None:
    assert task_backends["default"].task_class is LeaseTask


PAGE = ROOT / "docs" / "howto" / "django-tasks.md"


def test_the_pages_block_runs_as_written_and_its_options_reach_the_rows() -> None:
    (block,) = re.findall(
        r"<!-- tested: tests/db/test_task_options.py -->\n```python\n(.*?)```", PAGE.read_text(), re.S
    )
    module = types.ModuleType("django_tasks_doc_example")
    sys.modules[module.__name__] = module
    try:
        exec(compile(block, str(PAGE), "exec"), module.__dict__)
        first, urgent = row(module.result), row(module.urgent)
        assert (first.max_attempts, first.timeout, first.rate_key, first.concurrency_key) == (
            3,
            5,
            "smtp",
            "invoice:42",
        )
        assert (first.retry_policy or {}).get("retry_on") == ["django_tasks_doc_example.GatewayTimeout"]
        assert (urgent.max_attempts, urgent.priority) == (5, 10)
        assert module.build_report.enqueue("x").id == module.build_report.enqueue("x").id
    finally:
        del sys.modules[module.__name__]
