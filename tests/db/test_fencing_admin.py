"""The admin saves through Model.save(): a leader's newer fencing token survives an admin edit."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from django.db import connections
from django.db.models.signals import pre_save
from django.test import Client

from leasing import StaleTokenError
from leasing.fencing import fenced_update
from tasks.models import GeneratorState
from tests.factories import StaffFactory

pytestmark = pytest.mark.django_db(transaction=True)


def fenced_write_from_another_connection(token: int) -> None:
    """The leader writes, in its own thread and connection, committed before we go on."""
    errors: list[BaseException] = []

    def write() -> None:
        try:
            fenced_update(GeneratorState.objects.filter(name="default"), token)
        except BaseException as exc:  # handed to the test thread
            errors.append(exc)
        finally:
            connections.close_all()

    thread = threading.Thread(target=write)
    thread.start()
    thread.join(30)
    assert not thread.is_alive() and not errors, errors


def test_admin_edit_racing_a_leader_write_keeps_the_leaders_token(client: Client) -> None:
    GeneratorState.objects.create(name="default", fence_token=5)
    client.force_login(StaffFactory.create())
    url = "/admin/tasks/generatorstate/default/change/"
    form = client.get(url).context["adminform"].form
    data = {name: form[name].value() for name in form.fields}
    data.update(running="on", rate="7.5")

    def leader_writes_meanwhile(sender: Any, instance: GeneratorState, **kwargs: Any) -> None:
        # Between the admin's load of the row (token 5) and its UPDATE: a newer leader writes.
        if instance.fence_token == 5:
            fenced_write_from_another_connection(9)

    pre_save.connect(leader_writes_meanwhile, sender=GeneratorState)
    try:
        response = client.post(url, data)
    finally:
        pre_save.disconnect(leader_writes_meanwhile, sender=GeneratorState)
    assert response.status_code == 302, response.content.decode()[:2000]

    row = GeneratorState.objects.get(name="default")
    assert (row.running, row.rate) == (True, 7.5)  # the admin's edit landed
    assert row.fence_token == 9  # and the leader's newer token was not lowered back to 5
    with pytest.raises(StaleTokenError, match="written with token 9"):
        fenced_update(GeneratorState.objects.filter(name="default"), 7, ticks=7)
    assert GeneratorState.objects.get(name="default").ticks == 0
