"""Attacks on the one vocabulary (issue 41) where test_dashboard_vocabulary.py does not look: page
titles, the admin (lists, filters, change, history and delete pages, the workflow admin) and a bulk
operation's page. No page shows a task's status by its machine value or an old synonym."""

from __future__ import annotations

import pytest
from django.test import Client

from tasks.models import BulkOperation, Task
from tests.db.test_dashboard_vocabulary import FORBIDDEN, _Text, every_state

pytestmark = pytest.mark.django_db


class _WithTitles(_Text):
    """The text a person reads, the window's title included."""

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        super().handle_starttag(tag, attrs)
        if tag == "title":
            self._skip -= 1

    def handle_endtag(self, tag: str) -> None:
        if tag == "title":
            self._skip += 1
        super().handle_endtag(tag)


def shown_names(staff: Client, url: str) -> list[str]:
    response = staff.get(url)
    assert response.status_code == 200, url
    page = _WithTitles()
    page.feed(response.content.decode())
    return sorted(set(FORBIDDEN.findall(" ".join(page.parts))))


def test_no_admin_page_or_title_names_a_status_by_its_machine_value(staff: Client) -> None:
    ids = every_state()
    Task.objects.filter(pk=ids["cancelled"]).cancel()
    workflow = Task.objects.get(pk=ids["awaiting"]).workflow_id
    urls = [
        "/admin/tasks/task/",
        *(f"/admin/tasks/task/?status__exact={s}" for s in ("READY", "FAILED", "SUCCESSFUL", "AWAITING")),
        *(f"/admin/tasks/task/{pk}/change/" for pk in ids.values()),
        *(f"/admin/tasks/task/{pk}/history/" for pk in ids.values()),
        f"/admin/tasks/task/{ids['succeeded']}/delete/",
        "/admin/tasks/workflow/",
        f"/admin/tasks/workflow/{workflow}/change/",
        *(f"/dashboard/tasks/{pk}/" for pk in ids.values()),
        "/dashboard/tasks/failed/",
    ]
    found = {url: names for url in urls if (names := shown_names(staff, url))}
    assert found == {}


def test_a_bulk_operations_page_names_its_statuses_by_their_labels(staff: Client) -> None:
    every_state()
    response = staff.post("/dashboard/tasks/bulk/", {"kind": "retry", "status": ["Failed"], "queue": "q"})
    assert response.status_code == 302, response.content.decode()[-500:]
    operation = BulkOperation.objects.get()
    assert operation.filter["status"] == ["FAILED"]  # stored by machine value, shown by label
    # The operation's own status (Pending, Done, ...) is not a task's; its filter's statuses are.
    for url in (f"/dashboard/tasks/bulk/{operation.pk}/", "/dashboard/tasks/bulk/"):
        page = staff.get(url).content.decode()
        filter_cell = page.split("status=", 1)[1].split("</td>", 1)[0]
        assert filter_cell.startswith("Failed") and "FAILED" not in filter_cell, (url, filter_cell[:80])
