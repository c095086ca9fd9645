"""Task handlers used by the tests (plain callables and django.tasks tasks)."""

from __future__ import annotations

from typing import Any


def noop(**kwargs: Any) -> None:
    return None
