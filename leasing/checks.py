from __future__ import annotations

from typing import Any

from django.core.checks import CheckMessage, Error, register
from django.db import connections
from django.db.utils import ConnectionHandler


@register()
def check_postgresql(app_configs: Any = None, databases: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Leases rely on PostgreSQL: ON CONFLICT ... DO UPDATE ... WHERE, SKIP LOCKED, sequences, LISTEN."""
    return postgresql_errors(connections)


def postgresql_errors(handler: ConnectionHandler) -> list[CheckMessage]:
    errors: list[CheckMessage] = []
    for alias in handler:
        vendor = handler[alias].vendor
        if vendor != "postgresql":
            errors.append(
                Error(
                    f"django-leasing needs PostgreSQL, but database {alias!r} uses {vendor!r}.",
                    hint="Point DATABASE_URL (or DATABASES) at a PostgreSQL server, version 13 or newer.",
                    id="leasing.E001",
                )
            )
    return errors


@register()
def check_api_tokens(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Scopes of LEASING_API_TOKENS are permission names: a typo must not pass unnoticed."""
    from django.conf import settings
    from django.core.exceptions import ImproperlyConfigured

    from leasing.access import parse_tokens

    try:
        parse_tokens(getattr(settings, "LEASING_API_TOKENS", None))
    except ImproperlyConfigured as exc:
        return [Error(str(exc), hint="See leasing/access.py for the scopes a token may carry.", id="leasing.E002")]
    return []
