from __future__ import annotations

from typing import Any

import pytest

from leasing.holder import default_holder_id


@pytest.fixture
def holder_id() -> str:
    return default_holder_id()


@pytest.fixture
def other_holder_id() -> str:
    return default_holder_id()


@pytest.fixture
def short_leasing(settings: Any) -> None:
    """Fast clocks for holder tests: short backoff so retries do not dominate the run time."""
    settings.LEASING = {"DEFAULT_TTL": 1.0, "BACKOFF_INITIAL": 0.01, "BACKOFF_MAX": 0.1}
