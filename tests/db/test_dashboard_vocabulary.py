"""The dashboard speaks one vocabulary (tasks/lifecycle/vocabulary.py), offers only the actions that fit
the states it shows (derived from the transition table), and mentions the demo's generator only where
the demo app is installed (issue 41)."""

from __future__ import annotations

import datetime as dt
import re
from html.parser import HTMLParser
from types import SimpleNamespace
from typing import Any

import pytest
from django.test import Client

from tasks.lifecycle import vocabulary
from tasks.models import Failure, RateRefused, Started, Task, Worker
from tasks.workflows import chain, step
from tests.db.test_dashboard import make_tasks
from tests.helpers import wait_until
from tests.helpers.api import Api
from tests.helpers.task_paths import NOOP

pytestmark = pytest.mark.django_db

#: Names a page must not show for a state: the machine values (the labels are the human names) and
#: the old synonyms (Pending for Ready, Succeeded for Successful).
FORBIDDEN = re.compile(r"\b(?:" + "|".join([*vocabulary.STATUSES, "STUCK"]) + r")\b|\b(?i:pending|succeeded)\b")


class _Text(HTMLParser):
    """The text a person reads (no script, no style, no attribute) and every badge (data-state, text)."""

    def __init__(self) -> None:
        super().__init__()
        self.parts: list[str] = []
        self.badges: list[tuple[str, str]] = []
        self.actions: list[str] = []
        self._skip = 0
        self._badge: str | None = None
        self._form = ""

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if tag in ("script", "style", "title"):
            self._skip += 1
        if tag == "span" and "status" in (found.get("class") or "").split() and found.get("data-state"):
            self._badge = found["data-state"]
        if tag == "form":
            self._form = found.get("action") or ""
        if tag == "button" and found.get("name") == "action" and "/tasks/action/" in self._form:
            self.actions.append(found.get("value") or "")

    def handle_endtag(self, tag: str) -> None:
        if tag in ("script", "style", "title"):
            self._skip -= 1

    def handle_data(self, data: str) -> None:
        if self._badge is not None:
            self.badges.append((self._badge, data.strip()))
            self._badge = None
        if not self._skip:
            self.parts.append(data)


def read(staff: Client, url: str) -> _Text:
    response = staff.get(url)
    assert response.status_code == 200, url
    parsed = _Text()
    parsed.feed(response.content.decode())
    return parsed


def pages(ids: dict[str, int]) -> list[str]:
    workflow = Task.objects.get(pk=ids["awaiting"]).workflow_id
    return [
        "/dashboard/",
        "/dashboard/tasks/",
        *(f"/dashboard/tasks/{name}/" for name in ("pending", "retrying", "snoozed", "awaiting", "blocked")),
        *(f"/dashboard/tasks/{name}/" for name in ("running", "stuck", "succeeded", "failed", "cancelled")),
        *(f"/dashboard/tasks/{pk}/" for pk in ids.values()),
        "/dashboard/workflows/",
        f"/dashboard/workflows/{workflow}/",
        "/dashboard/workers/w1/",
        "/dashboard/tasks/bulk/",
        "/dashboard/queues/",
        "/dashboard/schedules/",
        "/dashboard/history/",
        "/dashboard/workers/",
    ]


def every_state() -> dict[str, int]:
    ids = make_tasks()
    Worker.objects.create(id="w1", hostname="h", pid=1, concurrency=2, running=2)
    return ids


def test_no_page_calls_a_state_by_another_name_than_its_label(staff: Client) -> None:
    ids = every_state()
    seen: set[str] = set()
    for url in pages(ids):
        page = read(staff, url)
        text = " ".join(page.parts)
        assert not FORBIDDEN.findall(text), (url, sorted(set(FORBIDDEN.findall(text))))
        for key, shown in page.badges:
            assert shown == vocabulary.label(key), (url, key, shown)
            seen.add(key)
    # Every state was on some page, each under its one label.
    assert set(vocabulary.STATES) <= seen


def test_each_task_is_shown_in_its_one_state() -> None:
    ids = make_tasks()
    shown = {name: vocabulary.state_of(Task.objects.get(pk=pk)).key for name, pk in ids.items()}
    assert shown == {
        "pending": "READY",
        "retrying": "retrying",
        "snoozed": "snoozed",
        "running": "RUNNING",
        "stuck": "stuck",
        "succeeded": "SUCCESSFUL",
        "failed": "FAILED",
        "cancelled": "CANCELLED",
        "blocked": "BLOCKED",
        "awaiting": "AWAITING",
    }


