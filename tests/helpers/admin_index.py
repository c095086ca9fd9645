"""Child: what a staff superuser sees of the admin under this process's settings, as one JSON line:
whether ``GeneratorState`` is registered, whether the admin index mentions the generator, and the
status of its changelist. Everything written (the user, the session) is rolled back."""

from __future__ import annotations

from django.contrib import admin
from django.contrib.auth import get_user_model
from django.db import transaction
from django.test import Client

from tasks.models import GeneratorState
from tests.helpers import emit


class _RolledBack(Exception):
    pass


def main(args: list[str]) -> int:
    try:
        with transaction.atomic():
            client = Client()
            client.force_login(get_user_model().objects.create_superuser("admin-index", "a@example.com", "x"))
            index = client.get("/admin/")
            emit(
                registered=admin.site.is_registered(GeneratorState),
                index=index.status_code,
                index_mentions_generator="generator" in index.content.decode().lower(),
                changelist=client.get("/admin/tasks/generatorstate/").status_code,
            )
            raise _RolledBack
    except _RolledBack:
        pass
    return 0
