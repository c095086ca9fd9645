"""The OpenAPI 3.1 document of the JSON API, served at ``/api/openapi.json``: data and no logic,
in parts read as a reader of the API reads them: ``parts.py`` (the fields, parameters and helpers
everything shares: ``STRING``, ``TOKEN``, ``ERROR``, ``_op``, ``_object``, ...), ``schemas.py`` (the
answers and bodies, and ``#/components/schemas``), ``paths.py`` (the leases and the operator's
routes) and ``task_paths.py`` (the tasks, bulk operations and workflows).

The tests hold the API to it: ``tests/db/test_api.py`` checks that it names every route and exactly
the methods each serves, and every answer a test gets is validated against its operation's
responses (tests/helpers/api.py), an object's undeclared field refused. So an answer object lists
all its fields, ``required`` all but the conditional ones (``_object``), and free-form ones say so
(``ANY_OBJECT``)."""

from __future__ import annotations

from typing import Any

from tasks.web.api.openapi.paths import lease_paths, operator_paths
from tasks.web.api.openapi.schemas import component_schemas
from tasks.web.api.openapi.task_paths import task_paths


def document(server_url: str = "/api") -> dict[str, Any]:
    paths: dict[str, Any] = {**lease_paths(), **task_paths(), **operator_paths()}
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "django-leasing API",
            "version": "1",
            "description": (
                "Leases with fencing tokens and a lease-based task queue. Reads need the model's view"
                " permission (token scope), actions its change permission: leasing.view_lease,"
                " leasing.change_lease, tasks.view_task, tasks.add_task (enqueue), tasks.change_task,"
                " tasks.view_generatorstate, tasks.change_generatorstate (workflows need the task"
                " permissions). Strings must not contain NUL or lone surrogates, numbers must be finite,"
                " date-times are ISO 8601's extended format with a time zone (2030-01-31T12:00:00Z,"
                " 2030-01-31 13:00:00.5+01:00) from 1970 to before 3000 (UTC). A refused request"
                " changes nothing."
            ),
        },
        "servers": [{"url": server_url}],
        "security": [{"bearer": []}, {"session": []}],
        "paths": paths,
        "components": {
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "session": {"type": "apiKey", "in": "cookie", "name": "sessionid"},
            },
            "schemas": component_schemas(),
        },
    }
