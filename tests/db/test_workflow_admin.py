"""The workflow admin (read-only, filtered by status, searched by id or name, a cancel action, links
to the members) and the Task admin's workflow filter and column."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.admin import site as admin_site
from django.contrib.auth.models import Permission
from django.test import Client, RequestFactory

from tasks.admin import workflows as workflow_admin
from tasks.exceptions import TaskNotFinished
from tasks.models import Task, Workflow
from tasks.workflows import chain, group, step
from tests.factories import StaffFactory
from tests.helpers.task_paths import NOOP

pytestmark = pytest.mark.django_db(transaction=True)

URL = "/admin/tasks/workflow/"
TASKS = "/admin/tasks/task/"


def listed(response: Any) -> list[int]:
    assert response.status_code == 200, response
    return [row.pk for row in response.context["cl"].result_list]


def test_the_list_filters_by_status_searches_and_links_the_members(staff: Client) -> None:
    flows = [chain(step(NOOP), step(NOOP), name=f"nightly-{n}").enqueue() for n in range(3)]
    Workflow.objects.filter(pk=flows[1].id).cancel()
    assert listed(staff.get(URL)) == [f.id for f in reversed(flows)]
    assert listed(staff.get(URL, {"status__exact": "RUNNING"})) == [flows[2].id, flows[0].id]
    assert listed(staff.get(URL, {"status__exact": "CANCELLED"})) == [flows[1].id]
    assert listed(staff.get(URL, {"q": str(flows[0].id)})) == [flows[0].id]
    assert listed(staff.get(URL, {"q": "nightly-2"})) == [flows[2].id]
    assert listed(staff.get(URL, {"q": "nightly"})) == []  # exact
    page = staff.get(URL).content.decode()
    assert f'href="{TASKS}?workflow_id={flows[0].id}"' in page
    assert f'href="/dashboard/workflows/{flows[0].id}/"' in page
    assert "0 successful, 0 failed, 2 remaining of 2" in page


def test_a_name_is_searched_among_the_newest_workflows_only(staff: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    old = chain(step(NOOP), name="rare").enqueue()
    for _ in range(3):
        chain(step(NOOP), name="common").enqueue()
    monkeypatch.setattr(workflow_admin, "NAME_WINDOW", 3)
    assert listed(staff.get(URL, {"q": "rare"})) == []
    assert listed(staff.get(URL, {"q": str(old.id)})) == [old.id]  # an id is always found
    monkeypatch.setattr(workflow_admin, "NAME_WINDOW", 4)
    assert listed(staff.get(URL, {"q": "rare"})) == [old.id]


def test_the_admin_is_read_only_and_cancels_through_its_action(staff: Client) -> None:
    done = group([step(NOOP) for _ in range(3)], then=step(NOOP)).enqueue()
    finished = chain(step(NOOP)).enqueue()
    Task.objects.filter(pk=finished.task_ids[0]).cancel()
    assert staff.get(f"{URL}add/").status_code == 403
    change = staff.get(f"{URL}{done.id}/change/")
    assert change.status_code == 200 and b'name="_save"' not in change.content
    assert staff.post(f"{URL}{done.id}/delete/", {"post": "yes"}).status_code == 403

    response = staff.post(URL, {"action": "cancel", "_selected_action": [done.id, finished.id]}, follow=True)
    assert "Cancelled 4 unfinished task(s)" in response.content.decode()
    assert Workflow.objects.get(pk=done.id).status == "CANCELLED"
    assert set(Task.objects.filter(workflow_id=done.id).values_list("status", flat=True)) == {"CANCELLED"}


def test_cancel_needs_the_task_change_permission(client: Client) -> None:
    done = chain(step(NOOP)).enqueue()
    viewer = StaffFactory.create(is_superuser=False)
    for codename in ("view_workflow", "view_task"):
        viewer.user_permissions.add(Permission.objects.get(content_type__app_label="tasks", codename=codename))
    client.force_login(viewer)
    response = client.get(URL)
    assert response.status_code == 200
    assert response.context["action_form"] is None  # no action it may run
    client.post(URL, {"action": "cancel", "_selected_action": [done.id]})
    assert Workflow.objects.get(pk=done.id).status == "RUNNING"


def test_the_task_admin_filters_a_workflows_members_and_shows_the_column(staff: Client) -> None:
    done = group([step(NOOP) for _ in range(3)], then=step(NOOP)).enqueue()
    other = chain(step(NOOP)).enqueue()
    plain = Task.objects.enqueue(NOOP).id
    assert listed(staff.get(TASKS, {"workflow_id": done.id})) == sorted(done.task_ids, reverse=True)
    assert listed(staff.get(TASKS, {"workflow_id": str(done.id), "status__exact": "AWAITING"})) == [done.callback_id]
    assert listed(staff.get(TASKS, {"workflow_id": str(done.id), "q": str(done.task_ids[1])})) == [done.task_ids[1]]
    assert listed(staff.get(TASKS, {"workflow_id": str(done.id), "q": NOOP})) == sorted(done.task_ids, reverse=True)
    assert listed(staff.get(TASKS, {"workflow_id": other.id})) == other.task_ids
    page = staff.get(TASKS).content.decode()
    assert f'href="{TASKS}?workflow_id={done.id}"' in page and "(waiting on 3)" in page
    assert plain in listed(staff.get(TASKS))
    for bad in ("abc", "0", str(2**63)):
        response = staff.get(TASKS, {"workflow_id": bad})
        assert response.status_code == 302 and "e=1" in response["Location"], bad


def test_an_unfinished_member_cannot_be_deleted_from_the_admin_and_a_finished_one_can(staff: Client) -> None:
    flow = chain(step(NOOP), step(NOOP)).enqueue()
    first, second = sorted(Task.objects.filter(workflow_id=flow.id).values_list("pk", flat=True))
    plain = Task.objects.enqueue(NOOP).id
    for response in (staff.get(f"{TASKS}{first}/delete/"), staff.post(f"{TASKS}{first}/delete/", {"post": "yes"})):
        assert response.status_code == 302 and response["Location"] == f"{TASKS}{first}/change/"
    assert Task.objects.filter(pk=first).exists()
    everything = {"action": "delete_selected", "_selected_action": [first, second, plain], "post": "yes"}
    refused = staff.post(TASKS, everything, follow=True)  # refused whole: nothing deleted
    assert "Nothing deleted" in " ".join(str(m) for m in refused.context["messages"])
    assert Task.objects.filter(pk__in=[first, second, plain]).count() == 3
    # A member requeued while the operator confirmed: the DELETE itself refuses it, and the rest.
    model_admin = admin_site._registry[Task]
    with pytest.raises(TaskNotFinished):
        model_admin.delete_queryset(RequestFactory().post(TASKS), Task.objects.filter(pk__in=[first, second, plain]))
    assert Task.objects.filter(pk__in=[first, second, plain]).count() == 3
    Task.objects.filter(pk=first).cancel()  # the first ends: its dependant is settled (cancelled)
    assert set(Task.objects.filter(pk__in=[first, second]).values_list("status", flat=True)) == {"CANCELLED"}
    assert staff.post(f"{TASKS}{first}/delete/", {"post": "yes"}).status_code == 302
    assert not Task.objects.filter(pk=first).exists()