def test_a_snooze_after_a_failure_and_a_crash_after_a_snooze_are_each_in_one_list_and_one_count(
    staff: Client,
) -> None:
    """A task its handler snoozed after a failed attempt is shown Snoozed: the retrying list and count
    leave it out (they listed it under the Snoozed label, and counted it twice). A task whose next
    attempt after a snooze ended otherwise no longer waits for its wake time: recovery (a clean-clone
    run's browser walk found such a row, labelled Snoozed, on the retrying tab), a hand-back and a
    rate key's refusal clear the snooze, as a failure does."""
    from tasks.web.queries import state_counts

    def claim(pk: int, ttl: float = 30) -> Any:
        Task.objects.filter(pk=pk).update(run_after=dt.datetime.now(dt.timezone.utc) - dt.timedelta(hours=1))
        queue = Task.objects.get(pk=pk).queue  # one queue each: the claim takes this one
        (claimed,) = Task.objects.claim("w1", limit=1, queues=[queue], ttl=ttl, start=True)
        assert claimed.id == pk
        return claimed

    def snooze(claimed: Any) -> None:
        Task.objects.fail(
            Failure(claimed.id, claimed.token, "tasks.exceptions.Snooze", "", kind="snooze", delay=3600), "w1"
        )

    failed_then_snoozed = Task.objects.enqueue(NOOP, queue="failed_then_snoozed").id
    claimed = claim(failed_then_snoozed)
    Task.objects.fail(Failure(claimed.id, claimed.token, "builtins.ValueError", "oops", ""), "w1")
    snooze(claim(failed_then_snoozed))

    snoozed_then_lost = Task.objects.enqueue(NOOP, queue="snoozed_then_lost").id
    snooze(claim(snoozed_then_lost))
    claim(snoozed_then_lost, ttl=0.05)
    wait_until(lambda: Task.objects.stuck().exists(), what="expiry")
    assert [r.id for r in Task.objects.recover_expired()] == [snoozed_then_lost]

    # Woken, claimed again, and handed back (a worker's shutdown): due now, Ready.
    snoozed_then_handed_back = Task.objects.enqueue(NOOP, queue="snoozed_then_handed_back").id
    snooze(claim(snoozed_then_handed_back))
    claimed = claim(snoozed_then_handed_back)
    assert Task.objects.hand_back("w1", [(claimed.id, claimed.token)]) == {(claimed.id, claimed.token)}

    # Woken, claimed again, and refused a start by its rate key (one an hour): it waits in the key's
    # line (the holds' "rate"), Ready, not for a wake time.
    snoozed_then_refused = Task.objects.enqueue(
        NOOP, queue="snoozed_then_refused", rate_key="one-state", rate_limit=(1, 3600)
    ).id
    claimed = claim(snoozed_then_refused)
    assert isinstance(Task.objects.rate_start(claimed.id, "w1", claimed.token), Started)
    snooze(claimed)
    claimed = claim(snoozed_then_refused)
    assert isinstance(Task.objects.rate_start(claimed.id, "w1", claimed.token), RateRefused)

    states = {
        pk: vocabulary.state_of(Task.objects.get(pk=pk)).key
        for pk in (failed_then_snoozed, snoozed_then_lost, snoozed_then_handed_back, snoozed_then_refused)
    }
    assert states == {
        failed_then_snoozed: "snoozed",
        snoozed_then_lost: "retrying",
        snoozed_then_handed_back: "READY",
        snoozed_then_refused: "READY",
    }
    for tab, expected in (
        ("snoozed", [failed_then_snoozed]),
        ("retrying", [snoozed_then_lost]),
        ("pending", [snoozed_then_refused, snoozed_then_handed_back]),
    ):
        response = staff.get(f"/dashboard/tasks/{tab}/")
        assert [task.pk for task in response.context["tasks"]] == expected, tab
    counts = {name: count.value for name, count in state_counts().items()}
    assert (counts["pending"], counts["retrying"], counts["snoozed"]) == (2, 1, 1)


