"""Pieces that need no database."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from django.db.utils import ConnectionHandler

from leasing import LeaseAcquisitionError, LeaseLost, LeasingError, StaleTokenError
from leasing.checks import postgresql_errors
from leasing.conf import LeasingSettings, get_settings
from leasing.holder import backoff_delay
from leasing.models import seconds


def test_exceptions_share_one_root_and_default_to_their_docstring() -> None:
    for cls in (LeaseAcquisitionError, LeaseLost, StaleTokenError):
        assert issubclass(cls, LeasingError)
        assert str(cls()) == (cls.__doc__ or "").strip()
    assert str(LeaseLost("custom")) == "custom"


def test_seconds_accepts_numbers_and_timedeltas_and_rejects_nonsense() -> None:
    assert seconds(2) == 2.0
    assert seconds(dt.timedelta(milliseconds=250)) == 0.25
    for bad in (0, -1, dt.timedelta(0), float("nan")):
        with pytest.raises(ValueError, match="positive"):
            seconds(bad)


def test_settings_defaults_and_overrides(settings: Any) -> None:
    settings.LEASING = {}
    assert get_settings() == LeasingSettings()
    settings.LEASING = {"DEFAULT_TTL": 5}
    assert get_settings().DEFAULT_TTL == 5
    settings.LEASING = {"DEFAULT_TLL": 5}
    with pytest.raises(ValueError, match="DEFAULT_TLL"):
        get_settings()


def test_backoff_grows_then_stays_under_the_cap() -> None:
    firsts = [backoff_delay(0, 0.1, 5.0) for _ in range(50)]
    assert all(0.05 <= d <= 0.1 for d in firsts)
    lasts = [backoff_delay(30, 0.1, 5.0) for _ in range(50)]
    assert all(2.5 <= d <= 5.0 for d in lasts)


def test_system_check_rejects_other_databases() -> None:
    handler = ConnectionHandler({"default": {"ENGINE": "django.db.backends.dummy"}})
    errors = postgresql_errors(handler)
    assert [error.id for error in errors] == ["leasing.E001"]
    assert "needs PostgreSQL" in errors[0].msg


def test_system_check_accepts_postgresql() -> None:
    handler = ConnectionHandler({"default": {"ENGINE": "django.db.backends.postgresql", "NAME": "x"}})
    assert postgresql_errors(handler) == []
