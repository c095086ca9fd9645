"""System checks of a pooled alias (docs/howto/pgbouncer.md)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
from django.conf import settings as django_settings

from tasks.checks import check_pooled_databases
from tasks.lifecycle.listening import wakeup_for, where


def ids(settings: Any) -> list[str]:
    return sorted(str(message.id) for message in check_pooled_databases())


@pytest.fixture
def default_database() -> Iterator[dict[str, Any]]:
    """DATABASES["default"], changed in place for one test and put back (overriding DATABASES
    itself is refused: Django warns that open connections would not follow)."""
    entry = django_settings.DATABASES["default"]
    saved = copy.deepcopy(entry)
    yield entry
    entry.clear()
    entry.update(saved)


def test_a_direct_set_up_needs_nothing(settings: Any) -> None:
    settings.LEASING_TASKS = {}
    assert ids(settings) == []


def test_a_pooled_alias_must_exist_and_should_have_no_server_side_cursors(
    settings: Any, default_database: dict[str, Any]
) -> None:
    default_database["DISABLE_SERVER_SIDE_CURSORS"] = False
    settings.LEASING_TASKS = {"POOLED_DATABASES": ["default", "nosuch"], "LISTEN_URLS": {"other": "postgres://x/y"}}
    assert ids(settings) == ["tasks.E103", "tasks.E103", "tasks.W105"]
    default_database["DISABLE_SERVER_SIDE_CURSORS"] = True
    settings.LEASING_TASKS = {"POOLED_DATABASES": ["default"]}
    assert ids(settings) == []


def test_server_side_prepared_statements_on_a_pooled_alias_are_refused(
    settings: Any, default_database: dict[str, Any]
) -> None:
    default_database["DISABLE_SERVER_SIDE_CURSORS"] = True
    default_database["OPTIONS"] = {**default_database.get("OPTIONS", {}), "server_side_binding": True}
    settings.LEASING_TASKS = {"POOLED_DATABASES": ["default"]}
    assert ids(settings) == ["tasks.E104"]
    default_database["OPTIONS"]["prepare_threshold"] = None  # binding on the server, nothing prepared
    assert ids(settings) == []


def test_the_wake_up_source_follows_the_settings(settings: Any) -> None:
    settings.LEASING_TASKS = {}
    assert wakeup_for("default", 2.0).description == "LISTEN on default"
    settings.LEASING_TASKS = {"POOLED_DATABASES": ["default"]}
    polling = wakeup_for("default", 2.0)
    assert polling.connect is None
    assert polling.description == "polling every 2s (default is pooled and has no LISTEN_URLS entry)"
    settings.LEASING_TASKS = {
        "POOLED_DATABASES": ["default"],
        "LISTEN_URLS": {"default": "postgres://u:secret@db:5432/app"},
    }
    direct = wakeup_for("default", 2.0)
    assert direct.connect is not None
    assert direct.description == "LISTEN on the direct URL of default (db:5432/app)"
    assert "secret" not in where("postgres://u:secret@db:5432/app")


def test_an_unparsable_listen_url_is_refused_without_quoting_it(settings: Any) -> None:
    settings.LEASING_TASKS = {"LISTEN_URLS": {"default": "postgres://u:s3%ZZcret@db/x"}}
    messages = check_pooled_databases()
    assert [message.id for message in messages] == ["tasks.E106"]
    assert "ZZcret" not in f"{messages[0].msg} {messages[0].hint}"
    wakeup = wakeup_for("default", 0.5)
    assert wakeup.connect is None  # with the checks skipped: polling
    assert "ZZcret" not in wakeup.description
    assert wakeup.description == "polling every 0.5s (the LISTEN_URLS entry of default cannot be parsed)"


@pytest.mark.parametrize(
    "bad",
    [
        {"LISTEN_URLS": "postgres://u@db/x"},
        {"LISTEN_URLS": {"default": 5432}},
        {"LISTEN_URLS": ["default"]},
        {"POOLED_DATABASES": "default"},
    ],
)
def test_malformed_pooler_settings_are_refused_by_a_check(settings: Any, bad: dict[str, Any]) -> None:
    """Not a crash of ``manage.py check`` (nor an error per character of a string)."""
    from tasks.checks import check_task_settings

    settings.LEASING_TASKS = bad
    assert check_pooled_databases() == []  # reported once, by the settings check below
    messages = check_task_settings()
    assert [message.id for message in messages] == ["tasks.E100"]
    assert next(iter(bad)) in messages[0].msg
