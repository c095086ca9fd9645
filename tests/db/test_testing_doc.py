"""docs/howto/testing.md: the blocks marked "tested" are run as written. They are executed into this
module, so their tests are this module's tests (pytest collects them, with the plugin's fixtures), and
their task has an importable path (``tests.db.test_testing_doc.send_welcome``). ``create_account``
and ``mailer``, which the page leaves to the reader, are given here. The last tests show that the
page's tests fail when the code under test does not enqueue, and that its sample error is the real one."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest

from tasks.compat import FRAMEWORK
from tasks.models import Task
from tasks.testing import EnqueueCapture
from tests.helpers import ROOT
from tests.testapp.models import Once

PAGE = ROOT / "docs" / "howto" / "testing.md"


def marked_blocks() -> list[str]:
    return re.findall(r"<!-- tested[^>]*-->\n```python\n(.*?)```", PAGE.read_text(), re.S)


def create_account(email: str) -> Once:
    return Once.objects.get_or_create(key=f"account:{email}")[0]


class Mailer:
    """Sends by writing a row (so that it is rolled back with the test); can refuse some sends."""

    refusals = 0

    def send(self, email: str, *, template: str) -> None:
        if self.refusals:
            self.refusals -= 1
            raise ConnectionError("the mail server refused the connection")
        Once.objects.create(key=f"mail:{email}", value={"template": template})

    def sent_to(self, email: str) -> str | None:
        row = Once.objects.filter(key=f"mail:{email}").first()
        return None if row is None else row.value["template"]

    def refuse_next(self, n: int) -> None:
        self.refusals = n


mailer = Mailer()

# On Django 5.2 the page's ``from django.tasks import task`` is the backport's (django_tasks).
for _block in marked_blocks():
    exec(compile(_block.replace("from django.tasks import", f"from {FRAMEWORK} import"), str(PAGE), "exec"))


@pytest.fixture(autouse=True)
def _mailer_accepts() -> Iterator[None]:
    mailer.refusals = 0
    yield
    mailer.refusals = 0


def _page(name: str) -> Any:
    return globals()[name]


def test_the_page_has_its_marked_blocks() -> None:
    assert len(marked_blocks()) == 4
    assert _page("send_welcome").module_path == f"{__name__}.send_welcome"


@pytest.mark.django_db
def test_the_page_tests_fail_when_sign_up_forgets_the_mail(
    monkeypatch: pytest.MonkeyPatch, enqueued_tasks: Any, run_tasks: Any
) -> None:
    monkeypatch.setitem(globals(), "sign_up", lambda email, lang="en": create_account(email))
    with pytest.raises(AssertionError, match="Nothing was enqueued"):
        _page("test_sign_up_enqueues_the_welcome_mail")(enqueued_tasks)
    with pytest.raises(AssertionError):
        _page("test_the_welcome_mail_goes_out")(run_tasks)


@pytest.mark.django_db
def test_the_sample_error_is_the_real_one() -> None:
    text = PAGE.read_text()
    sample = text.split("lists what *was* enqueued:\n\n", 1)[1].split("```\n", 1)[1].split("```", 1)[0].strip()
    capture = EnqueueCapture()
    task_id = Task.objects.enqueue("app.tasks.send_welcome", args=["bob@example.com"], kwargs={"lang": "en"}).id
    with pytest.raises(AssertionError) as failed:
        capture.assert_enqueued("app.tasks.send_welcome", args=["ada@example.com"])
    assert "AssertionError: " + str(failed.value) == sample.replace("task 41 ", f"task {task_id} ")
