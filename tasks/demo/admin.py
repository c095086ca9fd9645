"""The generator's state in the admin: the demo app's, so registered only where ``"tasks.demo"`` is
installed (Django's admin imports each installed app's ``admin`` module); a project of your own never
sees it (docs/reference/dashboard.md)."""

from __future__ import annotations

from django.contrib import admin

from leasing.admin import CheckedInputAdmin
from tasks.models import GeneratorState


@admin.register(GeneratorState)
class GeneratorStateAdmin(CheckedInputAdmin):
    list_display = ("name", "running", "rate", "generated", "leader", "leader_seen_at")
    readonly_fields = ("generated", "leader", "leader_seen_at", "observed_running", "ticks", "fence_token")