def test_labels_and_machine_values_name_the_same_status() -> None:
    for status in vocabulary.STATUSES.values():
        for text in (status.label, status.label.lower(), status.key):
            assert vocabulary.status_from_label(text) == status.key
    assert vocabulary.status_from_label("pending") is None
    assert vocabulary.status_from_label("stuck") is None  # a view, not a status a filter takes


def test_every_action_a_page_offers_fits_every_row_it_is_offered_for(staff: Client) -> None:
    ids = every_state()
    for url in pages(ids):
        page = read(staff, url)
        if not page.actions:
            continue
        statuses = {key if key in vocabulary.STATUSES else vocabulary.VIEWS[key].status for key, _ in page.badges}
        if url.rstrip("/").split("/")[-1].isdigit():  # a task's page: its own badge only
            statuses = {Task.objects.get(pk=int(url.rstrip("/").split("/")[-1])).status}
        for action in page.actions:
            assert statuses <= set(vocabulary.ACTIONS[action].statuses), (url, action, statuses)
    # The cases: nothing to retry or cancel on a successful task; no cancel on the failed list.
    assert read(staff, f"/dashboard/tasks/{ids['succeeded']}/").actions == ["run_again"]
    assert read(staff, "/dashboard/tasks/failed/").actions == ["retry"]
    assert read(staff, "/dashboard/tasks/running/").actions == ["cancel"]


def test_actions_derive_from_the_transition_table() -> None:
    from tasks.lifecycle.transitions import TRANSITIONS

    sources = {t.event: set(t.sources) for t in TRANSITIONS}
    assert set(vocabulary.ACTIONS["cancel"].statuses) == sources["cancel"]
    retry, again = vocabulary.ACTIONS["retry"].statuses, vocabulary.ACTIONS["run_again"].statuses
    assert set(retry) | set(again) == sources["requeue"] and not set(retry) & set(again)


@pytest.mark.parametrize(
    ("state", "action"), [("succeeded", "retry"), ("succeeded", "cancel"), ("failed", "cancel"), ("running", "retry")]
)
def test_posting_an_action_that_does_not_fit_is_refused_and_changes_nothing(
    staff: Client, state: str, action: str
) -> None:
    ids = make_tasks()
    before = list(Task.objects.order_by("pk").values())
    response = staff.post("/dashboard/tasks/action/", {"action": action, "ids": [ids[state], ids["pending"]]})
    assert response.status_code == 409
    assert "Nothing changed" in response.content.decode()
    assert list(Task.objects.order_by("pk").values()) == before


def test_a_project_without_the_demo_app_never_mentions_the_generator(staff: Client, settings: object) -> None:
    ids = every_state()
    assert "Generator" in staff.get("/dashboard/").content.decode()  # the demo project installs it
    settings.INSTALLED_APPS = [app for app in settings.INSTALLED_APPS if app != "tasks.demo"]  # type: ignore[attr-defined]
    for url in pages(ids):
        assert "generator" not in staff.get(url).content.decode().lower(), url
    assert staff.get("/dashboard/generator/").status_code == 404


def test_the_reference_docs_give_every_label_its_meaning() -> None:
    from pathlib import Path

    text = (Path(__file__).parents[2] / "docs" / "reference" / "dashboard.md").read_text()
    for state in vocabulary.STATES.values():
        key = f"`{state.key}`" if not state.is_view else f"`{state.status}`"
        assert f"| {state.label} | {key} | {state.meaning[0].lower()}{state.meaning[1:]} |" in text, state
    for action in vocabulary.ACTIONS.values():
        assert f"| {action.label} | {', '.join(vocabulary.label(s) for s in action.statuses)} |" in text, action


class _ClockAMinuteAhead(dt.datetime):
    @classmethod
    def now(cls, tz: dt.tzinfo | None = None) -> dt.datetime:  # type: ignore[override]
        return dt.datetime.now(tz) + dt.timedelta(minutes=1)


