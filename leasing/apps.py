from __future__ import annotations

from django.apps import AppConfig


class LeasingConfig(AppConfig):
    name = "leasing"
    verbose_name = "Leasing"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from leasing import checks  # noqa: F401  (registers the system checks)
        from leasing.routing import lease_routes

        lease_routes()  # an unknown alias is an ImproperlyConfigured error at startup, not at the first lease
