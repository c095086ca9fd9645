"""A task's page lists every attempt once, in order, with its outcome and error; the failed list shows
each task's newest error; times are in one format with the zone stated.

Issue 41 saw a failed task's attempt table drop its first TypeError and two sections titled
"Attempt 1:". The page keyed the errors by their ``attempt`` number, which repeats: a rerun ("Retry")
sets ``attempts`` back to 0, and a claim recovered before its attempt started is recorded with the
number of the attempt before it (tasks/web/attempts.py).
"""

from __future__ import annotations

import datetime as dt
import re

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from tasks.models import Failure, Task
from tasks.web import attempts

pytestmark = pytest.mark.django_db

PATH = "tests.testapp.handlers.noop"


def claim(task_id: int, worker: str = "w1", *, start: bool = True) -> int:
    """Claim ``task_id`` (the only runnable task of its queue); with ``start``, mark its attempt started."""
    Task.objects.filter(pk=task_id).update(run_after=timezone.now() - dt.timedelta(hours=1))
    claimed = Task.objects.claim(worker, limit=1, queues=["attempts"], ttl=30)
    assert [c.id for c in claimed] == [task_id]
    if start:
        assert Task.objects.start(task_id, worker, claimed[0].token) is not None
    return claimed[0].token


def fail(task_id: int, exception: str, message: str, worker: str = "w1", *, retry: bool = True) -> None:
    token = claim(task_id, worker)
    traceback = f"Traceback (most recent call last):\n  {exception}: {message}"
    assert Task.objects.fail(Failure(task_id, token, exception, message, traceback, retry=retry), worker)


def expire_unstarted(task_id: int, worker: str = "w2") -> None:
    """A claim whose lease expires before its attempt starts: recovery returns it uncharged."""
    claim(task_id, worker, start=False)
    Task.objects.filter(pk=task_id).update(expires_at=timezone.now() - dt.timedelta(seconds=5))
    assert [r.id for r in Task.objects.recover_expired()] == [task_id]


def rows(page: str) -> list[tuple[str, str, str]]:
    """(number, outcome, error cell) of each row of the attempts table."""
    table = page.split('<table id="attempts">', 1)[1].split("</table>", 1)[0]
    return [
        (number, outcome.strip(), error)
        for number, outcome, error in re.findall(
            r'<tr data-attempt="(\d+)"><td>\d+</td><td class="outcome">(.*?)</td>.*?<td class="wrap">(.*?)</td></tr>',
            table,
            flags=re.S,
        )
    ]


def test_an_unstarted_return_between_failures_keeps_every_attempt(staff: Client) -> None:
    task_id = Task.objects.enqueue(PATH, queue="attempts", max_attempts=3).id
    fail(task_id, "builtins.TypeError", "first type error")
    expire_unstarted(task_id)  # recorded as attempt 1 again: the attempt before it
    fail(task_id, "builtins.TypeError", "second type error")
    fail(task_id, "builtins.ValueError", "the last one")
    assert Task.objects.get(pk=task_id).status == "FAILED"

    page = staff.get(f"/dashboard/tasks/{task_id}/").content.decode()
    table = rows(page)
    assert [(number, outcome) for number, outcome, _ in table] == [
        ("1", "Failed"),
        ("2", "Failed"),
        ("3", "Failed"),
    ]
    assert "first type error" in table[0][2] and "builtins.TypeError" in table[0][2]
    assert "second type error" in table[1][2]
    assert "the last one" in table[2][2]
    assert page.count("Attempt 1") == 0
    # The uncharged return is an event, not an attempt.
    events = page.split('<table id="events">', 1)[1].split("</table>", 1)[0]
    assert "returned" in events and "w2" in events
    # The traceback is there, collapsed.
    assert "<details><summary>Traceback</summary><pre>Traceback (most recent call last):" in page
    # The admin lists the same attempts, each once.
    admin = staff.get(f"/admin/tasks/task/{task_id}/change/").content.decode()
    assert re.findall(r"attempt (\d+) · (\w+)", admin) == [("1", "Failed"), ("2", "Failed"), ("3", "Failed")]
    assert "first type error" in admin and "<strong>returned</strong>" in admin


def test_a_rerun_numbers_its_attempts_after_the_first_runs(staff: Client) -> None:
    task_id = Task.objects.enqueue(PATH, queue="attempts", max_attempts=1).id
    fail(task_id, "builtins.TypeError", "before the retry")
    assert Task.objects.filter(pk=task_id).requeue() == 1
    fail(task_id, "builtins.KeyError", "after the retry", worker="w3")
    task = Task.objects.get(pk=task_id)
    assert [e["attempt"] for e in task.errors] == [1, 1]  # what the page must not key by

    table = rows(staff.get(f"/dashboard/tasks/{task_id}/").content.decode())
    assert [(n, o) for n, o, _ in table] == [("1", "Failed"), ("2", "Failed")]
    assert "before the retry" in table[0][2] and "after the retry" in table[1][2]


