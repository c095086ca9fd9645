"""A browser walks every page of the running demo (issue 41, "Done when"), and takes the screenshots
that docs/ shows.

``manage.py demo`` runs as a user starts it (tests/helpers/demo.py), on the test database. Once every
feature has left its mark in the rows (the polls of tests/concurrency/test_demo_features.py), Debian's
Chromium signs in and opens each page, and the test reads what it renders:

- each state and view of the vocabulary (tasks/lifecycle/vocabulary.py) has a task: its tab counts
  more than 0 and lists a row in it (a state a task passes through, such as Stuck, is waited for on
  its tab, which refreshes in place);
- no page names a state another way: no machine value (``READY``) in the visible text, no old name
  (Pending, Succeeded), each badge a label of the vocabulary and each tab's row in that tab's state;
- every action button a page shows fits every row it applies to (``vocabulary.ACTIONS``, from the
  transition table);
- the Failed list shows each row's error class and message.

Each page is saved as a full-page PNG in the test's temporary directory and, when
``LEASING_SCREENSHOTS_DIR`` is set, in that directory: docs/CONTRIBUTING.md ("Generated files") says
how docs/screenshots/ and docs/dashboard.png are made from one run. Not serial: nothing is timed, a
state is waited for (``DEMO_WALK_SECONDS`` each) and a loaded machine only takes longer.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth import get_user_model

from tasks.demo import showcase
from tasks.lifecycle import vocabulary
from tasks.models import Task, Workflow
from tasks.web.queries import STATES as TABS
from tests.helpers import wait_until
from tests.helpers.demo import Seen, running_demo

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.e2e, pytest.mark.slow]

SECONDS = float(os.environ.get("DEMO_WALK_SECONDS", "240"))


VIEWPORT = {"width": 1400, "height": 900}
#: A screenshot is the whole page down to this height: a long list shows its first rows, and the
#: images in docs/ stay small (about 3 MB for all of them).
MAX_HEIGHT = 1600

#: A state's machine value where a label belongs, or a name the vocabulary retired.
RAW_STATUS = re.compile(r"\b(?:" + "|".join(vocabulary.STATUSES) + r")\b")
OLD_NAMES = re.compile(r"\b(?:Pending|Succeeded)\b")
LABELS = {state.label: state for state in vocabulary.STATES.values()}

#: What a page shows, read in one go (the page refreshes in place every 2 s: reading row by row
#: could mix two versions). Text inside .mono, pre and code is data (task paths, worker ids, JSON,
#: tracebacks), not the page's words: it is left out of ``words``.
SNAPSHOT = """() => {
  const main = document.querySelector("main");
  // The text as written, not as styled: a card's label is shown in capitals (text-transform), and
  // innerText would return READY where the page says Ready.
  const read = (strip) => {
    const copy = main.cloneNode(true);
    if (strip) copy.querySelectorAll(".mono, pre, code, [title]:not(.status)").forEach((el) => el.remove());
    copy.querySelectorAll("*").forEach((el) => { el.style.textTransform = "none"; });
    copy.style.position = "absolute"; copy.style.left = "-99999px"; copy.style.textTransform = "none";
    document.body.appendChild(copy);
    const text = copy.innerText;
    copy.remove();
    return text;
  };
  const text = (el) => (el ? el.innerText.trim() : null);
  return {
    words: read(true),
    text: read(false),
    rows: Array.from(main.querySelectorAll("tr[data-task]")).map((tr) => ({
      id: tr.dataset.task,
      state: text(tr.querySelector(".status")),
      error: text(tr.querySelector(".error-summary")),
    })),
    badges: Array.from(main.querySelectorAll(".status[data-state]")).map((el) => el.innerText.trim()),
    // The task actions' buttons (tasks:task-action); a queue's Pause is no task action.
    buttons: Array.from(main.querySelectorAll("button[name=action]"))
      .filter((b) => b.form && (b.form.getAttribute("action") || "").split("?")[0].endsWith("/tasks/action/"))
      .map((b) => b.value),
    heading: text(main.querySelector("h1 .status")),
    tabs: Array.from(main.querySelectorAll("nav.tabs a[data-state]")).map((a) => ({
      slug: a.dataset.state,
      label: a.firstChild.textContent.trim(),
      count: text(a.querySelector(".count")),
    })),
  };
}"""


def tab_label(slug: str) -> str:
    """The label the tab ``slug`` (``/dashboard/tasks/<slug>/``) must show: its view's, else its status's."""
    key = slug if slug in vocabulary.VIEWS else TABS[slug].status
    return vocabulary.STATES[key].label


def number(text: str | None) -> int:
    return int(re.sub(r"\D", "", text or "") or 0)


class Walk:
    def __init__(self, page: Any, base: str, shots: list[Path]) -> None:
        self.page, self.base, self.shots = page, base, shots
        self.counted: dict[str, int] = {}  # a tab's label -> the largest count any page showed
        self.opened: list[str] = []

    def open(self, name: str, url: str, ready: str | None = None) -> dict[str, Any]:
        response = self.page.goto(self.base + url)
        assert response is not None and response.status == 200, (url, response and response.status)
        assert self.page.url.startswith(self.base + url.split("?")[0]), self.page.url  # not the log-in page
        if ready:
            self.page.wait_for_function(ready, timeout=SECONDS * 1000)
        shown: dict[str, Any] = self.page.evaluate(SNAPSHOT)
        self.opened.append(name)
        height = min(self.page.evaluate("document.scrollingElement.scrollHeight"), MAX_HEIGHT)
        for directory in self.shots:
            self.page.screenshot(
                path=str(directory / f"{name}.png"),
                full_page=True,
                clip={"x": 0, "y": 0, "width": VIEWPORT["width"], "height": height},
            )
        self.check_vocabulary(url, shown)
        self.check_actions(url, shown)
        return shown

    def check_vocabulary(self, url: str, shown: dict[str, Any]) -> None:
        assert not RAW_STATUS.findall(shown["words"]), (url, RAW_STATUS.findall(shown["words"]))
        assert not OLD_NAMES.findall(shown["text"]), (url, OLD_NAMES.findall(shown["text"]))
        unknown = {badge for badge in shown["badges"] if badge not in LABELS}
        assert not unknown, f"{url}: badges that are no label of the vocabulary: {unknown}"
        for tab in shown["tabs"]:
            assert tab["label"] == tab_label(tab["slug"]), (url, tab)
            self.counted[tab["label"]] = max(self.counted.get(tab["label"], 0), number(tab["count"]))

    def check_actions(self, url: str, shown: dict[str, Any]) -> None:
        statuses = {LABELS[row["state"]].status for row in shown["rows"] if row["state"]}
        if shown["heading"]:  # a task's page: its buttons act on it
            statuses = {LABELS[shown["heading"]].status}
        if not shown["buttons"]:
            return
        assert statuses, f"{url}: action buttons with nothing to act on: {shown['buttons']}"
        for name in shown["buttons"]:
            misfits = statuses - set(vocabulary.ACTIONS[name].statuses)
            assert not misfits, f"{url}: {vocabulary.ACTIONS[name].label} shown for rows in {misfits}"

    def state_tab(self, slug: str) -> dict[str, Any]:
        """A state's tab, once it lists a task (the list refreshes in place: a passing state shows up)."""
        ready = (
            f"document.querySelectorAll('main tr[data-task]').length > 0"
            f" && document.querySelector('nav.tabs a[data-state={slug}] .count').innerText.trim() !== '0'"
        )
        shown = self.open(f"tasks-{slug}", f"/dashboard/tasks/{slug}/", ready=ready)
        label = tab_label(slug)
        assert shown["rows"], slug
        assert {row["state"] for row in shown["rows"]} == {label}, (slug, shown["rows"])
        return shown


