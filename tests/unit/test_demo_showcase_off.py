"""The demo's showcase (tasks/demo/showcase.py) is the demo's only: without TASKS_DEMO_SHOWCASE, which
only ``manage.py demo`` sets, the project declares no demo schedule nor fair queue, and a generator
enqueues its sleep tasks alone."""

from __future__ import annotations

from typing import Any

from django.conf import settings

from tasks.conf import get_settings
from tasks.demo import showcase
from tasks.demo.generator import Generator


def test_a_project_without_the_showcase_gets_none_of_it() -> None:
    assert not settings.DEMO_SHOWCASE
    assert not showcase.enabled()
    assert Generator().showcase is None
    assert "demo-digest" not in get_settings().SCHEDULES
    assert showcase.FAIR_QUEUE not in get_settings().FAIR_QUEUES


def test_the_showcase_is_on_where_the_demo_asks(settings: Any) -> None:
    settings.DEMO_SHOWCASE = True
    assert Generator().showcase is not None
    assert Generator(with_showcase=False).showcase is None