def test_a_success_before_run_again_and_the_running_attempt() -> None:
    task_id = Task.objects.enqueue(PATH, queue="attempts").id
    token = claim(task_id)
    assert Task.objects.complete(task_id, "w1", token, {"sent": 7})
    assert Task.objects.filter(pk=task_id).requeue() == 1
    fail(task_id, "builtins.OSError", "flaky", worker="w1")
    claim(task_id, worker="w1")
    history = attempts.history(Task.objects.get(pk=task_id))
    assert [(a.number, a.outcome, a.worker) for a in history.attempts] == [
        (1, "Successful", "w1"),
        (2, "Failed", "w1"),
        (3, "Running", "w1"),
    ]
    assert history.events == []
    failed = history.attempts[1]
    assert failed.started_at is not None and failed.ended_at is not None and failed.duration is not None
    assert failed.duration >= 0


def test_dropped_entries_keep_the_first_and_say_which_attempts_are_unknown(staff: Client) -> None:
    task_id = Task.objects.enqueue(PATH, queue="attempts", max_attempts=14).id
    for number in range(1, 13):
        fail(task_id, "builtins.RuntimeError", f"failure {number}")
    task = Task.objects.get(pk=task_id)
    assert task.errors_dropped == 2
    history = attempts.history(task)
    outcomes = [(a.number, a.outcome, (a.error or {}).get("message")) for a in history.attempts]
    assert outcomes[0] == (1, "Failed", "failure 1")
    assert [o[1] for o in outcomes[1:3]] == ["Not known (its error entry was dropped)"] * 2
    assert outcomes[3:] == [(n, "Failed", f"failure {n}") for n in range(4, 13)]
    page = staff.get(f"/dashboard/tasks/{task_id}/").content.decode()
    assert 'id="errors-dropped"' in page


def test_the_failed_list_shows_the_last_error_and_no_lease_columns(staff: Client) -> None:
    task_id = Task.objects.enqueue(PATH, queue="attempts", max_attempts=1).id
    long_message = "x" * 300
    fail(task_id, "myapp.errors.PaymentDeclined", long_message, retry=False)
    for url in ("/dashboard/tasks/failed/", "/dashboard/tasks/?status=Failed"):
        page = staff.get(url).content.decode()
        table = page.split('<table id="tasks">', 1)[1].split("</table>", 1)[0]
        assert "<th>Last error</th>" in table
        assert "Lease expires" not in table and "Last heartbeat" not in table and "Progress" not in table
        assert "myapp.errors.PaymentDeclined" in table
        assert "x" * 119 + "…" in table  # cut in the list, whole in its title and on the task's page
        assert "x" * 121 + "<" not in table.split("title=")[0]


def test_the_error_column_costs_no_query_per_row(staff: Client) -> None:
    def queries_of(url: str) -> int:
        with CaptureQueriesContext(connection) as captured:
            assert staff.get(url).status_code == 200
        return len(captured)

    task_id = Task.objects.enqueue(PATH, queue="attempts", max_attempts=1).id
    fail(task_id, "builtins.TypeError", "one", retry=False)
    urls = ("/dashboard/tasks/failed/", "/dashboard/tasks/?status=Failed")
    one = [queries_of(url) for url in urls]
    for number in range(20):
        task_id = Task.objects.enqueue(PATH, queue="attempts", max_attempts=1).id
        fail(task_id, "builtins.TypeError", f"more {number}", retry=False)
    assert [queries_of(url) for url in urls] == one


def test_times_are_in_one_format_with_the_zone(staff: Client) -> None:
    task_id = Task.objects.enqueue(PATH, queue="attempts", max_attempts=1).id
    fail(task_id, "builtins.TypeError", "boom", retry=False)
    page = staff.get(f"/dashboard/tasks/{task_id}/").content.decode()
    assert re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", page)
    # No raw ISO 8601 (an error entry's "at" as stored) and no bare clock time.
    assert not re.search(r"\d{4}-\d\d-\d\dT\d\d:\d\d", page)
    assert not re.search(r"<dd>\d\d:\d\d:\d\d", page)
    # Relative times carry the absolute one in their title.
    listing = staff.get("/dashboard/tasks/failed/").content.decode()
    assert re.search(r'<span title="\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC">[^<]* ago</span>', listing)


def test_arguments_results_and_progress_are_json(staff: Client) -> None:
    task_id = Task.objects.enqueue(PATH, queue="attempts", kwargs={"to": "a@b.c", "flag": True}, args=[None]).id
    token = claim(task_id)
    assert Task.objects.complete(task_id, "w1", token, {"sent": 7})
    page = staff.get(f"/dashboard/tasks/{task_id}/").content.decode()
    assert "&quot;sent&quot;: 7" in page and "{&#x27;sent&#x27;: 7}" not in page
    assert "&quot;flag&quot;: true" in page and "True" not in page.split('id="task-kwargs"')[1][:200]
    assert "null" in page.split('id="task-args"')[1][:100]
    # each box says which arguments it holds (two unlabelled boxes read as one list: issue 56)
    assert re.search(r"<dt>Positional arguments</dt><dd><pre [^>]*id=\"task-args\"", page)
    assert re.search(r"<dt>Keyword arguments</dt><dd><pre [^>]*id=\"task-kwargs\"", page)
