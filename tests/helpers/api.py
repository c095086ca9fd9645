"""The JSON API as the tests call it: one bearer token, and a client that sends JSON and reads it back."""

from __future__ import annotations

import json
from typing import Any

from django.test import Client

#: The API token of the tests (``api_token`` and the other API fixtures put it in LEASING_API_TOKENS).
TOKEN = "test-token-123"


class Api:
    """Calls the JSON API through Django's test client, with ``TOKEN`` unless other headers are given."""

    def __init__(self, client: Client, headers: dict[str, str] | None = None) -> None:
        self.client = client
        self.headers = headers if headers is not None else {"Authorization": f"Bearer {TOKEN}"}

    def call(self, method: str, url: str, body: Any = None, raw: str | None = None) -> tuple[int, Any]:
        """The status and the decoded body (None when empty) of ``method url`` with ``body`` as JSON, or
        the ``raw`` text as it is."""
        data = raw if raw is not None else (json.dumps(body) if body is not None else "")
        if method == "GET":
            response = self.client.get(url, headers=self.headers)
        else:
            response = getattr(self.client, method.lower())(
                url, data=data, content_type="application/json", headers=self.headers
            )
        content = json.loads(response.content) if response.content else None
        return response.status_code, content

    def enqueue(self, body: Any = None, *, raw: str | None = None) -> tuple[int, Any]:
        """``POST /api/tasks``: the status and the decoded reply."""
        return self.call("POST", "/api/tasks", body, raw=raw)