@pytest.mark.usefixtures("api_token")
def test_a_row_is_shown_in_the_state_the_database_read_it_in(
    staff: Client, api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A page's row is judged at the read that listed it, on the database's clock, not at the moment
    the template renders it by the web process's clock (the demo's walk in a browser saw a Stuck row on
    the Running page: a crashed worker's lease ran out between the two). A web process whose clock runs
    a minute ahead of the database's stands for that gap: the 30 s lease is live to the database."""
    pk = Task.objects.enqueue("tests.testapp.handlers.noop", queue="q").id
    (claimed,) = Task.objects.claim("w1", limit=1, queues=["q"], ttl=30)
    assert claimed.id == pk
    monkeypatch.setattr("tasks.models.task.dt", SimpleNamespace(datetime=_ClockAMinuteAhead, timezone=dt.timezone))
    assert read(staff, "/dashboard/tasks/running/").badges == [("RUNNING", "Running")]
    assert read(staff, "/dashboard/tasks/stuck/").badges == []
    # A task's own page, and its worker's page, judge it by the database's clock too.
    assert ("RUNNING", "Running") in read(staff, f"/dashboard/tasks/{pk}/").badges
    Worker.objects.create(id="w1", hostname="h", pid=1, concurrency=1, running=1)
    assert read(staff, "/dashboard/workers/w1/").badges == [("RUNNING", "Running")]
    status, listed = api.call("GET", "/api/tasks?status=RUNNING")
    assert status == 200 and [(task["id"], task["stuck"]) for task in listed["tasks"]] == [(pk, False)]


def rows(staff: Client, url: str) -> dict[int, str]:
    """The text of each task row of a list page (``<tr data-task="id">``), by task id."""
    response = staff.get(url)
    assert response.status_code == 200, url
    found = {}
    for pk, html in re.findall(r'<tr data-task="(\d+)">(.*?)</tr>', response.content.decode(), re.S):
        parsed = _Text()
        parsed.feed(html)
        found[int(pk)] = " ".join(" ".join(parsed.parts).split())
    return found


def cancelled_by_a_failed_dependency() -> tuple[int, int]:
    """A chain whose first step failed for good, its second cancelled for it; and a task an operator
    cancelled. Their ids (dependant, operator's)."""
    first, second = chain(step(NOOP), step(NOOP)).enqueue().task_ids
    (claimed,) = Task.objects.claim("w1", limit=1)
    assert claimed.id == first
    Task.objects.fail(Failure(claimed.id, claimed.token, "builtins.KeyError", "dead", "", retry=False), "w1")
    by_operator = Task.objects.enqueue(NOOP).id
    Task.objects.filter(pk=by_operator).cancel()
    assert Task.objects.filter(pk__in=[second, by_operator], status="CANCELLED").count() == 2
    return second, by_operator


def test_the_cancelled_tab_says_who_cancels_and_a_row_cancelled_for_a_failed_dependency_says_so(
    staff: Client,
) -> None:
    dependant, by_operator = cancelled_by_a_failed_dependency()
    heading = " ".join(" ".join(read(staff, "/dashboard/tasks/cancelled/").parts).split())
    assert "cancelled by an operator, its handler or a failed dependency" in heading
    for url in ("/dashboard/tasks/cancelled/", "/dashboard/tasks/?status=Cancelled"):
        shown = rows(staff, url)
        assert "Cancelled by a failed dependency" in shown[dependant], url
        assert "dependency" not in shown[by_operator], url
    workflow = Task.objects.get(pk=dependant).workflow_id
    assert "Cancelled by a failed dependency" in rows(staff, f"/dashboard/workflows/{workflow}/")[dependant]


def test_a_task_cancelled_before_it_ran_says_so_not_that_it_waits_for_an_attempt(staff: Client) -> None:
    def text(pk: int) -> str:
        return " ".join(" ".join(read(staff, f"/dashboard/tasks/{pk}/").parts).split())

    dependant, by_operator = cancelled_by_a_failed_dependency()
    claimed_never_started = Task.objects.enqueue(NOOP, queue="claimed").id
    assert Task.objects.claim("w2", limit=1, queues=["claimed"])[0].id == claimed_never_started
    Task.objects.filter(pk=claimed_never_started).cancel()
    for pk in (by_operator, claimed_never_started):
        assert "Cancelled before it ran: never attempted." in text(pk), pk
    assert "Cancelled by a failed dependency before it ran: never attempted." in text(dependant)
    for pk in (dependant, by_operator, claimed_never_started):
        assert "Not attempted yet" not in text(pk), pk
    assert "Not attempted yet." in text(Task.objects.enqueue(NOOP).id)  # still waiting: it may run yet
