"""Browser tests: Debian's Chromium driven by Playwright (no browser download)."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from typing import Any

import pytest

CHROMIUM_ARGS = [
    "--no-sandbox",  # CI runs as root
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-quic",
    "--no-first-run",
]


def chromium_path() -> str:
    path = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        pytest.fail(
            "browser tests need Chromium: `apt-get install chromium` (what .ci/run does), set CHROMIUM=/path, "
            "or deselect them with -m 'not e2e'",
            pytrace=False,
        )
    return path


@pytest.fixture
def browser_page(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    # Playwright's sync API runs an event loop in this thread; the ORM calls the test makes
    # between browser steps are still plain synchronous code.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_path(), headless=True, args=CHROMIUM_ARGS)
        context = browser.new_context(viewport={"width": 1280, "height": 860})
        page = context.new_page()
        page.set_default_timeout(30_000)
        try:
            yield page
        finally:
            context.close()
            browser.close()
            # While Playwright's loop runs, Django's connections are context-local (asgiref Local):
            # the test's ORM calls used a connection of that context. Close it here, inside it.
            from django.db import connections

            connections.close_all()
    _wait_for_other_sessions_to_end()


def _wait_for_other_sessions_to_end(timeout: float = 10.0) -> None:
    """The live server answers the page's last refresh in a thread of its own; once the browser is
    gone, wait for such sessions to end (and end stragglers) so the test database can be dropped."""
    from django.db import connection

    query = "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
    deadline = time.monotonic() + timeout
    with connection.cursor() as cursor:
        while True:
            cursor.execute(query)
            others = [row[0] for row in cursor.fetchall()]
            if not others:
                return
            if time.monotonic() > deadline:
                cursor.execute("SELECT pg_terminate_backend(pid) FROM (" + query + ") AS stray")
                return
            time.sleep(0.05)