def screenshot_directories(tmp_path: Path) -> list[Path]:
    directories = [tmp_path / "screenshots"]
    if os.environ.get("LEASING_SCREENSHOTS_DIR"):
        directories.append(Path(os.environ["LEASING_SCREENSHOTS_DIR"]).resolve())
    for directory in directories:
        directory.mkdir(parents=True, exist_ok=True)
    return directories


def test_a_browser_walks_every_page_of_the_running_demo(browser_page: Any, tmp_path: Path) -> None:
    shots = screenshot_directories(tmp_path)
    get_user_model().objects.create_user("walker", password="correct horse", is_staff=True, is_superuser=True)
    seen = Seen()
    with running_demo(tmp_path) as demo:
        try:
            wait_until(seen.poll, SECONDS, interval=1.0, what="every feature of the demo")
        except AssertionError:
            raise AssertionError(f"not seen in {SECONDS:.0f}s: {seen.missing()}\n{demo.log_tail()}") from None

        page = browser_page
        page.set_viewport_size(VIEWPORT)
        page.goto(demo.url + "/dashboard/")
        page.fill("#id_username", "walker")
        page.fill("#id_password", "correct horse")
        page.click("input[type=submit]")
        page.wait_for_url(demo.url + "/dashboard/")
        walk = Walk(page, demo.url, shots)

        walk.open("tasks", "/dashboard/tasks/")
        for slug in TABS:
            shown = walk.state_tab(slug)
            if slug == "failed":
                missing = [row["id"] for row in shown["rows"] if not re.match(r"[\w.]+: \S", row["error"] or "")]
                assert not missing, f"failed tasks listed without their error's class and message: {missing}"
        empty = [label for label in vocabulary.STATES.values() if not walk.counted.get(label.label)]
        assert not empty, f"states no page counted a task in: {empty}"

        failed = Task.objects.filter(
            status="FAILED", task_path=f"{showcase.HANDLERS}.charge_card", failures__gte=2
        ).first()
        assert failed is not None
        shown = walk.open("task-failed", f"/dashboard/tasks/{failed.pk}/")
        outcomes = page.locator("#attempts tr[data-attempt]")
        assert outcomes.count() >= 2, shown["text"]
        assert [outcomes.nth(n).get_attribute("data-attempt") for n in range(outcomes.count())] == [
            str(n + 1) for n in range(outcomes.count())
        ]

        walk.open("workflows", "/dashboard/workflows/")
        workflow = Workflow.objects.filter(kind="group", status="SUCCESSFUL").exclude(callback_id=None).first()
        assert workflow is not None
        walk.open("workflow", f"/dashboard/workflows/{workflow.pk}/")
        walk.open("queues", "/dashboard/queues/")
        walk.open("schedules", "/dashboard/schedules/")
        walk.open("schedule", "/dashboard/schedules/demo-digest/")
        walk.open("workers", "/dashboard/workers/")
        walk.open("history", "/dashboard/history/")
        walk.open("bulk", "/dashboard/tasks/bulk/")
        walk.open("leases", "/leases/")
        for state in ("active", "expired", "released"):
            walk.open(f"leases-{state}", f"/leases/{state}/")
        walk.open("generator", "/dashboard/generator/")
        # Last, a minute or more into the demo: the README's picture (docs/dashboard.png).
        walk.open("overview", "/dashboard/")
        assert demo.proc.poll() is None, "the demo exited during the walk"

    taken = sorted(path.name for path in shots[0].iterdir())
    assert taken == sorted(f"{name}.png" for name in walk.opened), taken
