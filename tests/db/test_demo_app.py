"""The demo app ("tasks.demo") brings the demo's generator to the admin, as it does to the dashboard
(tests/db/test_dashboard_vocabulary.py): a project of your own, which installs only "leasing" and
"tasks", never sees the generator state in its admin. The admin's registry is global and filled once
per process, so each project is a process of its own, started with its own INSTALLED_APPS."""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers import ensure_ended, read_message, start_child

pytestmark = pytest.mark.django_db


def admin_as_seen(**env: str) -> dict[str, Any]:
    with ensure_ended(start_child("admin_index", **env)) as proc:
        seen = read_message(proc)
        assert proc.wait(60) == 0, proc.stderr.read() if proc.stderr else ""
    return seen


def test_a_project_without_the_demo_app_has_no_generator_in_its_admin() -> None:
    seen = admin_as_seen(LEASING_TEST_WITHOUT_DEMO="1")
    assert seen == {"registered": False, "index": 200, "index_mentions_generator": False, "changelist": 404}


def test_the_demo_project_has_its_generator_in_the_admin() -> None:
    seen = admin_as_seen()
    assert seen == {"registered": True, "index": 200, "index_mentions_generator": True, "changelist": 200}
